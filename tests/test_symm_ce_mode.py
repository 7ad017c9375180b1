"""Where the copy-engine row form runs (CPU): ``policy._ce_mode`` by setting, world, route and size;
the density rule; the copy call on CPU; the argument and config checks that name what is wrong."""

import ctypes
import types

import pytest
import torch

from tlx_dist.comm import copy_engine
from tlx_dist.comm.symm import api, ce_transport, launch, policy, tuning
from tlx_dist.comm.symm.policy import CE_MIN_DENSITY, CE_MIN_TOKENS, ENV_COPY_ENGINE


def _bufs(backend="symm", W=2, T=CE_MIN_TOKENS, E=64, K=8, nvshmem=False, regions=1, setting=None, device="cuda"):
    return types.SimpleNamespace(use_nvshmem=nvshmem, backend=backend, world_size=W, copy_engine=setting,
                                 device=torch.device(device),
                                 layout=types.SimpleNamespace(max_tokens=T, world_size=W, num_experts=E, top_k=K,
                                                              row_regions=regions))


@pytest.fixture
def cuda_copies(monkeypatch):
    """As on a CUDA host whose driver loads (this machine has neither)."""
    monkeypatch.setattr(copy_engine, "available", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(ENV_COPY_ENGINE, raising=False)


def test_density_is_the_chance_a_token_reaches_a_peer():
    L = lambda W, E, K: types.SimpleNamespace(world_size=W, num_experts=E, top_k=K)  # noqa: E731
    assert policy._ce_density(L(2, 64, 8)) == pytest.approx(0.99762, abs=1e-4)
    assert policy._ce_density(L(4, 64, 8)) == pytest.approx(0.91475, abs=1e-4)
    assert policy._ce_density(L(8, 256, 8)) == pytest.approx(0.66, abs=0.01)
    # brute force over every top-K set at a small size
    import itertools
    sets = list(itertools.combinations(range(8), 3))
    hit = sum(any(g // 4 == 1 for g in s) for s in sets) / len(sets)
    assert policy._ce_density(L(2, 8, 3)) == pytest.approx(hit)


def test_auto(cuda_copies):
    assert policy._ce_mode(_bufs()) is True
    assert policy._ce_mode(_bufs(T=CE_MIN_TOKENS - 1)) is False  # small ops keep SM stores
    assert policy._ce_mode(_bufs(W=4)) is False  # 0.915 < CE_MIN_DENSITY: too many rows would cross for nothing
    assert policy._ce_mode(_bufs(K=2, E=8)) is False
    assert CE_MIN_DENSITY > policy._ce_density(types.SimpleNamespace(world_size=4, num_experts=64, top_k=8))
    assert policy._ce_mode(_bufs(nvshmem=True)) is False
    assert policy._ce_mode(_bufs(W=1)) is False
    assert policy._ce_mode(_bufs(regions=0)) is False  # only the row form into a region
    assert policy._ce_mode(_bufs(backend="emulated")) is False  # the emulated world: only when asked


def test_forced(cuda_copies, monkeypatch):
    assert policy._ce_mode(_bufs(setting=True, T=128, W=8)) is True
    assert policy._ce_mode(_bufs(setting=False)) is False
    assert policy._ce_mode(_bufs(setting=True, nvshmem=True)) is False  # the NVSHMEM route keeps SM stores
    assert policy._ce_mode(_bufs(setting=True, backend="emulated", device="cpu")) is True
    monkeypatch.setenv(ENV_COPY_ENGINE, "0")
    assert policy._ce_mode(_bufs()) is False
    assert policy._ce_mode(_bufs(setting=True)) is True  # the dispatcher's setting wins over the environment
    monkeypatch.setenv(ENV_COPY_ENGINE, "1")
    assert policy._ce_mode(_bufs(T=128)) is True
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert policy._ce_mode(_bufs(setting=True)) is False  # ROCm: SM stores


def test_resolved_once_per_buffer_set(cuda_copies, monkeypatch):
    b = _bufs()
    assert policy._ce_mode(b) is True
    monkeypatch.setenv(ENV_COPY_ENGINE, "0")
    assert policy._ce_mode(b) is True  # a live buffer set keeps its mode (every rank resolved the same)
    assert policy._ce_mode(_bufs()) is False


def test_no_driver_no_copies(monkeypatch):
    monkeypatch.delenv(ENV_COPY_ENGINE, raising=False)
    assert not copy_engine.available(torch.device("cpu"))
    monkeypatch.setattr(copy_engine, "available", lambda device: False)
    assert policy._ce_mode(_bufs(setting=True)) is False


def test_bad_env_names_the_variable(cuda_copies, monkeypatch):
    monkeypatch.setenv(ENV_COPY_ENGINE, "yes")
    with pytest.raises(ValueError, match=ENV_COPY_ENGINE):
        policy._ce_mode(_bufs())


def test_copy_bytes_on_cpu_moves_exactly_the_bytes():
    src = torch.arange(16, dtype=torch.int32)
    dst = torch.full((16,), -1, dtype=torch.int32)
    copy_engine.copy_bytes(torch.device("cpu"), dst.data_ptr() + 8, src.data_ptr() + 4, 12)
    assert dst.tolist() == [-1, -1, 1, 2, 3] + [-1] * 11
    copy_engine.copy_bytes(torch.device("cpu"), dst.data_ptr(), src.data_ptr(), 0)  # nothing
    assert dst[0] == -1
    assert ctypes.sizeof(ctypes.c_void_p) == 8


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_dispatcher_rejects_a_bad_copy_engine(bad):
    from tlx_dist.comm import SymmDispatcher
    with pytest.raises(ValueError, match="copy_engine"):
        SymmDispatcher(8, copy_engine=bad)


def test_config_key_is_checked_and_reaches_the_dispatcher(monkeypatch):
    import os

    from tlx_dist.comm import SymmDispatcher
    from train.config import load_config
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "h200_2gpu_ep2.toml")
    assert load_config(recipe).parallel.exchange_copy_engine == "auto"
    assert load_config(recipe, ["parallel.exchange_copy_engine=off"]).parallel.exchange_copy_engine == "off"
    with pytest.raises(ValueError, match=r"parallel.exchange_copy_engine='yes' must be auto, on or off"):
        load_config(recipe, ["parallel.exchange_copy_engine=yes"])
    made = types.SimpleNamespace(copy_engine=None)
    monkeypatch.setattr(api, "ep_buffers", lambda *a, **kw: made)
    d = SymmDispatcher(8, copy_engine=False, max_tokens=16)
    assert d._buffers_for(types.SimpleNamespace(shape=(16, 64), dtype=None, device="cpu"), 2) is made
    assert made.copy_engine is False  # set on the buffer set, where _ce_mode reads it


def test_a_shared_buffer_set_keeps_one_mode(cuda_copies):
    b = _bufs()
    assert policy._ce_mode(b) is True  # "auto" at the first op
    same = _bufs()
    assert policy._ce_mode(same) is True
    policy._set_copy_engine(same, True)  # what it runs with anyway: fine
    with pytest.raises(ValueError, match="copy_engine=False: this buffer set already runs with the copy-engine"):
        policy._set_copy_engine(b, False)
    one = _bufs(W=1)
    assert policy._ce_mode(one) is False
    policy._set_copy_engine(one, True)  # resolves to off on one rank anyway: no conflict


@pytest.mark.parametrize("H,CB,rows", [(16384, 32, None), (4096, 32, None), (8192, 32, None), (1000, 32, None),
                                       (1, 32, None), (128, 32, None), (100, 3, 4), (7, 3, 4), (5000, 32, 1024)])
def test_combine_chunks_cover_the_rows_in_order(H, CB, rows):
    ch = ce_transport._ce_chunks(H, CB, rows)
    assert ch[0][0] == 0 and ch[-1][1] == H
    assert all(a[1] == b[0] for a, b in zip(ch, ch[1:])) and all(lo < hi for lo, hi in ch)
    assert all(lo % CB == 0 for lo, _ in ch), "every chunk starts on a token block"
    if rows is None:
        assert all(hi - lo <= ce_transport.CE_CHUNK_ROWS for lo, hi in ch)
        assert len(ch) <= -(-H // ce_transport.CE_CHUNK_ROWS) + 4, "a few large copies (each costs a gap)"
        if H > 2 * ce_transport.CE_TAIL_ROWS:
            assert ch[-1][1] - ch[-1][0] <= ce_transport.CE_TAIL_ROWS + CB, "the last copy is a short one"
            sizes = [hi - lo for lo, hi in ch]
            assert sizes == sorted(sizes, reverse=True), "large copies first"
    assert ce_transport._ce_chunks(0, CB, rows) == []


def test_combine_chunks_at_the_measured_sizes():
    """The default copies (x2_s48's best): 4096-row chunks, the last cut in halves down to 512 rows."""
    assert [hi - lo for lo, hi in ce_transport._ce_chunks(16384, 32)] == [4096, 4096, 4096, 2048, 1024, 512, 512]
    assert [hi - lo for lo, hi in ce_transport._ce_chunks(4096, 32)] == [2048, 1024, 512, 512]
    assert [hi - lo for lo, hi in ce_transport._ce_chunks(5000, 32, tail=0)] == [4096, 904]
    assert [hi - lo for lo, hi in ce_transport._ce_chunks(300, 32)] == [300]


def test_two_dispatchers_of_one_buffer_set_must_agree(cuda_copies):
    b = _bufs()
    policy._set_copy_engine(b, True)
    policy._set_copy_engine(b, True)
    with pytest.raises(ValueError, match="another SymmDispatcher of this buffer set asked for copy_engine=True"):
        policy._set_copy_engine(b, False)


def test_a_summing_tile_too_large_for_the_copy_engine_combine_is_refused(monkeypatch):
    """``LAUNCH_OVERRIDES["reduce_recv"]`` with a tile that would take the registers the chunks' signal
    kernels need (x2_s46: 16 x 512 at 4 warps hung both ranks until the wait timed out) raises before
    anything is launched, naming the override."""
    monkeypatch.setattr(tuning, "_num_programs", lambda device_str, per_sm=4: 132 * per_sm)
    monkeypatch.setitem(tuning.LAUNCH_OVERRIDES, "reduce_recv", dict(BLOCK_ROWS=16, BLOCK_D=512, num_warps=4))
    bufs = types.SimpleNamespace(device=torch.device("cuda"),
                                 layout=types.SimpleNamespace(hidden=7168, comb_block=32, max_tokens=16384))
    h = types.SimpleNamespace(num_tokens=16384)
    with pytest.raises(ValueError, match=r"LAUNCH_OVERRIDES\['reduce_recv'\]: a 16 x 512 tile at 4 warps"):
        launch._reduce_recv(bufs, h, part=None, blk=True, dense=True)
