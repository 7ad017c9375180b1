"""Which receive copy the row form uses (CPU): the overlapped one only for real ranks over peer
pointers whose buffers hold at least RECV_OVERLAP_MIN_TOKENS tokens per rank (or when the config
asks), the block-by-block expand copy in the emulated world and on one rank, the after-arrival copy
on the NVSHMEM route and below the threshold; the combine's mode; the one-launch combine's shape."""

import types

import pytest

from tlx_dist.comm import symm
from tlx_dist.comm.symm import ExchangeConfig, Tile, policy, tuning
from tlx_dist.comm.symm.config import RECV_OVERLAP_MIN_TOKENS


def _bufs(backend="symm", W=2, T=RECV_OVERLAP_MIN_TOKENS, nvshmem=False, **cfg):
    return types.SimpleNamespace(use_nvshmem=nvshmem, hier=None, backend=backend, world_size=W,
                                 config=ExchangeConfig(**cfg),
                                 modes={}, layout=types.SimpleNamespace(max_tokens=T))


def test_auto_by_capacity():
    assert policy.recv_mode(_bufs(T=RECV_OVERLAP_MIN_TOKENS)) == "overlap"
    assert policy.recv_mode(_bufs(T=RECV_OVERLAP_MIN_TOKENS - 1)) == "after"
    assert policy.recv_mode(_bufs(T=4096, W=8)) == "after"
    assert policy.recv_mode(_bufs(nvshmem=True)) == "after"
    for backend in ("emulated", "local"):
        assert policy.recv_mode(_bufs(backend=backend, T=16)) == "blocks"
    assert policy.recv_mode(_bufs(W=1)) == "blocks"


def test_resolved_once_per_buffer_set():
    b = _bufs(T=128, recv_overlap="on")
    assert policy.recv_mode(b) == "overlap" and b.modes == {"recv": "overlap"}
    b.config = ExchangeConfig(recv_overlap="off")  # (not how a config changes: the resolved mode stays)
    assert policy.recv_mode(b) == "overlap"
    assert policy.recv_mode(_bufs(T=128)) == "after"


@pytest.mark.parametrize("force,want", [("on", "overlap"), ("off", "after")])
def test_forced(force, want):
    assert policy.recv_mode(_bufs(T=128, recv_overlap=force)) == want
    assert policy.recv_mode(_bufs(T=1 << 20, recv_overlap=force)) == want
    # the NVSHMEM route has no receiving programs; the emulated world's ranks launch one after another
    assert policy.recv_mode(_bufs(nvshmem=True, recv_overlap=force)) == "after"
    assert policy.recv_mode(_bufs(backend="emulated", recv_overlap=force)) == "blocks"


def test_bad_value_names_the_field():
    with pytest.raises(ValueError, match=r"ExchangeConfig.recv_overlap='1' must be 'auto', 'on' or 'off'"):
        ExchangeConfig(recv_overlap="1")


# --- per-layer receive regions (SymmDispatcher(row_regions=...)) ------------------------------------


def test_row_regions_append_to_the_layout_and_move_nothing():
    import torch

    from tlx_dist.comm.symm.buffers import SymmLayout

    args = (1000, 2048, 8, 64, 2, torch.bfloat16)
    plain, three = SymmLayout.build(*args), SymmLayout.build(*args, row_regions=3)
    fields = [f for f in vars(plain) if f.startswith("off_")]
    assert all(getattr(three, f) == getattr(plain, f) for f in fields if f not in ("off_rows", "off_rcnt"))
    assert three.off_rows == plain.nbytes and three.off_rows % 256 == 0
    assert three.rows_region_bytes >= 2 * 1000 * 2048 * 2 and three.rows_region_bytes % 256 == 0
    # then the overlapped form's region counters, [3, W] int64, one aligned block
    assert three.off_rcnt == three.off_rows + 3 * three.rows_region_bytes and plain.off_rcnt == 0
    assert three.nbytes == three.off_rcnt + 256
    staged = SymmLayout.build(*args, staging=True, row_regions=1)  # after the NVSHMEM staging regions
    assert staged.off_rows == SymmLayout.build(*args, staging=True).nbytes
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="row_regions"):
            SymmLayout.build(*args, row_regions=bad)


def test_dispatcher_hands_out_regions_in_order():
    d = symm.SymmDispatcher(8, None, row_regions=2)
    assert [d.claim_rows_region() for _ in range(3)] == [0, 1, None]  # the third layer copies
    assert symm.SymmDispatcher(8, None).claim_rows_region() is None
    with pytest.raises(ValueError, match="row_regions"):
        symm.SymmDispatcher(8, None, row_regions=-1)


def test_training_config_checks_ep_row_regions():
    import os

    from train.config import load_config

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                          "h200_2gpu_ep2.toml")
    assert load_config(recipe).parallel.ep_row_regions  # the EP=2 recipe turns them on
    assert not load_config(recipe, ["parallel.ep_row_regions=false"]).parallel.ep_row_regions
    # where no fused EP layer reads them the key does nothing: the recipe still runs with these overrides
    for other in (["parallel.ep=1", "parallel.dp=1"], ["parallel.moe_pipeline=separate"],
                  ["parallel.dispatcher=all_to_all"]):
        assert load_config(recipe, other).parallel.ep_row_regions
    with pytest.raises(ValueError, match="parallel.ep_row_regions"):
        load_config(recipe, ["parallel.ep_row_regions=2"])


def test_training_config_checks_exchange_overlap():
    """``parallel.exchange.overlap``: off in the recipe (slower over NVLink); on, it needs the
    receive regions (over the flat exchange) and a static capacity, each named when missing; the old
    flat key names its replacement."""
    import os

    from train.config import load_config

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                          "h200_2gpu_ep2.toml")
    assert not load_config(recipe).parallel.exchange.overlap
    cfg = load_config(recipe, ["parallel.exchange.overlap=true", "parallel.capacity_factor=2.0"])
    assert cfg.parallel.exchange.overlap and cfg.parallel.capacity_factor == 2.0
    with pytest.raises(ValueError, match="parallel.capacity_factor > 0"):
        load_config(recipe, ["parallel.exchange.overlap=true"])
    with pytest.raises(ValueError, match="parallel.ep_row_regions = true"):
        load_config(recipe, ["parallel.exchange.overlap=true", "parallel.capacity_factor=2.0",
                             "parallel.ep_row_regions=false", "parallel.exchange.topology='flat'"])
    # (topology "auto": whether the exchange is flat depends on the ranks' nodes, checked when it is
    # built -- tests/test_train_exchange_choice.py)
    assert not load_config(recipe, ["parallel.exchange.overlap=true", "parallel.capacity_factor=2.0",
                                    "parallel.ep_row_regions=false"]).parallel.ep_row_regions
    with pytest.raises(ValueError, match="parallel.ep_overlap was replaced by parallel.exchange.overlap"):
        load_config(recipe, ["parallel.ep_overlap=true"])


def _claims(rank, world, n, overlap=(False, False)):
    import torch.distributed as dist

    d = symm.SymmDispatcher(8, dist.group.WORLD, row_regions=2, overlap=overlap[rank] or None)
    for _ in range(n[rank]):
        d.claim_rows_region()
    try:
        d._check_ranks_agree()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def test_ranks_must_claim_the_same_regions():
    from _dist import run_world

    assert run_world(_claims, 2, [2, 2]) == ["ok", "ok"]
    # ranks asking for different configs would take different forms: refused at the first op
    out = run_world(_claims, 2, [2, 2], (False, True))
    assert all("ranks asked for different exchange configs" in o for o in out), out
    out = run_world(_claims, 2, [1, 2])
    assert all("claimed different numbers of receive regions (1 to 2" in o for o in out), out


# --- the combine's mode (policy.comb_mode) and the one-launch combine's shape ---------------------------


def test_comb_mode(monkeypatch):
    """One launch (summing programs beside the senders) for real ranks over peer pointers on CUDA; the
    per-block counters summed after the sends in the emulated world and on one rank; one ARRIVE count
    per rank on the NVSHMEM route, on ROCm (co-residency unchecked there), or when switched off."""
    import torch

    monkeypatch.setattr(torch.version, "hip", None)
    assert policy.comb_mode(_bufs()) == "overlap"
    assert policy.comb_mode(_bufs(T=128, W=8)) == "overlap"
    assert policy.comb_mode(_bufs(comb_overlap="on")) == "overlap"
    assert policy.comb_mode(_bufs(nvshmem=True)) == "after"
    for backend in ("emulated", "local"):
        assert policy.comb_mode(_bufs(backend=backend)) == "blocks"
        assert policy.comb_mode(_bufs(backend=backend, comb_overlap="off")) == "blocks"
    assert policy.comb_mode(_bufs(W=1)) == "blocks"
    b = _bufs(comb_overlap="off")
    assert policy.comb_mode(b) == "after"
    b.config = ExchangeConfig()  # (not how a config changes: the resolved mode stays)
    assert policy.comb_mode(b) == "after" and policy.comb_mode(_bufs()) == "overlap"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert policy.comb_mode(_bufs()) == "after"


def test_one_launch_combine_shape(monkeypatch):
    """Summing programs: 4 an SM by default, never more than the work units (COMB_BLOCK tokens by one
    column tile) nor half the CTAs an SM holds at the reduce-send's warps (so senders always find
    room: the summing programs wait for them); summing tiles of ~4096 / W elements a rank."""
    import torch

    monkeypatch.setattr(tuning, "_num_programs", lambda dev, per_sm=4: 132 * per_sm)

    def bufs(W, T_max=16384, D=7168, **cfg):
        return types.SimpleNamespace(device=torch.device("cuda", 0), config=ExchangeConfig(**cfg),
                                     layout=types.SimpleNamespace(world_size=W, hidden=D, comb_block=32,
                                                                  max_tokens=T_max))

    assert tuning.comb_recv_shape(bufs(2), 16384) == (2 * 132, 4 * 132, 4, 512)
    assert tuning.comb_recv_shape(bufs(8), 16384)[2:] == (1, 512)
    assert tuning.comb_recv_shape(bufs(4, D=256), 16384)[2:] == (4, 256)
    assert tuning.comb_recv_shape(bufs(2), 64)[1] == 2 * 14  # 2 token blocks x 14 column tiles
    for W, D in ((3, 256), (6, 128), (5, 7168)):  # summing tile rows: a power of two
        rr_t = tuning.comb_recv_shape(bufs(W, D=D), 16384)[2]
        assert rr_t >= 1 and rr_t & (rr_t - 1) == 0, (W, D, rr_t)
    assert tuning.comb_recv_shape(bufs(2), 0)[1] >= 1
    more = bufs(2, comb_sum_per_sm=8, comb_send_per_sm=3)
    assert tuning.comb_recv_shape(more, 16384)[:2] == (3 * 132, 4 * 132)  # summing programs capped at 4 an SM
    eight = Tile(cols=512, warps=8, per_sm=16)
    assert tuning.comb_recv_shape(bufs(2, reduce_send=eight), 16384)[1] == 2 * 132  # 4 CTAs of 8 warps an SM: 2 sum
    sixteen = Tile(cols=512, warps=16, per_sm=16)
    assert tuning.comb_recv_shape(bufs(2, reduce_send=sixteen), 16384)[1] == 1 * 132
