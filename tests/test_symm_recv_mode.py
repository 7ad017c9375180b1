"""Which receive copy the row form uses (CPU): the overlapped one only for real ranks over peer
pointers whose buffers hold at least RECV_OVERLAP_MIN_TOKENS tokens per rank (or when forced),
the block-by-block expand copy in the emulated world and on one rank, the after-arrival copy on the
NVSHMEM route and below the threshold."""

import types

import pytest

from tlx_dist.comm import symm
from tlx_dist.comm.symm import ENV_RECV_OVERLAP, RECV_OVERLAP_MIN_TOKENS


def _bufs(backend="symm", W=2, T=RECV_OVERLAP_MIN_TOKENS, nvshmem=False):
    return types.SimpleNamespace(use_nvshmem=nvshmem, backend=backend, world_size=W,
                                 layout=types.SimpleNamespace(max_tokens=T))


def test_auto_by_capacity(monkeypatch):
    monkeypatch.delenv(ENV_RECV_OVERLAP, raising=False)
    assert symm._recv_mode(_bufs(T=RECV_OVERLAP_MIN_TOKENS)) == "overlap"
    assert symm._recv_mode(_bufs(T=RECV_OVERLAP_MIN_TOKENS - 1)) == "after"
    assert symm._recv_mode(_bufs(T=4096, W=8)) == "after"
    assert symm._recv_mode(_bufs(nvshmem=True)) == "after"
    for backend in ("emulated", "local"):
        assert symm._recv_mode(_bufs(backend=backend, T=16)) == "blocks"
    assert symm._recv_mode(_bufs(W=1)) == "blocks"


def test_resolved_once_per_buffer_set(monkeypatch):
    monkeypatch.setenv(ENV_RECV_OVERLAP, "1")
    b = _bufs(T=128)
    assert symm._recv_mode(b) == "overlap"
    monkeypatch.setenv(ENV_RECV_OVERLAP, "0")  # a later change does not flip a live buffer set
    assert symm._recv_mode(b) == "overlap"
    assert symm._recv_mode(_bufs(T=128)) == "after"


@pytest.mark.parametrize("force,want", [("1", "overlap"), ("0", "after")])
def test_forced(monkeypatch, force, want):
    monkeypatch.setenv(ENV_RECV_OVERLAP, force)
    assert symm._recv_mode(_bufs(T=128)) == want
    assert symm._recv_mode(_bufs(T=1 << 20)) == want
    assert symm._recv_mode(_bufs(nvshmem=True)) == "after"  # the NVSHMEM route has no receiving programs
    assert symm._recv_mode(_bufs(backend="emulated")) == "blocks"  # ranks launch one after another


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_RECV_OVERLAP, "yes")
    with pytest.raises(ValueError, match=ENV_RECV_OVERLAP):
        symm._recv_mode(_bufs())
