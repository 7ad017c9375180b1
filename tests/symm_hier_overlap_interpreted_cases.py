"""The overlapped hierarchical dispatch (``ExchangeConfig.overlap`` on a buffer set spanning nodes,
``tlx_dist/comm/symm/hier_overlap.py``) on CPU under TRITON_INTERPRET=1, in emulated worlds of N
nodes of L ranks, against the plain hierarchical row form: the same expert-major rows, index maps,
gates and layout; the fused layer on the plan (``fused_experts_rows(overlap=)``: the reference
backend waits and runs one pass; the portable Triton kernels run the phased forward -- gate/up over
this node's runs, wait, the rest, down over the other nodes' runs, their partial rows to the
relays early, down over this node's runs) and the combine give the plain form's outputs, and every
gradient, bit for bit; the per-leg counters are the same; the plan's counters (HRROWS at the
relays, HFROWS at the owners) are taken off by the ops that wait on them; a wait that never
completes is reported by ``check()``; a plan abandoned before its GEMMs is finished by the next op.

The emulated world runs each rank's side-stream work in line (its ranks run one after another), so
every row has landed in RECV when the dispatch returns; what the plan's wait adds here is the
counters' check and the copy of the other nodes' rows out of RECV.
Run by tests/test_symm_interpreted.py in its TRITON_INTERPRET=1 child."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from symm_hier_interpreted_cases import HierWorld, _expect_counters, _inputs  # noqa: E402
from tlx_dist.comm.emulated import reference_dispatch  # noqa: E402
from tlx_dist.comm.hier_reference import hier_combine_reference, hier_dispatch_reference  # noqa: E402
from tlx_dist.comm.symm import HierRowsOverlap, combine_rows_steps, dispatch_steps  # noqa: E402
from tlx_dist.comm.symm.buffers import ExchangeError  # noqa: E402
from tlx_dist.fused import fused_experts_rows  # noqa: E402
from tlx_dist.fused.reference import fused_experts_ref  # noqa: E402
from tlx_dist.testing import assert_close_to_ref  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


def _counters(b, name):
    """A rank's hierarchical counter region ``name`` (``[W]`` int64) as a list."""
    H = b.hier.layout
    return b._region(getattr(H, f"off_{name}"), 8 * b.world_size).view(torch.int64).tolist()


def _check_plan(world, d, h, src, T_max):
    """Rank d's plan right after the dispatch: its present rows are its node's sources', every expert
    cut in (earlier nodes | this node | later nodes) runs, HFROWS holds every other-node row (the
    emulated world forwards in line) and the relays took their rows off HRROWS."""
    b = world.buffers[d]
    Lh = b.hier.layout.ranks_per_node
    node = d // Lh
    ov = h.overlap
    assert isinstance(ov, HierRowsOverlap), f"rank {d}: no plan"
    assert ov.present_rows == (node * Lh * T_max, (node + 1) * Lh * T_max)
    offs, V = h.offsets_e.long(), ov.offsets_V.long()
    for j in range(offs.shape[0]):
        lo = int(offs[j - 1]) if j else 0
        a, m, c = (int(v) for v in V[3 * j:3 * j + 3])
        assert lo <= a <= m <= c == int(offs[j]), f"rank {d}, expert {j}: runs {lo, a, m, c}"
        s_node = src[lo:c].long() // T_max // Lh
        assert bool((s_node[:a - lo] < node).all()) and bool((s_node[a - lo:m - lo] == node).all()) and \
            bool((s_node[m - lo:] > node).all()), f"rank {d}, expert {j}: runs are not by node"
    same = torch.arange(b.world_size) // Lh == node
    want = torch.where(same, 0, h.rows_from_W)
    assert _counters(b, "hfrows") == want.tolist(), f"rank {d}: HFROWS before the wait"
    assert _counters(b, "hrrows") == [0] * b.world_size, f"rank {d}: HRROWS left after the forward"
    assert not ov.waited and ov.partials_sent is None


def _layer(world, xs, idxs, gates, w13, w2, backend, overlap, dt, seed):
    """One MoE layer over the world, forward and backward, every rank: dispatch_rows, the fused
    experts (autograd leaves: receive rows, gates, weights), combine_rows, then the backward ops.
    Returns what must not depend on the overlap."""
    W = world.world_size
    e = w13.shape[0] // W
    T_max = world.buffers[0].layout.max_tokens
    res = world.dispatch_rows(xs, idxs, gates, overlap=overlap)
    out, parts, leaves = [], [], []
    for d, (recv, src, gate_N, h) in enumerate(res):
        if overlap:
            _check_plan(world, d, h, src, T_max)
        else:
            assert h.overlap is None
        lv = [recv.requires_grad_(True), gate_N.requires_grad_(True),
              w13[d * e:(d + 1) * e].clone().requires_grad_(True), w2[d * e:(d + 1) * e].clone().requires_grad_(True)]
        leaves.append(lv)
        parts.append(fused_experts_rows(lv[0], src, src, lv[1], lv[2], lv[3], h.offsets_e, recv.shape[0],
                                        backend=backend, overlap=h.overlap))
        if overlap:
            assert h.overlap.waited
            assert (h.overlap.partials_sent is not None) == (backend == "triton")
            assert _counters(world.buffers[d], "hfrows") == [0] * W, f"rank {d}: the wait takes the rows off"
        n = int(h.offsets_e[-1])
        out.append((recv[src[:n].long()].detach().clone(), src[:n].clone(), gate_N[:n].detach().clone(),
                    h.offsets_e.clone(), h.pos_RK.clone()))
    hs = [r[3] for r in res]
    out.append(world.combine_rows([p.detach() for p in parts], hs))
    if overlap:
        for d, h in enumerate(hs):
            assert h.overlap.joined and "hier" not in world.buffers[d]._overlap_plans, f"rank {d}: plan left"
    gen = torch.Generator().manual_seed(seed)
    g_TD = [torch.randn(x.shape, generator=gen).to(dt) for x in xs]
    g_parts = world.combine_rows_grad(g_TD, hs)
    torch.autograd.backward(parts, g_parts)
    out.append([t for lv in leaves for t in (lv[0].grad, lv[1].grad, lv[2].grad, lv[3].grad)])
    out.append([t for pair in world.dispatch_rows_grad([lv[0].grad for lv in leaves], [lv[1].grad for lv in leaves],
                                                       hs) for t in pair])
    return out


def _compare(a, b, what):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{what}[{i}]")
    else:
        assert torch.equal(a, b), f"{what}: the overlapped form differs from the plain one"


def _dense_oracle(xs, idxs, gates, g_TD, w13, w2, dtype):
    """The layer without any exchange -- every source's tokens through the experts they picked
    (``fused_experts_ref``, what the all-to-all path computes), plain autograd in ``dtype`` --
    returns ``(out_TD per source, dx_TD per source, dgate_TK per source, dw13, dw2)``."""
    leaf = lambda t: t.detach().to(dtype).clone().requires_grad_(True)  # noqa: E731
    x, g = [leaf(t) for t in xs], [leaf(t) for t in gates]
    a, b = leaf(w13), leaf(w2)
    outs = [fused_experts_ref(xx, i, gg, a, b) for xx, i, gg in zip(x, idxs, g)]
    live = [(o, t.to(dtype)) for o, t in zip(outs, g_TD) if o.grad_fn is not None]  # (a source of no tokens: none)
    torch.autograd.backward([o for o, _ in live], [t for _, t in live])
    grad = lambda t: torch.zeros_like(t) if t.grad is None else t.grad  # noqa: E731
    return [o.detach() for o in outs], [grad(t) for t in x], [grad(t) for t in g], a.grad, b.grad


def _check_oracle(lay, xs, idxs, gates, w13, w2, dt, seed, what):
    """One overlapped layer (``_layer``'s result) against :func:`_dense_oracle` in fp64, under the
    STYLE.md bound (twice torch's own error in ``dt`` plus the dtype's floor)."""
    W = len(xs)
    gen = torch.Generator().manual_seed(seed)
    g_TD = [torch.randn(x.shape, generator=gen).to(dt) for x in xs]  # (what _layer drew)
    ref = _dense_oracle(xs, idxs, gates, g_TD, w13, w2, torch.float64)
    same = _dense_oracle(xs, idxs, gates, g_TD, w13, w2, dt) if dt != torch.float64 else [None] * 5
    outs, leaf, back = lay[W], lay[W + 1], lay[W + 2]
    ours = (outs, back[0::2], back[1::2], torch.cat(leaf[2::4]), torch.cat(leaf[3::4]))
    for name, o, r, t in zip(("out", "dx", "dgate", "dw13", "dw2"), ours, ref, same):
        if isinstance(o, (list, tuple)):
            for s in range(W):
                assert_close_to_ref(o[s], r[s], None if t is None else t[s], dtype=dt, name=f"{what}: {name}[{s}]")
        else:
            assert_close_to_ref(o, r, t, dtype=dt, name=f"{what}: {name}")


def _reference_counters(ops, E, L):
    """The per-leg counters of ``_layer`` on each op (two dispatch-direction ops -- the dispatch and
    combine's backward -- and two combine-direction ones), from the hierarchical reference."""
    total = None
    for xs, idxs, gates in ops:
        ref = hier_dispatch_reference(xs, idxs, E, L)
        rows = [r for r, _ in reference_dispatch(xs, idxs, E)]
        _, comb = hier_combine_reference(rows, idxs, gates, E, L)
        c = _expect_counters(ref.counts, comb, ops=2)
        total = c if total is None else [{k: a[k] + b[k] for k in a} for a, b in zip(total, c)]
    return total


@pytest.mark.parametrize("W,L,kind,backend,Ts", [
    (4, 2, "random", "triton", [3, 2, 4, 1]),          # 2 x 2, the phased forward
    (4, 2, "random", "reference", [4, 0, 3, 2]),       # a rank with no tokens
    (4, 2, "one_node", "reference", [3, 2, 2, 3]),     # 2 x 2, every token to node 0
    # the 8-rank worlds in the release tier (each interprets every rank's kernels: minutes on 2 cores)
    pytest.param(8, 4, "random", "reference", [2, 3, 1, 2, 3, 2, 1, 2], marks=pytest.mark.release),  # 2 x 4
    pytest.param(8, 4, "one_node", "triton", [2, 2, 1, 3, 2, 1, 2, 2], marks=pytest.mark.release),  # node 0 only
    pytest.param(8, 4, "empty_node", "reference", [1, 2, 3, 2, 2, 1, 3, 2], marks=pytest.mark.release),
    pytest.param(8, 2, "one_node", "triton", [2, 1, 3, 2, 1, 2, 2, 1], marks=pytest.mark.release),
    (4, 2, "empty_node", "triton", [3, 3, 2, 1]),      # the last node receives nothing
])
def test_overlapped_hier_layer_equals_the_plain_one(W, L, kind, backend, Ts):
    """Two layers in a row on the same buffers (the counters start clean for the second), both
    forms, every output and gradient bit for bit, the same per-leg counters; the overlapped form
    against the dense (all-to-all) oracle, forward and every gradient, and its counters against
    the hierarchical reference's, exactly."""
    E, K, D, Fe = 2 * W, 3, 8, 4
    dt = torch.float64 if backend == "reference" else torch.float32  # (the portable kernels: no fp64)
    gen = torch.Generator().manual_seed(W + L)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen).to(dt) * 0.5
    w2 = torch.randn(E, Fe, D, generator=gen).to(dt) * 0.5
    ops = [_inputs(W, L, E, K, Ts, D, kind, dt, seed=s) for s in (3, 4)]
    got = {}
    for overlap in (False, True):
        world = HierWorld(W, max(Ts), D, K, E, dt, L)
        got[overlap] = [_layer(world, *op, w13, w2, backend, overlap, dt, seed=k) for k, op in enumerate(ops)]
        got[overlap].append(world.leg_counters())
        world.check()
        world.close()
    _compare(got[False][:-1], got[True][:-1], f"W={W} L={L} {kind}")
    assert got[False][-1] == got[True][-1], "per-leg counters"
    for k, op in enumerate(ops):
        _check_oracle(got[True][k], *op, w13, w2, dt, seed=k, what=f"W={W} L={L} {kind} layer {k}")
    assert got[True][-1] == _reference_counters(ops, E, L), "per-leg counters vs the reference"


def test_overlapped_hier_by_pointer_stores_and_an_overflowing_capacity():
    """The one-GPU form (every rank keeps its pointers; nvshmem=False) overlapped equals plain; a
    static capacity that overflows is flagged by check() in both forms, with the same rows."""
    W, L, E, K, D, Fe = 4, 2, 8, 3, 4, 4
    Ts = [4, 3, 4, 2]
    dt = torch.float64
    gen = torch.Generator().manual_seed(2)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=dt)
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=dt)
    op = _inputs(W, L, E, K, Ts, D, "random", dt, seed=5)
    for nvshmem, capacity in ((False, "worst"), (None, 0.5)):
        got = {}
        for overlap in (False, True):
            world = HierWorld(W, max(Ts), D, K, E, dt, L, nvshmem=nvshmem, capacity=capacity)
            got[overlap] = _layer(world, *op, w13, w2, "reference", overlap, dt, seed=1)
            if capacity == 0.5:
                with pytest.raises(RuntimeError, match="received more expert rows"):
                    world.check()
            else:
                world.check()
            world.close()
        _compare(got[False], got[True], f"nvshmem={nvshmem} capacity={capacity}")


def test_overlap_needs_the_row_form_a_static_capacity_and_nodes():
    """Where the overlap cannot run -- the expanded form, capacity 'exact', one node -- the dispatch
    is the plain one (no plan)."""
    W, L, E, K, D = 4, 2, 8, 2, 4
    Ts = [2, 3, 1, 2]
    op = _inputs(W, L, E, K, Ts, D, "random", torch.float64, seed=8)
    world = HierWorld(W, 3, D, K, E, torch.float64, L, capacity="exact")
    assert all(r[3].overlap is None for r in world.dispatch_rows(*op, overlap=True))
    world.close()
    world = HierWorld(W, 3, D, K, E, torch.float64, W)  # one node of 4: the flat rows
    assert all(r[3].overlap is None for r in world.dispatch_rows(*op, overlap=True))
    world.close()


def test_overlapped_hier_wait_times_out_naming_the_source():
    """A relay that never forwards (its HFROWS counts taken back here): the owner's wait gives up
    after the timeout and check() raises, naming the rows and the source -- no hang."""
    W, L, E, K, D = 4, 2, 8, 2, 4
    op = _inputs(W, L, E, K, [3, 3, 3, 3], D, "random", torch.float64, seed=9)
    world = HierWorld(W, 3, D, K, E, torch.float64, L, timeout_s=0.02)
    res = world.dispatch_rows(*op, overlap=True)
    h0 = res[0][3]
    far = [s for s in range(L, W) if int(h0.rows_from_W[s]) > 0]
    assert far, "rank 0 receives rows from the other node"
    H = world.buffers[0].hier.layout
    world.buffers[0]._region(H.off_hfrows, 8 * W).view(torch.int64).zero_()  # their rows "never arrived"
    h0.overlap.wait()
    with pytest.raises(ExchangeError, match=rf"rank 0 waited .* from rank {far[-1]}"):
        world.buffers[0].check()


def test_an_abandoned_overlapped_hier_dispatch_is_finished_by_the_next_op():
    """A forward abandoned after an overlapped dispatch (no GEMMs, no combine) leaves its rows'
    counts in HFROWS; the set's next op (here the next dispatch) finishes the plan first, so the
    counters hold only that op's rows, and its layer runs as usual."""
    W, L, E, K, D = 4, 2, 8, 2, 4
    world = HierWorld(W, 3, D, K, E, torch.float64, L)
    first = world.dispatch_rows(*_inputs(W, L, E, K, [3, 2, 3, 1], D, "random", torch.float64, seed=10),
                                overlap=True)
    assert all(not r[3].overlap.waited for r in first)
    second = world.dispatch_rows(*_inputs(W, L, E, K, [1, 3, 2, 3], D, "random", torch.float64, seed=11),
                                 overlap=True)
    for d, ((*_, h1), (*_, h2)) in enumerate(zip(first, second)):
        assert h1.overlap.waited and h1.overlap.joined, f"rank {d}: the abandoned plan was not finished"
        same = torch.arange(W) // L == d // L
        assert _counters(world.buffers[d], "hfrows") == torch.where(same, 0, h2.rows_from_W).tolist()
    parts = [torch.zeros_like(r[0]) for r in second]
    world.combine_rows(parts, [r[3] for r in second])
    for b in world.buffers:
        assert _counters(b, "hfrows") == [0] * W and _counters(b, "hrrows") == [0] * W
    world.check()


def test_overlapped_hier_forward_in_a_recompute_leaves_the_combine_whole():
    """Inside a backward (activation checkpointing's recompute) the phased forward sends nothing
    early: the plan is joined, and the combine sends every partial row -- the same outputs."""
    W, L, E, K, D, Fe = 4, 2, 8, 2, 8, 4
    f32 = torch.float32
    gen = torch.Generator().manual_seed(4)
    op = _inputs(W, L, E, K, [3, 2, 3, 3], D, "random", f32, seed=12)
    w13 = torch.randn(E // W, D, 2 * Fe, generator=gen, dtype=f32)
    w2 = torch.randn(E // W, Fe, D, generator=gen, dtype=f32)
    outs = {}
    for overlap in (False, True):
        world = HierWorld(W, 3, D, K, E, f32, L)
        res = world.dispatch_rows(*op, overlap=overlap)
        parts = {}

        class InBackward(torch.autograd.Function):  # runs every rank's fused forward the way a recompute does
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                for d, (r, s_, gn, hh) in enumerate(res):
                    parts[d] = fused_experts_rows(r, s_, s_, gn, w13, w2, hh.offsets_e, r.shape[0], backend="triton",
                                                  overlap=hh.overlap)
                return g

        InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
        if overlap:
            for d, (*_, hh) in enumerate(res):
                assert hh.overlap.waited and hh.overlap.joined and hh.overlap.partials_sent is None, d
        outs[overlap] = world.combine_rows([parts[d] for d in range(W)], [r[3] for r in res])
        world.check()
        world.close()
    _compare(outs[False], outs[True], "recompute")


def test_phased_forward_rounds_the_early_partial_rows_once_in_bf16():
    """bf16 rows (the suite's other worlds are fp32 / fp64, where the fp32 accumulator *is* the
    output): the phased forward's other-node partial rows are rounded from the fp32 accumulator by
    the kernel that sends them to the relays (``send_partials(part, acc)``), this node's by a cast
    before the wait -- the output tensor, every row (zeros past a source's count), and the combine
    equal the plain form's bit for bit."""
    W, L, E, K, D, Fe = 4, 2, 8, 3, 8, 4
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(21)
    w13 = torch.randn(E // W, D, 2 * Fe, generator=gen).to(bf)
    w2 = torch.randn(E // W, Fe, D, generator=gen).to(bf)
    op = _inputs(W, L, E, K, [3, 4, 2, 3], D, "random", bf, seed=22)
    got = {}
    for overlap in (False, True):
        world = HierWorld(W, 4, D, K, E, bf, L)
        res = world.dispatch_rows(*op, overlap=overlap)
        parts = [fused_experts_rows(r, s_, s_, g, w13, w2, h.offsets_e, r.shape[0], backend="triton",
                                    overlap=h.overlap) for r, s_, g, h in res]
        if overlap:
            assert all(h.overlap.partials_sent is not None for *_, h in res), "the early send did not run"
        outs = world.combine_rows(parts, [r[3] for r in res])
        world.check()
        got[overlap] = [p.clone() for p in parts] + [o.clone() for o in outs]
        world.close()
    assert all(p.dtype == bf for p in got[True])
    _compare(got[False], got[True], "bf16 partial rows and combine")


def test_send_partials_takes_an_accumulator_of_the_output_shape_only():
    """``send_partials(part, acc)`` with an accumulator of another shape or not contiguous raises,
    naming it, before anything is sent (the plan can still send once)."""
    W, L, E, K, D = 4, 2, 8, 2, 8
    f32 = torch.float32
    world = HierWorld(W, 3, D, K, E, f32, L)
    res = world.dispatch_rows(*_inputs(W, L, E, K, [3, 3, 2, 1], D, "random", f32, seed=17), overlap=True)
    ov = res[0][3].overlap
    part = torch.zeros(res[0][0].shape, dtype=f32)
    with pytest.raises(ValueError, match="acc_RD"):
        ov.send_partials(part, torch.zeros(part.shape[0] - 1, D))
    with pytest.raises(ValueError, match="contiguous"):  # (rows read with a stride of D)
        ov.send_partials(part, torch.zeros(D, part.shape[0]).t())
    assert ov.partials_sent is None
    for *_, h in res:
        h.overlap.finish()
    world.close()


@pytest.mark.parametrize("W,T_max,lo_src,hi_src,D", [
    (4, 5, 0, 2, 8),     # present sources first
    (4, 5, 2, 4, 8),     # present sources last
    (6, 7, 2, 4, 24),    # present in the middle; T_max not a multiple of the 16-row block, D of 256
])
def test_landed_rows_copy_copies_the_sent_rows_only(W, T_max, lo_src, hi_src, D):
    """The wait's copy out of RECV: every row a non-present source sent (below its count,
    including a source that sent all T_max rows and one that sent none), nothing of the present
    sources' rows and nothing past a source's count (NaN-poisoned, they must stay so)."""
    from tlx.comm import _landed_rows_copy_kernel

    R = W * T_max
    gen = torch.Generator().manual_seed(W * 10 + D)
    src = torch.randn(R, D, generator=gen)
    dst = torch.full((R, D), float("nan"))
    rows_from = torch.randint(0, T_max + 1, (W,), generator=gen)
    rows_from[0], rows_from[-1] = T_max, 0  # (a full source and an empty one)
    lo, hi = lo_src * T_max, hi_src * T_max
    bd = min(256, 1 << (D - 1).bit_length())
    _landed_rows_copy_kernel[(-(-R // 16), -(-D // 256))](src, dst, rows_from, lo, hi, R, T_max, D, src.stride(0),
                                                         dst.stride(0), BLOCK_R=16, BLOCK_D=bd)
    n = torch.arange(R)
    sent = ((n < lo) | (n >= hi)) & (n % T_max < rows_from[n // T_max])
    assert torch.equal(dst[sent], src[sent]), "a sent row was not copied"
    assert bool(dst[~sent].isnan().all()), "a row that was not sent (or a present one) was written"


def test_combine_after_the_phased_forward_needs_its_output_as_it_is():
    """The phased forward sent the other nodes' partial rows from its output: a combine given
    another tensor raises (naming why) before it launches anything."""
    W, L, E, K, D, Fe = 4, 2, 8, 2, 8, 4
    f32 = torch.float32
    gen = torch.Generator().manual_seed(6)
    world = HierWorld(W, 3, D, K, E, f32, L)
    res = world.dispatch_rows(*_inputs(W, L, E, K, [3, 3, 2, 1], D, "random", f32, seed=13), overlap=True)
    w13 = torch.randn(E // W, D, 2 * Fe, generator=gen, dtype=f32)
    w2 = torch.randn(E // W, Fe, D, generator=gen, dtype=f32)
    parts = [fused_experts_rows(r, s_, s_, g, w13, w2, h.offsets_e, r.shape[0], backend="triton", overlap=h.overlap)
             for r, s_, g, h in res]
    with pytest.raises(ValueError, match="as it is"):  # (at the op's first step, before any kernel)
        next(combine_rows_steps(world.buffers[0], parts[0].clone(), res[0][3]))
    world.combine_rows(parts, [r[3] for r in res])
    world.check()


def test_the_plan_holds_no_autograd_graph():
    """The plan (kept by the buffers until it is finished) holds no tensor of an autograd graph:
    it would keep that step's graph alive into the next."""
    W, L, E, K, D = 4, 2, 8, 2, 4
    world = HierWorld(W, 3, D, K, E, torch.float64, L)
    xs, idxs, gates = _inputs(W, L, E, K, [3, 3, 3, 3], D, "random", torch.float64, seed=14)
    gates = [g.requires_grad_(True) * 1.0 for g in gates]  # a router's gates: with an autograd graph
    res = world.dispatch_rows(xs, idxs, gates, overlap=True)
    for d, (*_, h) in enumerate(res):
        plan = h.overlap
        assert world.buffers[d]._overlap_plans["hier"] is plan
        held = [v for v in list(vars(plan).values()) + list(vars(plan._handle).values()) if isinstance(v, torch.Tensor)]
        assert held and not any(t.requires_grad or t.grad_fn is not None for t in held), f"rank {d}: a graph"
        assert plan._handle.overlap is None and plan._handle.gate_TK is None
    world.combine_rows([torch.zeros_like(r[0]) for r in res], [r[3] for r in res])
    world.check()


def test_overlapped_dispatch_generators_run_the_same_phases():
    """Every rank of an overlapped world takes the same number of phases (the emulated world's
    lockstep needs it): the plain op's four (the other-node rows' send after the last), then the
    relays' forward of those rows."""
    W, L, E, K, D = 4, 2, 8, 2, 4
    xs, idxs, gates = _inputs(W, L, E, K, [3, 1, 0, 2], D, "random", torch.float64, seed=15)
    for overlap, want in ((False, 4), (True, 5)):
        world = HierWorld(W, 3, D, K, E, torch.float64, L)
        gens = [dispatch_steps(b, x, i, g, "worst", rows=True, overlap=overlap)
                for b, x, i, g in zip(world.buffers, xs, idxs, gates)]
        phases = [0] * W
        live = list(range(W))
        while live:
            nxt = []
            for v in live:
                phases[v] += 1  # (the call that returns runs the last phase)
                try:
                    next(gens[v])
                    nxt.append(v)
                except StopIteration:
                    pass
            live = nxt
        assert phases == [want] * W, (overlap, phases)
        world.close()
