"""When the send moves rows by bulk copies (CPU): ``symm._bulk`` turns ``LAUNCH_OVERRIDES["send"]
["bulk"]`` / ``TLX_DIST_EXCHANGE_BULK`` into the kernel's BULK slots only where the bulk path
applies (TLX, a CUDA tensor, peer pointers, no per-block signals or receiving programs, 16-byte
rows), and sizes the slots to the shared memory of the programs an SM runs."""

import os
import types

import pytest

import tlx
from tlx_dist.comm import symm
from tlx_dist.comm.symm import ENV_EXCHANGE_BULK


def _x(D=7168, es=2, stride=None, ptr=1 << 20, dev="cuda"):
    return types.SimpleNamespace(device=types.SimpleNamespace(type=dev), element_size=lambda: es, shape=(64, D),
                                 stride=lambda i: stride or D, data_ptr=lambda: ptr)


BUFS = types.SimpleNamespace(use_nvshmem=False)


@pytest.fixture
def tlx_on(monkeypatch):
    monkeypatch.setattr(tlx, "tlx_available", lambda: True)
    monkeypatch.setattr(tlx, "gpu_arch", lambda: "sm_90")
    monkeypatch.delenv(ENV_EXCHANGE_BULK, raising=False)
    monkeypatch.setattr(symm, "LAUNCH_OVERRIDES", {})


def test_off_unless_asked(tlx_on):
    assert symm._bulk(_x(), BUFS, {}) == {}


def test_env_and_override(tlx_on, monkeypatch):
    monkeypatch.setenv(ENV_EXCHANGE_BULK, "6")
    # 4 programs per SM: 220 KB / 4 = 55 KB each -> three 16 KB slots (D 7168 -> 8192 elements)
    assert symm._bulk(_x(), BUFS, {}) == {"BULK": 3, "BULK_DP": 8192}
    monkeypatch.setitem(symm.LAUNCH_OVERRIDES, "send", {"per_sm": 2})  # the send's programs per SM
    assert symm._bulk(_x(), BUFS, {}) == {"BULK": 6, "BULK_DP": 8192}
    monkeypatch.setitem(symm.LAUNCH_OVERRIDES, "send", {"per_sm": 1})
    assert symm._bulk(_x(), BUFS, {}) == {"BULK": 6, "BULK_DP": 8192}
    monkeypatch.setitem(symm.LAUNCH_OVERRIDES, "send", {})
    assert symm._bulk(_x(D=2048), BUFS, {}) == {"BULK": 6, "BULK_DP": 2048}
    monkeypatch.setitem(symm.LAUNCH_OVERRIDES, "send", {"bulk": 0})  # the override wins over the env
    assert symm._bulk(_x(), BUFS, {}) == {}
    monkeypatch.setitem(symm.LAUNCH_OVERRIDES, "send", {"bulk": 20, "per_sm": 1})
    assert symm._bulk(_x(), BUFS, {}) == {"BULK": 10, "BULK_DP": 8192}  # 160 KB cap


def test_not_where_it_does_not_apply(tlx_on, monkeypatch):
    monkeypatch.setenv(ENV_EXCHANGE_BULK, "4")
    assert symm._bulk(_x(dev="cpu"), BUFS, {}) == {}
    assert symm._bulk(_x(), types.SimpleNamespace(use_nvshmem=True), {}) == {}
    assert symm._bulk(_x(), BUFS, {"BLK_SIGNAL": True}) == {}
    assert symm._bulk(_x(), BUFS, {"RECV_ROLE": True}) == {}
    assert symm._bulk(_x(D=3), BUFS, {}) == {}  # 6-byte rows
    assert symm._bulk(_x(stride=7172), BUFS, {}) == {}  # row starts not 16-byte aligned
    assert symm._bulk(_x(ptr=(1 << 20) + 8), BUFS, {}) == {}
    assert symm._bulk(_x(es=8, D=16384), BUFS, {}) == {}  # one 128 KB fp64 slot per program: under 2
    assert symm._bulk(_x(), BUFS, {"OWN_ADDR": (1 << 20) + 2}) == {}  # own-row output not aligned
    assert symm._bulk(_x(), BUFS, {"OWN_ADDR": 1 << 20})["BULK"] == 3
    for arch in ("gfx94x", "other"):  # no cp.async.bulk there
        monkeypatch.setattr(tlx, "gpu_arch", lambda arch=arch: arch)
        assert symm._bulk(_x(), BUFS, {}) == {}
    monkeypatch.setattr(tlx, "gpu_arch", lambda: "sm_100")
    assert symm._bulk(_x(), BUFS, {})["BULK"] == 3
    monkeypatch.setattr(tlx, "tlx_available", lambda: False)
    assert symm._bulk(_x(), BUFS, {}) == {}


def test_bad_env_names_the_variable(tlx_on, monkeypatch):
    monkeypatch.setenv(ENV_EXCHANGE_BULK, "many")
    with pytest.raises(ValueError, match=r"TLX_DIST_EXCHANGE_BULK='many' must be an integer"):
        symm._bulk(_x(), BUFS, {})


def test_buffers_setting_between_override_and_env(tlx_on, monkeypatch):
    """``SymmDispatcher(bulk_send=n)`` puts n on the buffer set; LAUNCH_OVERRIDES wins over it, it wins
    over TLX_DIST_EXCHANGE_BULK."""
    bufs = types.SimpleNamespace(use_nvshmem=False, bulk_send=2)
    monkeypatch.setenv(ENV_EXCHANGE_BULK, "3")
    assert symm._bulk(_x(), bufs, {})["BULK"] == 2
    bufs.bulk_send = 0
    assert symm._bulk(_x(), bufs, {})["BULK"] == 3
    monkeypatch.setitem(symm.LAUNCH_OVERRIDES, "send", {"bulk": 0})
    bufs.bulk_send = 2
    assert symm._bulk(_x(), bufs, {}) == {}


def test_dispatcher_and_recipe_reach_the_buffers(monkeypatch):
    from train.config import load_config
    from tlx_dist.comm import SymmDispatcher

    with pytest.raises(ValueError, match=r"bulk_send=-1 must be a non-negative int"):
        SymmDispatcher(8, bulk_send=-1)
    with pytest.raises(ValueError, match=r"bulk_send=True must be a non-negative int"):
        SymmDispatcher(8, bulk_send=True)
    made = types.SimpleNamespace(bulk_send=0)
    monkeypatch.setattr(symm, "ep_buffers", lambda *a, **kw: made)
    d = SymmDispatcher(8, bulk_send=6, max_tokens=16)
    assert d._buffers_for(types.SimpleNamespace(shape=(16, 64), dtype=None, device="cpu"), 2) is made
    assert made.bulk_send == 6
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "h200_2gpu_ep2.toml")
    assert load_config(recipe).parallel.exchange_bulk == 0
    assert load_config(recipe, ["parallel.exchange_bulk=6"]).parallel.exchange_bulk == 6
    with pytest.raises(ValueError, match=r"parallel.exchange_bulk=-2 must be >= 0"):
        load_config(recipe, ["parallel.exchange_bulk=-2"])
