"""Where the copy-engine row form runs (CPU): ``policy.ce_mode`` by setting, world, route and size;
the density rule; the copy call on CPU; the argument and config checks that name what is wrong."""

import ctypes
import dataclasses
import types

import pytest
import torch

from tlx_dist.comm import copy_engine
from tlx_dist.comm.symm import ExchangeConfig, Tile, api, policy
from tlx_dist.comm.symm.ce_transport import ce_chunks
from tlx_dist.comm.symm.config import CE_MIN_DENSITY, CE_MIN_TOKENS, ce_density
from tlx_dist.comm.symm.tuning import reduce_recv_shape


def _bufs(backend="symm", W=2, T=CE_MIN_TOKENS, E=64, K=8, nvshmem=False, regions=1, setting="auto", device="cuda",
          claimed=False):
    """What the policy reads of a buffer set (no memory behind it)."""
    return types.SimpleNamespace(use_nvshmem=nvshmem, hier=None, backend=backend, world_size=W,
                                 device=torch.device(device),
                                 config=ExchangeConfig(copy_engine=setting, timeout_s=30.0), modes={},
                                 timeout_s=30.0, _config_claimed=claimed,
                                 layout=types.SimpleNamespace(max_tokens=T, world_size=W, num_experts=E, top_k=K,
                                                              row_regions=regions))


@pytest.fixture
def cuda_copies(monkeypatch):
    """As on a CUDA host whose driver loads (this machine has neither)."""
    monkeypatch.setattr(copy_engine, "available", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch.version, "hip", None)


def test_density_is_the_chance_a_token_reaches_a_peer():
    assert ce_density(2, 64, 8) == pytest.approx(0.99762, abs=1e-4)
    assert ce_density(4, 64, 8) == pytest.approx(0.91475, abs=1e-4)
    assert ce_density(8, 256, 8) == pytest.approx(0.66, abs=0.01)
    # brute force over every top-K set at a small size
    import itertools
    sets = list(itertools.combinations(range(8), 3))
    hit = sum(any(g // 4 == 1 for g in s) for s in sets) / len(sets)
    assert ce_density(2, 8, 3) == pytest.approx(hit)


def test_auto(cuda_copies):
    assert policy.ce_mode(_bufs()) is True
    assert policy.ce_mode(_bufs(T=CE_MIN_TOKENS - 1)) is False  # small ops keep SM stores
    assert policy.ce_mode(_bufs(W=4)) is False  # 0.915 < CE_MIN_DENSITY: too many rows would cross for nothing
    assert policy.ce_mode(_bufs(K=2, E=8)) is False
    assert CE_MIN_DENSITY > ce_density(4, 64, 8)
    assert policy.ce_mode(_bufs(nvshmem=True)) is False
    assert policy.ce_mode(_bufs(W=1)) is False
    assert policy.ce_mode(_bufs(regions=0)) is False  # only the row form into a region
    assert policy.ce_mode(_bufs(backend="emulated")) is False  # the emulated world: only when asked


def test_forced(cuda_copies, monkeypatch):
    assert policy.ce_mode(_bufs(setting="on", T=128, W=8)) is True
    assert policy.ce_mode(_bufs(setting="off")) is False
    assert policy.ce_mode(_bufs(setting="on", nvshmem=True)) is False  # the NVSHMEM route keeps SM stores
    assert policy.ce_mode(_bufs(setting="on", backend="emulated", device="cpu")) is True
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert policy.ce_mode(_bufs(setting="on")) is False  # ROCm: SM stores


def test_resolved_once_per_buffer_set(cuda_copies):
    b = _bufs()
    assert policy.ce_mode(b) is True and b.modes == {"copy_engine": True}
    b.config = ExchangeConfig(copy_engine="off")  # (not how a config changes: the resolved mode stays)
    assert policy.ce_mode(b) is True
    b.modes.clear()  # what SymmBuffers.reconfigure does
    assert policy.ce_mode(b) is False


def test_no_driver_no_copies(monkeypatch):
    assert not copy_engine.available(torch.device("cpu"))
    monkeypatch.setattr(copy_engine, "available", lambda device: False)
    assert policy.ce_mode(_bufs(setting="on")) is False


def test_copy_bytes_on_cpu_moves_exactly_the_bytes():
    src = torch.arange(16, dtype=torch.int32)
    dst = torch.full((16,), -1, dtype=torch.int32)
    copy_engine.copy_bytes(torch.device("cpu"), dst.data_ptr() + 8, src.data_ptr() + 4, 12)
    assert dst.tolist() == [-1, -1, 1, 2, 3] + [-1] * 11
    copy_engine.copy_bytes(torch.device("cpu"), dst.data_ptr(), src.data_ptr(), 0)  # nothing
    assert dst[0] == -1
    assert ctypes.sizeof(ctypes.c_void_p) == 8


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_dispatcher_rejects_a_bad_copy_engine(bad):
    from tlx_dist.comm import SymmDispatcher
    with pytest.raises(ValueError, match="copy_engine"):
        SymmDispatcher(8, copy_engine=bad)


def test_config_key_is_checked_and_reaches_the_dispatcher(monkeypatch):
    import os

    from tlx_dist.comm import SymmDispatcher
    from train.config import load_config
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "h200_2gpu_ep2.toml")
    assert load_config(recipe).parallel.exchange.copy_engine == "auto"
    assert load_config(recipe, ["parallel.exchange.copy_engine=off"]).parallel.exchange.copy_engine == "off"
    with pytest.raises(ValueError, match=r"parallel.exchange.copy_engine='yes' must be 'auto', 'on' or 'off'"):
        load_config(recipe, ["parallel.exchange.copy_engine=yes"])
    asked = []
    monkeypatch.setattr(api, "ep_buffers", lambda *a, **kw: asked.append(kw["config"]) or "the set")
    d = SymmDispatcher(8, copy_engine=False, max_tokens=16)
    assert d._buffers_for(types.SimpleNamespace(shape=(16, 64), dtype=None, device="cpu"), 2) == "the set"
    assert asked == [ExchangeConfig(copy_engine="off")]  # handed to the buffer set, where ce_mode reads it


def test_a_shared_buffer_set_keeps_one_mode(cuda_copies):
    b = _bufs()
    assert policy.ce_mode(b) is True  # "auto" at the first op
    policy.adopt(b, ExchangeConfig(copy_engine="on"))  # what it runs with anyway: fine
    assert b.config.copy_engine == "on" and b.config.timeout_s == 30.0
    other = _bufs()
    assert policy.ce_mode(other) is True
    with pytest.raises(ValueError, match="already runs with copy_engine True .fixed at its first op.*gives False"):
        policy.adopt(other, ExchangeConfig(copy_engine="off"))
    one = _bufs(W=1)
    assert policy.ce_mode(one) is False
    policy.adopt(one, ExchangeConfig(copy_engine="on"))  # resolves to off on one rank anyway: no conflict


def test_two_dispatchers_of_one_buffer_set_must_agree(cuda_copies):
    b = _bufs()
    policy.adopt(b, ExchangeConfig(copy_engine="on"))
    policy.adopt(b, ExchangeConfig(copy_engine="on"))
    with pytest.raises(ValueError, match=r"runs another ExchangeConfig \(its copy_engine: 'on' vs 'off'"):
        policy.adopt(b, ExchangeConfig(copy_engine="off"))
    with pytest.raises(ValueError, match=r"timeout_s=5.0: this buffer set waits 30 s"):
        policy.adopt(b, ExchangeConfig(copy_engine="on", timeout_s=5.0))
    built = _bufs(claimed=True)  # built with a config: a dispatcher asking another one raises
    with pytest.raises(ValueError, match="overlap: False vs True"):
        policy.adopt(built, ExchangeConfig(overlap=True))


@pytest.mark.parametrize("H,CB,rows", [(16384, 32, None), (4096, 32, None), (8192, 32, None), (1000, 32, None),
                                       (1, 32, None), (128, 32, None), (100, 3, 4), (7, 3, 4), (5000, 32, 1024)])
def test_combine_chunks_cover_the_rows_in_order(H, CB, rows):
    cfg = ExchangeConfig()
    ch = ce_chunks(H, CB, cfg.ce_chunk_rows if rows is None else rows, cfg.ce_tail_rows)
    assert ch[0][0] == 0 and ch[-1][1] == H
    assert all(a[1] == b[0] for a, b in zip(ch, ch[1:])) and all(lo < hi for lo, hi in ch)
    assert all(lo % CB == 0 for lo, _ in ch), "every chunk starts on a token block"
    if rows is None:
        assert all(hi - lo <= cfg.ce_chunk_rows for lo, hi in ch)
        assert len(ch) <= -(-H // cfg.ce_chunk_rows) + 4, "a few large copies (each costs a gap)"
        if H > 2 * cfg.ce_tail_rows:
            assert ch[-1][1] - ch[-1][0] <= cfg.ce_tail_rows + CB, "the last copy is a short one"
            sizes = [hi - lo for lo, hi in ch]
            assert sizes == sorted(sizes, reverse=True), "large copies first"
    assert ce_chunks(0, CB, cfg.ce_chunk_rows, cfg.ce_tail_rows) == []


def test_combine_chunks_at_the_default_sizes():
    """The default copies: 4096-row chunks, the last cut in halves down to 512 rows."""
    cfg = ExchangeConfig()
    assert (cfg.ce_chunk_rows, cfg.ce_tail_rows) == (4096, 512)
    assert [hi - lo for lo, hi in ce_chunks(16384, 32, 4096, 512)] == [4096, 4096, 4096, 2048, 1024, 512, 512]
    assert [hi - lo for lo, hi in ce_chunks(4096, 32, 4096, 512)] == [2048, 1024, 512, 512]
    assert [hi - lo for lo, hi in ce_chunks(5000, 32, 4096, 0)] == [4096, 904]
    assert [hi - lo for lo, hi in ce_chunks(300, 32, 4096, 512)] == [300]


def test_a_summing_tile_too_large_for_the_copy_engine_combine_is_refused(monkeypatch):
    """A ``reduce_recv`` tile that would take the registers the chunks' signal kernels need (16 x 512
    at 4 warps hung both ranks until the wait timed out) raises before anything is launched, naming
    the field; the default tile, and the same tile outside the copy-engine combine, pass."""
    from tlx_dist.comm.symm import tuning
    monkeypatch.setattr(tuning, "_num_programs", lambda device_str, per_sm=4: 132 * per_sm)

    def bufs(cfg):
        return types.SimpleNamespace(device=torch.device("cuda"), config=cfg,
                                     layout=types.SimpleNamespace(hidden=7168, comb_block=32, max_tokens=16384))
    big = ExchangeConfig(reduce_recv=Tile(rows=16, cols=512, warps=4, per_sm=16))
    with pytest.raises(ValueError, match=r"ExchangeConfig.reduce_recv: a 16 x 512 tile at 4 warps"):
        reduce_recv_shape(bufs(big), 16384, blk=True, dense=True)
    assert reduce_recv_shape(bufs(big), 16384, blk=True)[:2] == (16, 512)
    br, bd, warps, grid = reduce_recv_shape(bufs(ExchangeConfig()), 16384, blk=True, dense=True)
    assert br * bd <= 1024 * warps and grid == (4 * 132,)  # ce_sum_per_sm programs an SM
    wide = dataclasses.replace(ExchangeConfig(), ce_sum_per_sm=8)
    assert reduce_recv_shape(bufs(wide), 16384, blk=True, dense=True)[3] == (8 * 132,)
