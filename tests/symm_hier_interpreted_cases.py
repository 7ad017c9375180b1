"""The hierarchical exchange's kernels (tlx/comm/hier.py with the flat ones of tlx/comm/exchange.py)
on CPU under TRITON_INTERPRET=1, in emulated worlds of N nodes of L ranks, against the flat
oracles (emulated.reference_dispatch, the per-slot formulas) and the pure-PyTorch reference of
the hierarchical exchange (tlx_dist/comm/hier_reference.py), whose sums run in the kernels' order:
rows and fp64 sums are compared exactly, and so are the per-leg device counters.

Worlds: ranks of other nodes reached through the emulated NVSHMEM route (pointer 0; the staging
rules are checked by the emulation) or, as on one GPU, by pointer stores (``nvshmem=False``).
Run by tests/test_symm_hier_interpreted.py in its TRITON_INTERPRET=1 child."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_hier_reference import hier_routing  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch, run_lockstep  # noqa: E402
from tlx_dist.comm.hier import (COUNTER_NAMES, hier_combine_grad_steps, hier_combine_rows_grad_steps,  # noqa: E402
                                hier_combine_rows_steps, hier_combine_steps, hier_dispatch_grad_steps,
                                hier_dispatch_rows_grad_steps, hier_dispatch_steps, hier_emulated_buffers,
                                leg_counters_dict)
from tlx_dist.comm.hier_reference import destination_nodes, hier_combine_reference, hier_dispatch_reference  # noqa: E402
from tlx_dist.comm.symm_buffers import ExchangeError  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_hier_interpreted.py (needs TRITON_INTERPRET=1)")


class HierWorld:
    """W virtual ranks running the hierarchical ops in lockstep (the emulated world's harness)."""

    def __init__(self, W, T_max, D, K, E, dtype, L, nvshmem=True, capacity="worst", timeout_s=None):
        self.buffers = hier_emulated_buffers(W, T_max, D, K, E, dtype, ranks_per_node=L, device="cpu",
                                             nvshmem=nvshmem, timeout_s=timeout_s)
        self.capacity = capacity

    def dispatch(self, xs, idxs, gates, rows=False):
        return run_lockstep([hier_dispatch_steps(b, x, i, g, self.capacity, rows=rows)
                             for b, x, i, g in zip(self.buffers, xs, idxs, gates)])

    def combine(self, ys, hs):
        return run_lockstep([hier_combine_steps(b, y, h) for b, y, h in zip(self.buffers, ys, hs)])

    def combine_grad(self, gs, hs):
        return run_lockstep([hier_combine_grad_steps(b, g, h) for b, g, h in zip(self.buffers, gs, hs)])

    def dispatch_grad(self, gs, ys, hs):
        return run_lockstep([hier_dispatch_grad_steps(b, g, y, h) for b, g, y, h in zip(self.buffers, gs, ys, hs)])

    def combine_rows(self, parts, hs):
        return run_lockstep([hier_combine_rows_steps(b, p, h) for b, p, h in zip(self.buffers, parts, hs)])

    def combine_rows_grad(self, gs, hs):
        return run_lockstep([hier_combine_rows_grad_steps(b, g, h) for b, g, h in zip(self.buffers, gs, hs)])

    def dispatch_rows_grad(self, gs, ggs, hs):
        return run_lockstep([hier_dispatch_rows_grad_steps(b, g, gg, h)
                             for b, g, gg, h in zip(self.buffers, gs, ggs, hs)])

    def counters(self):
        return [leg_counters_dict(b.hier.counters) for b in self.buffers]

    def reset_counters(self):
        for b in self.buffers:
            b.hier.reset()

    def check(self):
        for b in self.buffers:
            b.check()


def _inputs(W, L, E, K, Ts, D, kind, dtype, seed=7):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, D, generator=gen).to(dtype) for T in Ts]
    idxs = [hier_routing(seed + 10 + s, T, K, E, W, L, kind) for s, T in enumerate(Ts)]
    gates = [torch.rand(T, K, generator=gen).to(dtype) for T in Ts]
    return xs, idxs, gates


def _expect_counters(dispatch_counts, combine_counts, ops=1):
    """Per-rank counters after ``ops`` dispatch-direction and combine-direction ops of these counts."""
    out = []
    for s in range(dispatch_counts.nic_rows_W.numel()):
        v = [dispatch_counts.nic_rows_W[s], dispatch_counts.nic_bytes_W[s], dispatch_counts.nvl_rows_W[s],
             dispatch_counts.nvl_bytes_W[s], combine_counts.nic_rows_W[s], combine_counts.nic_bytes_W[s],
             combine_counts.nvl_rows_W[s], combine_counts.nvl_bytes_W[s]]
        out.append(dict(zip(COUNTER_NAMES, (int(x) * ops for x in v))))
    return out


def _same(a, b, what, mag=None, roundings=1):
    """Exact, except for bf16: the interpreter has no bf16 type and truncates fp32 -> bf16 (toward
    zero) where the GPU and torch round to nearest, so each of the result's ``roundings`` may differ
    from the reference's by one bf16 ulp: ``2**-7`` of ``mag`` (the magnitude the rounded values
    summed, ``|b|`` by default)."""
    if a.dtype != torch.bfloat16:
        assert torch.equal(a, b), what
        return
    mag = b.double().abs() if mag is None else mag
    assert ((a.double() - b.double()).abs() <= roundings * 2.0 ** -7 * mag).all(), what


def _magnitude(ys, idxs, gates, E, L):
    """``sum_k |gate * y|`` per source token (fp64): the scale of a combine's roundings."""
    out, _ = hier_combine_reference([y.double().abs() for y in ys], idxs,
                                    None if gates is None else [g.double().abs() for g in gates], E, L)
    return out


def check_hier_world(W, L, E, K, Ts, D, kind, dtype=torch.float64, nvshmem=True, capacity="worst"):
    """Dispatch, combine and both backward ops of a hierarchical world vs the oracles and the
    reference's counts; returns the world and its inputs."""
    world = HierWorld(W, max(max(Ts), 1), D, K, E, dtype, L, nvshmem=nvshmem, capacity=capacity)
    xs, idxs, gates = _inputs(W, L, E, K, Ts, D, kind, dtype)
    e, N = E // W, W // L
    res = world.dispatch(xs, idxs, gates)
    flat = reference_dispatch(xs, idxs, E)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    for d, (x_exp, h) in enumerate(res):
        rows, cnt = flat[d]
        n = rows.shape[0]
        assert h.offsets_e.tolist() == cnt.cumsum(0).tolist(), f"{kind}: offsets on rank {d}"
        assert torch.equal(x_exp[:n], rows), f"{kind}: rank {d} expanded the wrong rows"
        assert h.rows_from_W.tolist() == [int((i // e == d).any(1).sum()) for i in idxs], f"{kind}: rank {d}"
    for s, (_, h) in enumerate(res):
        reach = destination_nodes(idxs[s], E, W, L)
        reach[:, s // L] = False
        got = h.route.nrow_TN >= 0
        assert torch.equal(got, reach), f"{kind}: rank {s}'s inter-node rows are not one per (token, remote node)"
        assert h.route.ncnt_N.tolist() == reach.sum(0).tolist()
    # combine: rank d's "experts" scale by 1 + d
    ys = [x_exp * (1 + d) for d, (x_exp, _) in enumerate(res)]
    hs = [h for _, h in res]
    outs = world.combine(ys, hs)
    ys_ref = [y[:flat[d][0].shape[0]] for d, y in enumerate(ys)]
    ref_out, ref_comb = hier_combine_reference(ys_ref, idxs, gates, E, L)
    mag = _magnitude(ys_ref, idxs, gates, E, L)
    for s in range(W):  # (four roundings: product, owner, relay, source)
        _same(outs[s], ref_out[s], f"{kind}: combine on rank {s}", mag[s], roundings=4)
    assert world.counters() == _expect_counters(ref.counts, ref_comb), f"{kind}: per-leg counters"
    # combine's backward: a hierarchical dispatch of g; g_y = gate * g at each slot's row, g_gate = <g, y>
    gs = [torch.randn(x.shape[0], D, generator=torch.Generator().manual_seed(3 + s)).to(dtype)
          for s, x in enumerate(xs)]
    back = world.dispatch_grad(gs, ys, hs)
    acc = torch.promote_types(dtype, torch.float32)
    slot_rows = reference_dispatch([(gates[s].to(acc)[..., None] * gs[s].to(acc)[:, None, :]).to(dtype).reshape(-1, D)
                                    for s in range(W)], [i.reshape(-1, 1) for i in idxs], E)
    for d, (g_y, _) in enumerate(back):
        n = slot_rows[d][0].shape[0]
        _same(g_y[:n], slot_rows[d][0], f"{kind}: combine backward rows on rank {d}")
    for s, idx in enumerate(idxs):
        y_slot = (xs[s][:, None, :] * (1 + idx // e)[..., None].to(dtype)).to(torch.float64)
        expect = (gs[s][:, None, :].to(torch.float64) * y_slot).sum(-1)
        tol = 1e-12 if dtype == torch.float64 else 1e-4
        torch.testing.assert_close(back[s][1].to(torch.float64), expect, rtol=tol, atol=tol)
    # dispatch's backward: an ungated hierarchical combine of the expert-row gradients
    gys = [g_y * (1 + d) for d, (g_y, _) in enumerate(back)]
    g_TD = world.combine_grad(gys, hs)
    gys_ref = [g[:flat[d][0].shape[0]] for d, g in enumerate(gys)]
    ref_g, _ = hier_combine_reference(gys_ref, idxs, None, E, L)
    mag = _magnitude(gys_ref, idxs, None, E, L)
    for s in range(W):  # (three roundings: owner, relay, source)
        _same(g_TD[s], ref_g[s], f"{kind}: dispatch backward on rank {s}", mag[s], roundings=3)
    assert world.counters() == _expect_counters(ref.counts, ref_comb, ops=2), f"{kind}: counters after backward"
    world.check()
    return world, xs, idxs, gates, res


@pytest.mark.parametrize("W,L,kind", [
    (8, 4, "random"),      # W = 8 as 2 x 4
    (8, 2, "random"),      # W = 8 as 4 x 2
    (4, 2, "random"),      # W = 4 as 2 x 2
    (8, 4, "one_node"),    # every token to node 0: the relays of node 1 get only node 0's ... nothing
    (4, 2, "empty_node"),  # the last node receives nothing
])
def test_hier_world_matches_oracles(W, L, kind):
    E, K, D = 2 * W, 3, 4
    Ts = [2 + (3 * s) % 4 for s in range(W)]
    Ts[1] = 0  # a rank with no tokens
    check_hier_world(W, L, E, K, Ts, D, kind)


def test_hier_world_k_equals_e():
    """K = E: every token reaches every rank of every node (the relays forward to all L ranks)."""
    check_hier_world(4, 2, 4, 4, [3, 2, 1, 2], 3, "all_experts")


def test_hier_world_by_pointer_stores():
    """The one-GPU form: every rank keeps its pointer, the inter-node leg is plain stores (same rows,
    counts and sums)."""
    check_hier_world(4, 2, 8, 3, [3, 4, 0, 2], 4, "random", nvshmem=False)
    check_hier_world(8, 2, 16, 2, [2, 1, 3, 2, 2, 0, 1, 3], 3, "one_rank_per_node", nvshmem=False)


def test_hier_world_low_precision_exact_capacity_and_one_rank_nodes():
    """fp16 rows (the relay's rounding: exact against the reference, which rounds where the kernels
    do) and bf16 rows with odd D (puts of odd byte counts); capacity="exact" (the send computes the
    layout, HMETA carries expanded rows, not raw codes); one rank a node (the relay is the only
    owner: no forward)."""
    check_hier_world(4, 2, 8, 3, [4, 3, 2, 3], 8, "random", torch.float16)
    check_hier_world(4, 2, 8, 3, [4, 3, 2, 3], 7, "random", torch.bfloat16)
    check_hier_world(4, 2, 8, 3, [4, 0, 2, 3], 4, "random", capacity="exact")
    check_hier_world(4, 1, 8, 2, [2, 3, 1, 2], 4, "random")


def test_hier_one_node_is_the_flat_path_bit_for_bit():
    """L = W: no inter-node leg; every result equals the flat emulated world's, bit for bit, and the
    NIC counters stay 0."""
    W, E, K, D = 4, 8, 3, 5
    Ts = [3, 5, 0, 2]
    world, xs, idxs, gates, res = check_hier_world(W, W, E, K, Ts, D, "random", torch.bfloat16)
    flat = EmulatedWorld(W, max(Ts), D, K, E, torch.bfloat16, device="cpu")
    fres = flat.dispatch(xs, idxs, gates)
    ys = [x * (1 + d) for d, (x, _) in enumerate(res)]
    fys = [x * (1 + d) for d, (x, _) in enumerate(fres)]
    for (a, h), (b, _) in zip(res, fres):
        n = int(h.offsets_e[-1])  # (rows past the routed ones are unspecified)
        assert torch.equal(a[:n], b[:n])
    outs = world.combine(ys, [h for _, h in res])
    fouts = flat.combine(fys, [h for _, h in fres])
    assert all(torch.equal(a, b) for a, b in zip(outs, fouts))
    assert all(c["dispatch_nic_rows"] == c["combine_nic_rows"] == 0 for c in world.counters())


def test_hier_row_form_matches_flat_row_form():
    """The fused pipeline's row form (dispatch_rows / combine_rows and their backward ops): the
    receive rows, index maps and gates the flat row form gives, and its sums node-first."""
    W, L, E, K, D = 4, 2, 8, 3, 4
    Ts = [3, 2, 4, 1]
    world = HierWorld(W, max(Ts), D, K, E, torch.float64, L)
    flat = EmulatedWorld(W, max(Ts), D, K, E, torch.float64, device="cpu")
    xs, idxs, gates = _inputs(W, L, E, K, Ts, D, "random", torch.float64)
    res = world.dispatch(xs, idxs, gates, rows=True)
    fres = flat.dispatch_rows(xs, idxs, gates)
    for d, ((recv, src, gate_n, h), (frecv, fsrc, fgate, fh)) in enumerate(zip(res, fres)):
        for s in range(W):  # the valid receive rows of every source
            lo, n = s * max(Ts), int(fh.rows_from_W[s])
            assert torch.equal(recv[lo:lo + n], frecv[lo:lo + n]), f"rank {d}, source {s}"
        n = int(fh.offsets_e[-1])  # (the expanded rows past the routed ones are unspecified)
        assert torch.equal(src[:n], fsrc[:n]) and torch.equal(gate_n[:n], fgate[:n])
        assert torch.equal(h.offsets_e, fh.offsets_e)
    # partial rows: receive row r of rank d scaled by 1 + d (what a fused down-GEMM would leave)
    parts = [recv * (1 + d) for d, (recv, *_rest) in enumerate(res)]
    outs = world.combine_rows(parts, [r[3] for r in res])
    fouts = flat.combine_rows([p.clone() for p in parts], [r[3] for r in fres])
    for a, b in zip(outs, fouts):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    gs = [torch.randn(x.shape, dtype=torch.float64) for x in xs]
    g_parts = world.combine_rows_grad(gs, [r[3] for r in res])
    fg_parts = flat.combine_rows_grad(gs, [r[3] for r in fres])
    for d, (a, b) in enumerate(zip(g_parts, fg_parts)):
        for s in range(W):
            lo, n = s * max(Ts), int(res[d][3].rows_from_W[s])
            assert torch.equal(a[lo:lo + n], b[lo:lo + n])
    gg = [torch.randn(r[1].shape[0], dtype=torch.float64) for r in res]
    back = world.dispatch_rows_grad(g_parts, gg, [r[3] for r in res])
    fback = flat.dispatch_rows_grad(fg_parts, gg, [r[3] for r in fres])
    for (a, ga), (b, gb) in zip(back, fback):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert torch.equal(ga, gb)
    world.check()


def test_hier_repeated_ops_reuse_buffers():
    """Three dispatch/combine rounds on the same buffers with different routing: each round's
    counts, flags and relay counters start clean (a stale HARRIVE or HCARR would pass a wait early
    or hang it), and the counters add up."""
    W, L, E, K, D = 4, 2, 8, 2, 3
    world = HierWorld(W, 5, D, K, E, torch.float64, L)
    for rnd, kind in enumerate(["random", "one_node", "empty_node"]):
        Ts = [(rnd + s) % 4 + 1 for s in range(W)]
        xs, idxs, gates = _inputs(W, L, E, K, Ts, D, kind, torch.float64, seed=rnd)
        world.reset_counters()
        res = world.dispatch(xs, idxs, gates)
        flat = reference_dispatch(xs, idxs, E)
        for d, (x_exp, _) in enumerate(res):
            assert torch.equal(x_exp[:flat[d][0].shape[0]], flat[d][0]), f"round {rnd} rank {d}"
        ys = [x * 2 for x, _ in res]
        outs = world.combine(ys, [h for _, h in res])
        ref_out, ref_comb = hier_combine_reference([y[:flat[d][0].shape[0]] for d, y in enumerate(ys)], idxs, gates,
                                                   E, L)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref_out)), f"round {rnd}"
        ref = hier_dispatch_reference(xs, idxs, E, L)
        assert world.counters() == _expect_counters(ref.counts, ref_comb)
        for b in world.buffers:  # the relays left their arrival counters at zero
            H = b.hier.layout
            assert b._region(H.off_harrive, 8 * W).view(torch.int64).tolist() == [0] * W
            assert b._region(H.off_hcarr, 8 * W).view(torch.int64).tolist() == [0] * W
    world.check()


def test_hier_node_limited_routing_reaches_at_most_topk_group_nodes():
    """Node-limited routing (groups = nodes, top-2 groups of 4): every token's inter-node rows go to at
    most 2 nodes (one of them may be its own), asserted on the device counters."""
    from tlx_dist.router import group_limited_select
    W, L, E, K, D = 8, 2, 16, 4, 4
    N = W // L
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(W)]
    idxs, gates = [], []
    for x in xs:
        scores = torch.rand(x.shape[0], E, generator=gen, dtype=torch.float64)
        idx = group_limited_select(scores, N, 2).topk(K, dim=-1).indices
        idxs.append(idx)
        gates.append(scores.gather(1, idx))
    world = HierWorld(W, 3, D, K, E, torch.float64, L)
    res = world.dispatch(xs, idxs, gates)
    for s, (_, h) in enumerate(res):
        nodes = destination_nodes(idxs[s], E, W, L)
        assert (nodes.sum(1) <= 2).all()
        nic = (h.route.nrow_TN >= 0).sum(1)
        assert (nic <= 2).all() and torch.equal(nic, (nodes & (torch.arange(N) != s // L)).sum(1))
        assert world.counters()[s]["dispatch_nic_rows"] == int(nic.sum())


def test_hier_bounded_wait_names_the_relay_wait():
    """A source that skips the dispatch: its relays' waits for its count give up and are reported
    (ExchangeError), never a hang."""
    W, L, E, K, D = 4, 2, 8, 2, 3
    world = HierWorld(W, 3, D, K, E, torch.float64, L, timeout_s=0.002)
    xs, idxs, gates = _inputs(W, L, E, K, [3, 3, 3, 3], D, "random", torch.float64)
    gens = [hier_dispatch_steps(b, x, i, g) for b, x, i, g in zip(world.buffers, xs, idxs, gates)]
    for v in (0, 1, 2):  # rank 3 never starts
        next(gens[v])
    for v in (0, 1, 2):
        next(gens[v])
    with pytest.raises(ExchangeError, match="rank"):
        for v in (0, 1, 2):
            next(gens[v])
        world.check()
