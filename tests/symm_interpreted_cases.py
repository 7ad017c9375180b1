"""Symmetric-memory dispatch/combine on CPU: the real tlx/comm kernels under TRITON_INTERPRET=1
in an emulated world of W virtual ranks (tier T4 logic on CPU), against a brute-force oracle and
against AllToAllDispatcher on gloo; plus sizing, capacity overflow, topology and bad input.

All comparisons are exact (torch.equal): dispatch/combine move bits, and the gradient sums over
k in the same order as the reference (fp64, k ascending)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from _dist import run_world  # noqa: E402
from test_dispatch import _brute_force_receive, _routing  # noqa: E402
from tlx_dist.comm import AllToAllDispatcher, LocalDispatcher  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch  # noqa: E402
from tlx_dist.comm.symm import SymmDispatcher, SymmHandle  # noqa: E402
from tlx_dist.comm.symm_buffers import SymmBuffers, SymmLayout  # noqa: E402
from tlx_dist.comm.topology import Topology  # noqa: E402

# Triton fixes interpret-or-compile per kernel when it is decorated, for the whole process, so this
# module runs in a child pytest with TRITON_INTERPRET=1, started by tests/test_symm_interpreted.py
# (its name keeps pytest from collecting it in the parent, which stays on the real compiler).
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


def _kind_routing(seed, T, K, E, W, kind):
    g = torch.Generator().manual_seed(seed)
    if kind == "zero_token_experts":  # only even experts are ever chosen: odd experts get 0 rows
        idx = torch.stack([torch.randperm(E // 2, generator=g)[:K] * 2 for _ in range(T)])
    elif kind == "heavy_imbalance":  # every token sends all K slots to rank 0's experts
        idx = torch.stack([torch.randperm(E // W, generator=g)[:K] for _ in range(T)])
    else:
        idx = _routing(seed, T, K, E, kind)
    return idx.long()


def _check_world(W, E, K, Ts, D, kind, dtype=torch.float64):
    """Dispatch, combine and both gradient ops of an emulated world vs the oracles."""
    world = EmulatedWorld(W, max(max(Ts), 1), D, K, E, dtype, device="cpu")
    xs = [torch.randn(T, D, dtype=dtype, generator=torch.Generator().manual_seed(s)) for s, T in enumerate(Ts)]
    idxs = [_kind_routing(10 + s, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
            for s, T in enumerate(Ts)]
    res = world.dispatch(xs, idxs)
    ref = reference_dispatch(xs, idxs, E)
    small = sum(Ts) * K <= 200
    brute = _brute_force_receive(xs, idxs, E, W) if small else None
    e = E // W
    for d, (recv, h) in enumerate(res):
        rows, cnt = ref[d]
        n = rows.shape[0]
        assert isinstance(h, SymmHandle) and h.num_recv_rows == recv.shape[0] == world.buffers[d].capacity
        assert h.offsets_e.dtype == torch.int32 and h.offsets_e.tolist() == cnt.cumsum(0).tolist(), f"{kind} rank {d}"
        assert torch.equal(recv[:n], rows), f"{kind}: rank {d} received the wrong rows"
        if brute is not None:
            assert torch.equal(recv[:n], brute[d])
        assert not recv[n:].any(), f"{kind}: rank {d} padding rows are not zero"
        assert (h.src_N[n:] == -1).all()
    # combine: each slot's row comes back from its expert's rank, scaled there by (1 + rank).
    ys = world.combine([r * (1 + d) for d, (r, _) in enumerate(res)], [h for _, h in res])
    for s, (x, idx) in enumerate(zip(xs, idxs)):
        owner = idx // e
        assert ys[s].shape == (x.shape[0], K, D)
        assert torch.equal(ys[s], x[:, None, :] * (1 + owner[..., None]).to(dtype)), f"{kind}: combine on rank {s}"
    # combine backward (dispatch of g_TKD) and dispatch backward (combine of g_ND, summed over k).
    gs = [torch.randn(x.shape[0], K, D, dtype=dtype, generator=torch.Generator().manual_seed(99 + s))
          for s, x in enumerate(xs)]
    g_ND = world.dispatch_grad(gs, [h for _, h in res])
    for d, (recv, h) in enumerate(res):
        # Slot (t, k) of rank s lands where x_s[t] landed: dispatching g row-wise is the same map.
        expect = reference_dispatch([g.reshape(-1, D) for g in gs],
                                    [i.reshape(-1, 1) for i in idxs], E)[d][0]
        n = expect.shape[0]
        assert torch.equal(g_ND[d][:n], expect) and not g_ND[d][n:].any()
    g_TD = world.combine_grad([g * (1 + d) for d, g in enumerate(g_ND)], [h for _, h in res])
    for s, (x, idx) in enumerate(zip(xs, idxs)):
        owner = idx // e
        assert torch.equal(g_TD[s], (gs[s] * (1 + owner[..., None]).to(dtype)).sum(1))
    return world, xs, idxs


_KINDS = ["random", "one_expert", "zero_token_experts", "heavy_imbalance"]


# W = 8 runs two kinds here (the interpreter takes ~3 s per W = 8 world); the GPU tests run all.
@pytest.mark.parametrize("W,kind", [(w, k) for w in (2, 4) for k in _KINDS] + [(8, "random"), (8, "heavy_imbalance")])
def test_emulated_world_matches_oracles(W, kind):
    """Kinds: random top-K; every token's first choice is the last expert (one expert holds a row of
    every token of the world); only even experts used (zero-token experts on every rank);
    everything to rank 0 (the other ranks receive nothing, rank 0 receives W*T*K rows)."""
    E, K, D = 4 * W, 3, 6
    Ts = [3 + 2 * s for s in range(W)]  # unequal T per rank
    _check_world(W, E, K, Ts, D, kind)


def test_emulated_edge_shapes():
    """A rank with zero tokens beside ranks with one; K = e = 1 (one slot per token, one expert per
    rank); odd D in fp32 (4-byte words) and bf16 (2-byte words: D odd -> row not 4-byte aligned)."""
    _check_world(2, 2, 1, [0, 1], 3, "random", torch.float32)
    _check_world(3, 3, 1, [1, 4, 2], 5, "random", torch.bfloat16)
    _check_world(2, 6, 6, [5, 3], 7, "random", torch.float16)  # K = E (prime e=3, K > e)


def test_repeated_ops_reuse_buffers():
    """Several layers share one world: back-to-back dispatches without a combine in between
    (double-buffered counts, epochs), then the combines in reverse order; the epoch counts ops."""
    W, E, K, D, T = 4, 8, 2, 4, 6
    world = EmulatedWorld(W, T, D, K, E, torch.float32, device="cpu")
    layers = []
    for layer in range(3):
        xs = [torch.randn(T, D) for _ in range(W)]
        idxs = [_routing(layer * 10 + s, T, K, E, "random") for s in range(W)]
        layers.append((xs, idxs, world.dispatch(xs, idxs)))
    for xs, idxs, res in reversed(layers):
        ref = reference_dispatch(xs, idxs, E)
        for d, (recv, h) in enumerate(res):
            assert torch.equal(recv[: ref[d][0].shape[0]], ref[d][0])
        ys = world.combine([r for r, _ in res], [h for _, h in res])
        for s in range(W):
            assert torch.equal(ys[s], xs[s][:, None, :].expand(T, K, D))
    assert [int(b.state()[0]) for b in world.buffers] == [6] * W
    world.check()  # no overflow


def test_capacity_overflow_is_detected_not_silent():
    """A declared capacity below what rank 0 receives: rows past it are dropped, the ops still
    finish (dropped rows are counted as arrived), combine returns zeros for exactly the dropped
    slots, and check() raises on the ranks involved (once; the flag then clears)."""
    W, E, K, D, T, cap = 2, 4, 2, 4, 5, 6
    world = EmulatedWorld(W, T, D, K, E, torch.float32, capacity=cap, device="cpu")
    xs = [torch.randn(T, D) for _ in range(W)]
    idxs = [_kind_routing(s, T, K, E, W, "heavy_imbalance") for s in range(W)]  # 20 rows to rank 0
    res = world.dispatch(xs, idxs)
    ref = reference_dispatch(xs, idxs, E)
    recv0, h0 = res[0]
    assert recv0.shape[0] == cap and torch.equal(recv0, ref[0][0][:cap])
    assert int(h0.offsets_e[-1]) == cap  # clamped: the grouped GEMM stays inside the buffer
    ys = world.combine([r for r, _ in res], [h for _, h in res])
    for s in range(W):
        kept = (res[s][1].row_S < cap).view(T, K)
        assert torch.equal(ys[s], torch.where(kept[..., None], xs[s][:, None, :], torch.zeros(())))
        assert 0 < int(kept.sum()) < T * K or s == 0
    # Raised on the receiver that overflowed and on every sender that had rows dropped.
    for r in range(W):
        with pytest.raises(RuntimeError, match=f"overflowed its capacity of 6 receive rows on rank {r}"):
            world.buffers[r].check()
        world.buffers[r].check()  # the flag clears once reported


def test_single_rank_dispatcher_autograd_matches_local():
    """W = 1 without a process group ("local" buffers): SymmDispatcher's autograd.Function vs
    LocalDispatcher, forward and backward, exactly (fp64)."""
    E, K, D, T = 5, 2, 6, 9
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    idx = _routing(3, T, K, E, "random")
    sd = SymmDispatcher(E, max_tokens=16)
    recv, h = sd.dispatch(x, idx)
    lrecv, lh = LocalDispatcher(E).dispatch(x2, idx)
    assert recv.shape[0] == 16 * min(K, E) == h.num_recv_rows
    assert torch.equal(recv[: T * K], lrecv) and not recv[T * K:].any()
    assert torch.equal(h.offsets_e, lh.offsets_e) and torch.equal(h.order_S, lh.order_S)
    assert torch.equal(h.inverse_S, lh.inverse_S) and torch.equal(h.recv_counts_e, lh.recv_counts_e)
    w = torch.randn(D, D, dtype=torch.float64)
    y = sd.combine(recv @ w, h)
    ly = LocalDispatcher(E).combine(lrecv @ w, lh)
    g = torch.randn(T, K, D, dtype=torch.float64)
    assert torch.equal(y, ly)
    (y * g).sum().backward()
    (ly * g).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert sd.buffers.backend == "local"


def _gloo_a2a_worker(rank, world, T, K, E, D):
    import torch.distributed as dist
    d = AllToAllDispatcher(E, dist.group.WORLD)
    x = torch.randn(T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    idx = _kind_routing(rank, T, K, E, world, "random" if rank else "heavy_imbalance")
    recv, h = d.dispatch(x, idx)
    y = d.combine(recv * (2 + rank), h)
    g = torch.randn(T, K, D, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + rank))
    (y * g).sum().backward()
    return dict(x=x.detach(), idx=idx, g=g, recv=recv.detach(), offsets=h.offsets_e, y=y.detach(), dx=x.grad)


def test_emulated_matches_all_to_all_on_gloo():
    """The reference backend on 2 gloo ranks and the emulated symmetric world on the same inputs
    give the same receive rows, offsets, combine output and dispatch gradient."""
    W, T, K, E, D = 2, 6, 2, 4, 5
    ref = run_world(_gloo_a2a_worker, W, T, K, E, D)
    world = EmulatedWorld(W, T, D, K, E, torch.float64, device="cpu")
    res = world.dispatch([r["x"] for r in ref], [r["idx"] for r in ref])
    for d, (recv, h) in enumerate(res):
        n = ref[d]["recv"].shape[0]
        assert torch.equal(recv[:n], ref[d]["recv"]) and torch.equal(h.offsets_e, ref[d]["offsets"])
    ys = world.combine([r * (2 + d) for d, (r, _) in enumerate(res)], [h for _, h in res])
    g_N = world.dispatch_grad([r["g"] for r in ref], [h for _, h in res])
    dx = world.combine_grad([g * (2 + d) for d, g in enumerate(g_N)], [h for _, h in res])
    for s in range(W):
        assert torch.equal(ys[s], ref[s]["y"])
        torch.testing.assert_close(dx[s], ref[s]["dx"], rtol=1e-13, atol=1e-13)  # k-sum order only


def test_size_hint_worst_case_and_capacity():
    L = SymmLayout.build(128, 64, 8, 16, 4, torch.bfloat16)
    assert L.n_cap == 4 * 128 * min(8, 4)  # a token sends at most min(K, e) rows to one rank
    assert L.word_dtype == torch.int64 and L.words == 16
    hint = SymmBuffers.size_hint(128, 64, 8, 16, 4, torch.bfloat16)
    assert hint == L.nbytes >= L.n_cap * 128 + 128 * 8 * 128
    assert SymmBuffers.size_hint(128, 64, 8, 16, 4, torch.bfloat16, capacity=100) < hint
    assert SymmLayout.build(4, 3, 1, 2, 1, torch.bfloat16).word_dtype == torch.int16  # 6-byte rows


@pytest.mark.parametrize("kw,err,msg", [
    (dict(max_tokens=0), ValueError, "max_tokens=0"),
    (dict(hidden=-1), ValueError, "hidden=-1"),
    (dict(top_k=1.5), ValueError, "top_k=1.5"),
    (dict(num_experts=6, world_size=4), ValueError, "num_experts=6 is not divisible by world_size=4"),
    (dict(dtype=torch.int32), TypeError, "dtype="),
    (dict(capacity=0), ValueError, "capacity=0"),
])
def test_layout_bad_input(kw, err, msg):
    args = dict(max_tokens=8, hidden=4, top_k=2, num_experts=4, world_size=2, dtype=torch.float32)
    args.update(kw)
    with pytest.raises(err, match=msg):
        SymmLayout.build(**args)


def test_dispatch_bad_input():
    world = EmulatedWorld(1, 4, 6, 2, 4, torch.float32, device="cpu")
    sd = SymmDispatcher(4, buffers=world.buffers[0])
    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="x_TD.dtype=torch.float64 differs"):
        sd.dispatch(torch.zeros(4, 6, dtype=torch.float64), idx)
    with pytest.raises(ValueError, match="T=5 tokens, more than the buffers' max_tokens=4"):
        sd.dispatch(torch.zeros(5, 6), torch.zeros(5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="D=7 but the symmetric buffers were built for hidden=6"):
        sd.dispatch(torch.zeros(4, 7), idx)
    with pytest.raises(ValueError, match="K=3 but the symmetric buffers were built for top_k=2"):
        sd.dispatch(torch.zeros(4, 6), torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        sd.dispatch(torch.zeros(4, 6), idx + 4)
    with pytest.raises(TypeError, match="buffers must be a SymmBuffers"):
        SymmDispatcher(4, buffers="nope")
    with pytest.raises(ValueError, match="buffers were built for num_experts=4, not 8"):
        SymmDispatcher(8, buffers=world.buffers[0])
    x = torch.zeros(4, 6, requires_grad=True)
    with pytest.raises(ValueError, match="copy_out=False"):
        SymmDispatcher(4, buffers=world.buffers[0], copy_out=False).dispatch(x, idx)
    recv, h = sd.dispatch(torch.zeros(4, 6), idx)
    with pytest.raises(ValueError, match="y_ND has 3 rows"):
        sd.combine(recv[:3], h)
    with pytest.raises(TypeError, match="handle must come from SymmDispatcher"):
        sd.combine(recv, LocalDispatcher(4).dispatch(torch.zeros(4, 6), idx)[1])
    sd.combine(recv, h)
    world.close()
    with pytest.raises(RuntimeError, match="closed"):
        sd.dispatch(torch.zeros(4, 6), idx)
    with pytest.raises(ValueError, match="xs_TD must hold one tensor per virtual rank"):
        EmulatedWorld(2, 4, 6, 2, 4, torch.float32, device="cpu").dispatch([torch.zeros(4, 6)], [idx])


def test_topology_from_torchrun_env():
    # 2 nodes x 4 ranks; an EP group of global ranks {2, 3, 4, 5} seen from group rank 1 (global 3).
    t = Topology.from_ranks([2, 3, 4, 5], 1, env={"LOCAL_WORLD_SIZE": "4"})
    assert [t.node_of(d) for d in range(4)] == [0, 0, 1, 1]
    assert [t.same_node(d) for d in range(4)] == [True, True, False, False] and not t.single_node
    assert Topology.from_ranks([0, 1, 2, 3], 0, env={"LOCAL_WORLD_SIZE": "4"}).single_node
    assert Topology.from_ranks([0, 1], 1, env={}).single_node  # no torchrun env: one node
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x' is not an integer"):
        Topology.from_ranks([0, 1], 0, env={"LOCAL_WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="rank=2 is outside the group of 2 ranks"):
        Topology.from_ranks([0, 1], 2, env={})


def test_moe_layer_with_symm_dispatcher_matches_local():
    """MoELayer(dispatcher="symm") on one rank: same output and gradients as the local dispatcher
    (fp64, exact: the padding rows of the receive buffer stay out of every sum)."""
    import dataclasses

    from _util import make_cfg
    from tlx_dist import MoELayer

    torch.manual_seed(0)
    cfg = dataclasses.replace(make_cfg(), dtype="float64")
    a, b = MoELayer(cfg, dispatcher="local"), MoELayer(cfg, dispatcher="symm")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, cfg.dim, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = a(xa), b(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), n
    assert isinstance(b.dispatcher, SymmDispatcher) and b.dispatcher.buffers.capacity == 10 * 2
