"""The hierarchical exchange's kernels (tlx/comm/hier.py with the flat ones of tlx/comm/exchange.py)
on CPU under TRITON_INTERPRET=1, in emulated worlds of N nodes of L ranks, against the flat
oracles (emulated.reference_dispatch, the per-slot formulas) and the pure-PyTorch reference of
the hierarchical exchange (tlx_dist/comm/hier_reference.py), whose sums run in the kernels' order:
rows and fp64 sums are compared exactly, and so are the per-leg device counters.

Worlds: ranks of other nodes reached through the emulated NVSHMEM route (pointer 0; the staging
rules are checked by the emulation) or, as on one GPU, by pointer stores (``nvshmem=False``).
Run by tests/test_symm_interpreted.py in its TRITON_INTERPRET=1 child (more cases:
tests/symm_hier_more_interpreted_cases.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_hier_reference import hier_routing  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch  # noqa: E402
from tlx_dist.comm.symm import LEG_COUNTERS, ExchangeConfig  # noqa: E402
from tlx_dist.comm.hier_reference import (destination_nodes, hier_combine_reference,  # noqa: E402
                                          hier_dispatch_reference)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


def HierWorld(W, T_max, D, K, E, dtype, L, nvshmem=None, capacity="worst", timeout_s=None, device="cpu",
              **config):
    """An emulated world of W ranks in nodes of L running the hierarchical exchange."""
    return EmulatedWorld(W, T_max, D, K, E, dtype, capacity=capacity, device=device, timeout_s=timeout_s,
                         ranks_per_node=L, config=ExchangeConfig(topology="hierarchical", **config), nvshmem=nvshmem)


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
        out.append(dict(zip(LEG_COUNTERS, (int(x) * ops for x in v))))
    return out


def _same(a, b, what, mag=None, roundings=1):
    """Exact, but where the kernels round differently from the torch reference by construction:
    bf16 in the interpreter, which has no bf16 type and truncates fp32 -> bf16 (toward zero) where
    the GPU and torch round to nearest -- one bf16 ulp (``2**-7`` of the magnitude) per rounding;
    fp32 sums on a GPU, where the compiler contracts a gated product and its add into one FMA (the
    product is not rounded) -- one fp32 ulp (``2**-23``) per rounding. ``mag``: the magnitude the
    rounded values summed (``|b|`` by default); ``roundings``: how many the result went through."""
    on_gpu = a.device.type == "cuda"
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.bfloat16 and not on_gpu:
        ulp = 2.0 ** -7
    elif a.dtype == torch.float32 and on_gpu:
        ulp = 2.0 ** -23
    else:
        assert torch.equal(a, b), what
        return
    mag = b.double().abs() if mag is None else mag
    assert ((a.double() - b.double()).abs() <= roundings * ulp * mag).all(), what


def _magnitude(ys, idxs, gates, E, L):
    """``sum_k |gate * y|`` per source token (fp64): the scale of a combine's roundings."""
    out, _ = hier_combine_reference([y.double().abs() for y in ys], idxs,
                                    None if gates is None else [g.double().abs() for g in gates], E, L)
    return out


def check_hier_world(W, L, E, K, Ts, D, kind, dtype=torch.float64, nvshmem=None, capacity="worst", device="cpu"):
    """Dispatch, combine and both backward ops of a hierarchical world vs the oracles and the
    reference's counts (on ``device``: the interpreter on CPU, or one GPU with ``nvshmem=False``);
    returns the world and its inputs (on CPU) and the dispatch's results."""
    world = HierWorld(W, max(max(Ts), 1), D, K, E, dtype, L, nvshmem=nvshmem, capacity=capacity, device=device)
    xs, idxs, gates = _inputs(W, L, E, K, Ts, D, kind, dtype)
    dev = torch.device(device)
    e, N = E // W, W // L
    res = world.dispatch([x.to(dev) for x in xs], [i.to(dev) for i in idxs], [g.to(dev) for g in gates])
    res = [(x.cpu(), h) for x, h in res]
    flat = reference_dispatch(xs, idxs, E)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    for d, (x_exp, h) in enumerate(res):
        rows, cnt = flat[d]
        n = rows.shape[0]
        assert h.offsets_e.tolist() == cnt.cumsum(0).tolist(), f"{kind}: offsets on rank {d}"
        assert torch.equal(x_exp[:n], rows), f"{kind}: rank {d} expanded the wrong rows"
        assert h.rows_from_W.tolist() == [int((i // e == d).any(1).sum()) for i in idxs], f"{kind}: rank {d}"
    assert world.hierarchical
    for s, (_, h) in enumerate(res):
        reach = destination_nodes(idxs[s], E, W, L)
        reach[:, s // L] = False
        got = h.route.nrow_TN.cpu() >= 0
        assert torch.equal(got, reach), f"{kind}: rank {s}'s inter-node rows are not one per (token, remote node)"
        assert h.route.ncnt_N.tolist() == reach.sum(0).tolist()
    # combine: rank d's "experts" scale by 1 + d
    ys = [x_exp * (1 + d) for d, (x_exp, _) in enumerate(res)]
    hs = [h for _, h in res]
    outs = world.combine([y.to(dev) for y in ys], hs)
    ys_ref = [y[:flat[d][0].shape[0]] for d, y in enumerate(ys)]
    ref_out, ref_comb = hier_combine_reference(ys_ref, idxs, gates, E, L)
    mag = _magnitude(ys_ref, idxs, gates, E, L)
    for s in range(W):  # (four roundings: product, owner, relay, source)
        _same(outs[s], ref_out[s], f"{kind}: combine on rank {s}", mag[s], roundings=4)
    assert world.leg_counters() == _expect_counters(ref.counts, ref_comb), f"{kind}: per-leg counters"
    # combine's backward: a hierarchical dispatch of g; g_y = gate * g at each slot's row, g_gate = <g, y>
    gs = [torch.randn(x.shape[0], D, generator=torch.Generator().manual_seed(3 + s)).to(dtype)
          for s, x in enumerate(xs)]
    back = [(a.cpu(), b.cpu()) for a, b in world.dispatch_grad([g.to(dev) for g in gs], [y.to(dev) for y in ys], hs)]
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
    g_TD = world.combine_grad([g.to(dev) for g in gys], hs)
    gys_ref = [g[:flat[d][0].shape[0]] for d, g in enumerate(gys)]
    ref_g, _ = hier_combine_reference(gys_ref, idxs, None, E, L)
    mag = _magnitude(gys_ref, idxs, None, E, L)
    for s in range(W):  # (three roundings: owner, relay, source)
        _same(g_TD[s], ref_g[s], f"{kind}: dispatch backward on rank {s}", mag[s], roundings=3)
    assert world.leg_counters() == _expect_counters(ref.counts, ref_comb, ops=2), f"{kind}: counters after backward"
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
