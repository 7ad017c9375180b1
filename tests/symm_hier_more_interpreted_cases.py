"""More of the hierarchical exchange under TRITON_INTERPRET=1 (tests/symm_hier_interpreted_cases.py
has the harness and the oracle worlds): low precision and capacity="exact", one node against the flat
path bit for bit, the fused pipeline's row form, buffers reused across rounds, node-limited routing
on the counters, a bounded wait, and the node route alone. Run by tests/test_symm_interpreted.py
in its TRITON_INTERPRET=1 child."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from symm_hier_interpreted_cases import HierWorld, _inputs, _expect_counters, check_hier_world  # noqa: E402
from test_hier_reference import hier_routing  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch  # noqa: E402
from tlx_dist.comm.symm import ExchangeConfig, dispatch_steps  # noqa: E402
from tlx_dist.comm.hier_reference import (destination_nodes, hier_combine_reference,  # noqa: E402
                                          hier_dispatch_reference)
from tlx_dist.comm.symm.buffers import ExchangeError  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


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
    assert all(c["dispatch_nic_rows"] == c["combine_nic_rows"] == 0 for c in world.leg_counters())


def test_hier_row_form_matches_flat_row_form():
    """The fused pipeline's row form (dispatch_rows / combine_rows and their backward ops): the
    receive rows, index maps and gates the flat row form gives, and its sums node-first."""
    W, L, E, K, D = 4, 2, 8, 3, 4
    Ts = [3, 2, 4, 1]
    world = HierWorld(W, max(Ts), D, K, E, torch.float64, L)
    flat = EmulatedWorld(W, max(Ts), D, K, E, torch.float64, device="cpu")
    xs, idxs, gates = _inputs(W, L, E, K, Ts, D, "random", torch.float64)
    res = world.dispatch_rows(xs, idxs, gates)
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
        world.reset_leg_counters()
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
        assert world.leg_counters() == _expect_counters(ref.counts, ref_comb)
        for b in world.buffers:  # the relays left their arrival counters at zero
            H = b.hier.layout
            assert b._region(H.off_harrive, 8 * W).view(torch.int64).tolist() == [0] * W
            assert b._region(H.off_hcarr, 8 * W).view(torch.int64).tolist() == [0] * W
    world.check()


def test_hier_node_limited_routing_reaches_at_most_topk_group_nodes():
    """Node-limited routing (MoEConfig n_group = the nodes, topk_group = 2 of 4, DeepSeek-V3's 4 of 8
    in small): every token's inter-node rows go to at most 2 nodes (one of them may be its own),
    asserted on the node route and the device counters."""
    from tlx_dist.config import MoEConfig
    from tlx_dist.router import Router
    W, L, E, K, D = 8, 2, 16, 4, 4
    N = W // L
    cfg = MoEConfig(dim=D, moe_inter_dim=8, num_experts=E, top_k=K, score_func="sigmoid", n_group=N, topk_group=2,
                    dtype="float64")
    router = Router(cfg)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(W)]
    idxs, gates = [], []
    with torch.no_grad():
        for x in xs:
            out = router(x)
            idxs.append(out.idx_TK)
            gates.append(out.gate_TK.to(torch.float64))
    world = HierWorld(W, 3, D, K, E, torch.float64, L)
    res = world.dispatch(xs, idxs, gates)
    for s, (_, h) in enumerate(res):
        nodes = destination_nodes(idxs[s], E, W, L)
        assert (nodes.sum(1) <= 2).all()
        nic = (h.route.nrow_TN >= 0).sum(1)
        assert (nic <= 2).all() and torch.equal(nic, (nodes & (torch.arange(N) != s // L)).sum(1))
        assert world.leg_counters()[s]["dispatch_nic_rows"] == int(nic.sum())
    # (not vacuous: the routing does use two nodes, and some token reaches two others)
    assert max(int(destination_nodes(i, E, W, L).sum(1).max()) for i in idxs) == 2
    assert any(bool(((h.route.nrow_TN >= 0).sum(1) == 2).any()) for _, h in res)


def test_hier_bounded_wait_names_the_relay_wait():
    """Rank 3 (node 1, local rank 1) skips a dispatch: its relay on node 0, rank 1, gives up waiting
    for its node count and records the relay's op and rank 3; rank 0 waits for rank 3's counts. Both
    are reported by check() (ExchangeError naming the peer), never a hang."""
    W, L, E, K, D = 4, 2, 8, 2, 3
    world = HierWorld(W, 3, D, K, E, torch.float64, L, timeout_s=0.002)
    xs, idxs, gates = _inputs(W, L, E, K, [3, 3, 3, 3], D, "random", torch.float64)
    gens = [dispatch_steps(b, x, i, g) for b, x, i, g in zip(world.buffers[:3], xs, idxs, gates)]
    for _ in range(3):  # every phase but the op's last (the expand, which would end the op)
        for g in gens:
            next(g)
    from tlx.comm.hier import OP_RELAY_ROWS
    code = int(world.buffers[1].state()[2])
    assert code == int(OP_RELAY_ROWS.value) * 65536 + 3, hex(code)
    with pytest.raises(ExchangeError, match=r"rank 1 waited 0.002 s for the .* from rank 3"):
        world.buffers[1].check()
    for g in gens:  # the expand kernels: rank 0 and 2 give up on rank 3's counts
        with pytest.raises(StopIteration):
            next(g)
    with pytest.raises(ExchangeError, match=r"rank 0 waited 0.002 s for the .* from rank 3"):
        world.buffers[0].check()
    world.buffers[3].check()  # the rank that skipped saw nothing wrong


def test_node_route_numbering_across_blocks():
    """The node route alone, walking 4-token blocks (its per-node carry crosses blocks), against the
    formulas: the relay's own tokens at their flat receive row there, then the node's other tokens in
    token order; the near columns; the combine view and its row counts."""
    from tlx_dist.comm.symm import hier
    from tlx_dist.comm.symm.launch import route as _route
    W, L, E, K, T = 8, 2, 16, 3, 23
    bufs = HierWorld(W, T, 4, K, E, torch.float32, L, route_block=4).buffers
    e, N = E // W, W // L
    for r in (0, 5):
        idx = hier_routing(r, T, K, E, W, L, "random")
        b = bufs[r]
        _, send_row, counts = _route(b, idx)
        route = hier._node_route(b, idx, send_row, counts)
        to_rank = (idx[:, :, None] // e == torch.arange(W)).any(1)
        rows_to = to_rank.sum(0)
        assert torch.equal(send_row >= 0, to_rank) and counts[E:].tolist() == rows_to.tolist()
        n, l = divmod(r, L)
        same = torch.arange(W) // L == n
        assert torch.equal(route.near_TW, torch.where(same, send_row, -1))
        reach = destination_nodes(idx, E, W, L)
        for m in range(N):
            col = route.nrow_TN[:, m]
            if m == n:
                assert (col == -1).all()
                continue
            rr = m * L + l
            mine = send_row[:, rr] >= 0
            others = reach[:, m] & ~mine
            expect = torch.full((T,), -1, dtype=torch.int32)
            expect[mine] = send_row[mine, rr]
            expect[others] = (int(rows_to[rr]) + torch.arange(int(others.sum()))).to(torch.int32)
            assert torch.equal(col, expect), (r, m)
            assert int(route.ncnt_N[m]) == int(reach[:, m].sum())
            assert torch.equal(route.comb_row_TW[:, rr], expect)
        assert int(route.ncnt_N[n]) == 0
        for d in range(W):
            if same[d]:
                assert torch.equal(route.comb_row_TW[:, d], send_row[:, d]) and int(route.comb_to_W[d]) == rows_to[d]
            elif d % L == l:
                assert int(route.comb_to_W[d]) == int(route.ncnt_N[d // L])
            else:
                assert (route.comb_row_TW[:, d] == -1).all() and int(route.comb_to_W[d]) == 0
