"""The NVSHMEM route of the symmetric exchange on CPU: the real tlx/comm kernels with
USE_NVSHMEM=True under TRITON_INTERPRET=1, in emulated worlds of several "nodes"
(``EmulatedWorld(..., ranks_per_node=n)``: peers on other nodes have pointer 0 and are reached
through tlx/comm/nvshmem.py's emulated puts and signals), against the same oracles as the
peer-pointer route (tests/symm_interpreted_cases.py). Checks the staging, every offset and
count of the route and that every put reads symmetric memory (the emulation raises otherwise);
not NVSHMEM's ordering or transport (compiled only: tests/test_symm_nvshmem_compile.py).
Run by tests/test_symm_interpreted.py in its TRITON_INTERPRET=1 child."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

import symm_interpreted_cases as cases  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld  # noqa: E402
from tlx_dist.comm.symm import ExchangeConfig  # noqa: E402
from tlx_dist.comm.symm.buffers import SymmBuffers  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


@pytest.fixture
def nodes(monkeypatch):
    """Makes the peer-pointer cases' worlds span nodes of ``n`` ranks, with the flat exchange across
    them (this file's route; the hierarchical one: tests/symm_hier_*interpreted_cases.py)."""
    def use(n):
        def world(*args, config=None, **kw):
            return EmulatedWorld(*args, ranks_per_node=n, **kw,
                                 config=dataclasses.replace(config or ExchangeConfig(), topology="flat"))
        monkeypatch.setattr(cases, "EmulatedWorld", world)
    return use


@pytest.mark.parametrize("W,n,kind", [
    (2, 1, "random"),              # two nodes of one rank: everything but self goes over NVSHMEM
    (4, 2, "random"),              # two nodes of two: each sender mixes peer stores and puts
    # everything to rank 0: rank 2, 3 put all their rows, 1 stores them (release tier)
    pytest.param(4, 2, "heavy_imbalance", marks=pytest.mark.release),
    # four nodes; odd experts get no rows (empty puts never signalled) (release tier)
    pytest.param(4, 1, "zero_token_experts", marks=pytest.mark.release),
    (3, 2, "one_expert"),          # uneven nodes {0, 1}, {2}: one expert holds a row of every token
])
def test_nvshmem_route_matches_oracles(nodes, W, n, kind):
    nodes(n)
    E, K, D = 4 * W, 3, 6
    world, *_ = cases._check_world(W, E, K, [3 + 2 * s for s in range(W)], D, kind)
    assert all(b.use_nvshmem and b.layout.staging for b in world.buffers)
    for v, b in enumerate(world.buffers):  # pointer 0 exactly for the ranks of other nodes
        assert [p == 0 for p in b.peers.tolist()] == [d // n != v // n for d in range(W)]


def test_nvshmem_route_edge_shapes(nodes):
    """A rank with zero tokens beside one; K = e = 1; K = E with e = 3 < K in fp16 (a run of
    three gate-gradient slots in one put); odd D in bf16 (puts of odd byte counts)."""
    nodes(1)
    cases._check_world(2, 2, 1, [0, 1], 3, "random", torch.float32)
    cases._check_world(3, 3, 1, [1, 4, 2], 5, "random", torch.bfloat16)
    cases._check_world(2, 6, 6, [5, 3], 7, "random", torch.float16)


@pytest.mark.release  # buffer reuse stays fast on the peer route (test_repeated_ops_reuse_buffers)
def test_nvshmem_route_reuses_buffers_across_layers(nodes):
    nodes(2)
    cases.test_repeated_ops_reuse_buffers()


def test_nvshmem_route_bounded_wait_names_the_peer(nodes):
    """A rank on another node skips a dispatch: the waits on its barrier signal time out and name it."""
    nodes(1)
    cases.test_bounded_wait_names_the_op_rank_and_peer()


def test_emulated_put_refuses_non_symmetric_source():
    """The emulation enforces the rule the GPU test checks in the PTX: a put reads symmetric memory."""
    from tlx.comm import nvshmem as nv
    bufs = SymmBuffers.emulated(2, 4, 8, 2, 4, torch.float32, device="cpu", ranks_per_node=1)
    x = torch.ones(8)
    base = int(bufs[0].peers[0])
    with pytest.raises(ValueError, match="put source .* is not in a symmetric heap"):
        nv.putmem_block(base + bufs[0].layout.off_recv, x.data_ptr(), 32, 1)
    nv.putmem_block(base + bufs[0].layout.off_recv, base + bufs[0].layout.off_srows, 32, 1)  # staged: fine
    with pytest.raises(ValueError, match="ranks_per_node=1 emulates NVSHMEM"):
        SymmBuffers.emulated(2, 4, 8, 2, 4, torch.float32, device="meta", ranks_per_node=1)


def _counters(b):
    """(FLAGS, CFLAGS, token rows, partial rows, gate-gradient rows) of buffers ``b``."""
    L, W = b.layout, b.world_size
    fl = b._region(L.off_flags, 16 * W).view(torch.int64).tolist()
    arrive = b._region(L.off_arrive, 24 * W).view(torch.int64).tolist()
    return fl[:W], fl[W:], arrive[:W], arrive[W:2 * W], arrive[2 * W:]


def _step(gens, n):
    """Every rank's next ``n`` phases (lockstep), short of the op's last one."""
    for _ in range(n):
        for g in gens:
            next(g)


def _finish(gens):
    out = []
    for g in gens:
        with pytest.raises(StopIteration) as stop:
            next(g)
        out.append(stop.value.value)
    return out


def test_signals_count_exactly_once():
    """Inside each op (before its last kernel, which consumes and zeroes them) every counter holds
    exactly what was sent, whichever route it came by: ARRIVE = rows, CFLAGS = the dispatch's
    epoch; after it, FLAGS = the next op's epoch on every rank (the readiness the op's last kernel
    raised) and ARRIVE = 0. A signal issued per thread, as the old route did, would overcount; an
    overcount never hangs, so only this catches it."""
    from tlx_dist.comm.symm import combine_steps, dispatch_grad_steps, dispatch_steps
    W, n, E, K, D = 4, 2, 8, 2, 5
    e = E // W
    world = EmulatedWorld(W, 6, D, K, E, torch.float64, device="cpu", ranks_per_node=n,
                          config=ExchangeConfig(topology="flat"))
    bufs = world.buffers
    xs = [torch.randn(T, D, dtype=torch.float64) for T in (6, 2, 5, 0)]
    idxs = [cases._routing(s, x.shape[0], K, E, "random") if x.shape[0] else torch.zeros(0, K, dtype=torch.long)
            for s, x in enumerate(xs)]
    gates = [torch.rand(x.shape[0], K, dtype=torch.float64) for x in xs]
    # rows_to[s][d]: token rows rank s sends to rank d (once per token)
    rows_to = [[int((i // e == d).any(1).sum()) for d in range(W)] for i in idxs]
    rows_from = [[rows_to[s][d] for s in range(W)] for d in range(W)]

    def after(epoch):
        for d, b in enumerate(bufs):
            flags, _, tokens, partials, dgates = _counters(b)
            assert flags == [epoch] * W and tokens == partials == dgates == [0] * W, (d, _counters(b))
            assert int(b.state()[0]) == epoch

    after(1)  # a fresh region: everyone ready for op 1
    gens = [dispatch_steps(b, x, i, g, "worst") for b, x, i, g in zip(bufs, xs, idxs, gates)]
    _step(gens, 2)  # counts posted, token rows sent; expand not run
    for d, b in enumerate(bufs):
        flags, cflags, tokens, _, _ = _counters(b)
        assert cflags == [1] * W and tokens == rows_from[d], (d, _counters(b))
    res = _finish(gens)
    after(2)
    hs = [h for _, h in res]
    ys = [x for x, _ in res]
    gens = [combine_steps(b, y, h) for b, y, h in zip(bufs, ys, hs)]
    _step(gens, 1)  # partial rows sent; reduce_recv not run
    for d, b in enumerate(bufs):
        assert _counters(b)[3] == rows_to[d], (d, _counters(b))
    _finish(gens)
    after(3)
    gens = [dispatch_grad_steps(b, torch.randn(x.shape, dtype=torch.float64), y, h)
            for b, x, y, h in zip(bufs, xs, ys, hs)]
    _step(gens, 2)  # dy rows sent, gate gradients answered; gate_grad_recv not run
    for d, b in enumerate(bufs):
        _, _, tokens, _, dgates = _counters(b)
        assert tokens == rows_from[d] and dgates == rows_to[d], (d, _counters(b))
    _finish(gens)
    after(4)
    world.check()
