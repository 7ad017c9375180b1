"""Interpreter-only cases (run by tests/test_local_combine.py in a child with TRITON_INTERPRET=1):
the fused single-rank combine kernels (tlx/common/combine.py) through LocalDispatcher against the
torch composition and float64 (tests/local_combine_cases.py says what is exact and what is bounded),
the dispatch's own backward, strided inputs, non-finite values, custom-op checks and
torch.compile(fullgraph=True)."""

import os

import pytest
import torch

from local_combine_cases import CASE_IDS, CASES, check_combine, check_dispatch_backward, make_case
from tlx_dist.comm import LocalDispatcher
from tlx_dist.comm.dispatcher import Dispatcher
from tlx_dist.comm.local_combine import combine_weighted_local, dispatch_backward_local, use_combine_kernels

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("T,K,E,D,routing,values,why", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_and_backward(T, K, E, D, routing, values, why, dtype):
    disp, h, y, gate, g = make_case(T, K, E, D, routing, values, dtype, seed=T + 7 * K + D)
    assert use_combine_kernels(y, gate)
    check_combine(lambda y_, h_, w_: disp.combine_weighted(y_, h_, w_), disp, h, y, gate, g, what=why)
    # ungated, K rows near half the max would overflow the k-sum: scaled by 1/K there
    g_N = (y.double() / K).to(dtype) if values == "huge" else y
    check_dispatch_backward(disp.dispatch_backward, disp, h, g_N)


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_dtypes(dtype, gate_dtype):
    # gates in a 16-bit dtype: the cast to y's dtype may round (fp16 gate, bf16 rows) or not; the
    # gate gradient comes back in the gate's dtype
    disp, h, y, gate, g = make_case(29, 4, 6, 136, "random", "signed", dtype, gate_dtype, seed=3)
    check_combine(disp.combine_weighted, disp, h, y, gate, g, what=f"gate {gate_dtype}")


def test_dispatch_autograd_backward_is_the_kernel():
    # replicate_rows' backward (the bf16 separate pipeline's dispatch) runs the same gather + k-sum
    disp, h, y, gate, g = make_case(31, 4, 8, 200, "random", "normal", torch.bfloat16, seed=5)
    x = torch.randn(31, 200).bfloat16().requires_grad_(True)
    idx = torch.randint(0, 8, (31, 4))
    recv, hh = disp.dispatch(x, idx)
    g_N = torch.randn_like(recv)
    (dx,) = torch.autograd.grad(recv, [x], g_N)
    check_dispatch_backward(lambda g_, h_: dx, disp, hh, g_N)


def test_strided_inputs():
    # y a column slice of a wider buffer (row stride != D); g with a row stride of 2D; the
    # all-ones gradient of .sum() (stride 0) goes through .contiguous()
    disp, h, y, gate, g = make_case(21, 3, 5, 96, "random", "normal", torch.bfloat16, seed=9)
    yb = torch.zeros(y.shape[0], 160, dtype=y.dtype)
    yb[:, :96] = y
    gb = torch.zeros(g.shape[0], 192, dtype=g.dtype)
    gb[:, :96] = g
    check_combine(disp.combine_weighted, disp, h, yb[:, :96], gate, gb[:, :96], what="strided")
    check_dispatch_backward(disp.dispatch_backward, disp, h, yb[:, :96])
    y1 = y.clone().requires_grad_(True)
    y2 = y.clone().requires_grad_(True)
    disp.combine_weighted(y1, h, gate).sum().backward()
    Dispatcher.combine_weighted(disp, y2, h, gate).sum().backward()
    assert torch.equal(y1.grad, y2.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_values_propagate(dtype):
    # a NaN / inf row reaches exactly the tokens that read it, as in torch (K = 2: bit for bit)
    disp, h, y, gate, g = make_case(10, 2, 4, 40, "random", "normal", dtype, seed=1)
    y[3, 5], y[7, :] = float("nan"), float("inf")
    check_combine(disp.combine_weighted, disp, h, y, gate, g, what="non-finite")


def test_fp32_rows_keep_the_torch_path():
    disp, h, y, gate, g = make_case(8, 2, 4, 16, "random", "normal", torch.float32)
    assert not use_combine_kernels(y, gate) and not use_combine_kernels(y.double())
    assert not use_combine_kernels(y.bfloat16(), gate.double())
    assert torch.equal(disp.combine_weighted(y, h, gate), Dispatcher.combine_weighted(disp, y, h, gate))


def test_opcheck():
    disp, h, y, gate, g = make_case(13, 3, 4, 40, "random", "signed", torch.bfloat16, seed=2)
    ops = torch.ops.tlx_dist
    yr = y.clone().requires_grad_(True)
    wr = gate.clone().requires_grad_(True)
    torch.library.opcheck(ops.local_combine_weighted, (yr, wr, h.order_S, h.inverse_S))
    torch.library.opcheck(ops.local_combine_weighted_backward, (g, y, gate, h.order_S))
    torch.library.opcheck(ops.local_gather_ksum, (y, h.inverse_S, 13, 3))


def test_compile_fullgraph():
    disp, h, y, gate, g = make_case(17, 4, 8, 72, "random", "signed", torch.bfloat16, seed=4)

    def f(y_, w_, order, inv):
        out = combine_weighted_local(y_, w_, order, inv)
        return out, dispatch_backward_local(y_.detach(), inv, 17, 4)

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    res = []
    for fn in (f, cf):
        y_ = y.clone().requires_grad_(True)
        w_ = gate.clone().requires_grad_(True)
        out, ks = fn(y_, w_, h.order_S, h.inverse_S)
        res.append((out, ks, *torch.autograd.grad(out, [y_, w_], g)))
    for name, a, b in zip(("out", "ksum", "g_y", "g_gate"), *res):
        assert torch.equal(a, b), name


def test_compile_fullgraph_dispatch_and_combine():
    # the whole single-rank round trip, kernels in the forward and in both backwards (the combine's
    # and replicate_rows'), traced in one graph
    disp = LocalDispatcher(8, validate=False)  # as MoELayer: no host-side id check in the graph
    x = torch.randn(19, 72).bfloat16()
    idx = torch.randint(0, 8, (19, 4))
    gate = torch.rand(19, 4)
    dy = torch.randn(19, 72).bfloat16()

    def f(x_, w_):
        recv, h = disp.dispatch(x_, idx)
        return disp.combine_weighted(recv * 3, h, w_)

    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        x_ = x.clone().requires_grad_(True)
        w_ = gate.clone().requires_grad_(True)
        out = fn(x_, w_)
        res.append((out, *torch.autograd.grad(out, [x_, w_], dy)))
    for name, a, b in zip(("out", "dx", "dgate"), *res):
        assert torch.equal(a, b), name


def test_eager_calls_equal_the_ops(monkeypatch):
    # eager calls run the ops' bodies directly (tlx_dist/grouped_gemm/eager.py): the same kernels,
    # the ops' outputs and gradients bit for bit
    from tlx_dist.grouped_gemm import eager

    disp, h, y, gate, g = make_case(29, 4, 6, 136, "random", "signed", torch.bfloat16, seed=8)
    assert use_combine_kernels(y, gate)

    def run():
        y_ = y.clone().requires_grad_(True)
        w_ = gate.clone().requires_grad_(True)
        out = combine_weighted_local(y_, w_, h.order_S, h.inverse_S)
        return (out, *torch.autograd.grad(out, [y_, w_], g), dispatch_backward_local(y, h.inverse_S, 29, 4))

    direct = run()
    with monkeypatch.context() as m:
        m.setattr(eager, "traced", lambda args, kwargs: True)  # every call through the registered op
        via_op = run()
    for name, a, b in zip(("out", "g_y", "g_gate", "ksum"), direct, via_op):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("T,K,E,routing", [
    (37, 4, 6, "random"), (64, 8, 64, "random"), (16, 5, 5, "all"),      # K = E: every expert each token
    (40, 2, 7, "one"),                                                  # one expert takes every slot
    (33, 3, 9, "skip"),                                                 # experts with no rows between
    (1, 1, 1, "random"), (300, 2, 3, "random"),                         # a one-expert model; several blocks
])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_dispatch_order_kernel_is_the_stable_sort(T, K, E, routing, idx_dtype):
    """LocalDispatcher's layout from the routing kernel (tlx.common.routing) equals torch's stable
    sort by expert (``sort_slots``, the path where the kernels do not run): order, offsets, counts,
    and so the dispatched rows, on random and adversarial routings."""
    from tlx_dist.comm.layout import sort_slots
    from tlx_dist.comm.local import _slots_kernel_runs, expert_order

    g = torch.Generator().manual_seed(T * 31 + E)
    if routing == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    elif routing == "all":
        idx = torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    elif routing == "one":
        idx = torch.full((T, K), E - 1)
    else:  # only even experts get rows
        idx = torch.stack([torch.randperm((E + 1) // 2, generator=g)[:K] * 2 for _ in range(T)])
    idx = idx.to(idx_dtype)
    assert _slots_kernel_runs(idx)
    order, offsets, counts = expert_order(idx, E)
    ref = sort_slots(idx, E)
    assert torch.equal(order, ref.order_S) and order.dtype == torch.int64
    assert torch.equal(counts, ref.counts_E) and counts.dtype == torch.int64
    assert torch.equal(offsets, torch.cumsum(ref.counts_E, 0).to(torch.int32)) and offsets.dtype == torch.int32
    x = torch.randn(T, 24, generator=g).to(torch.bfloat16)
    rows, h = LocalDispatcher(E).dispatch(x, idx)
    assert torch.equal(rows, x[ref.order_S // K]) and torch.equal(h.offsets_e, offsets)


def test_dispatch_order_under_tracing_takes_the_torch_ops():
    """Fake tensors and make_fx get the torch sort (a Triton launch cannot take them); the traced
    dispatch's order equals the eager kernel path's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from tlx_dist.comm.local import _slots_kernel_runs, expert_order

    idx = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(t))[:3] for t in range(20)])
    assert _slots_kernel_runs(idx)
    with FakeTensorMode() as mode:
        fidx = mode.from_tensor(idx)
        assert not _slots_kernel_runs(fidx)
        order, offsets, counts = expert_order(fidx, 6)
        assert order.shape == (60,) and offsets.dtype == torch.int32 and counts.shape == (6,)
    gm = make_fx(lambda i: expert_order(i, 6))(idx)
    want = expert_order(idx, 6)
    for a, b in zip(gm(idx), want):
        assert torch.equal(a, b)


def test_dispatch_order_kernel_makes_out_of_range_ids_padding_rows():
    """validate=False with ids outside [0, E) (never from the router): on the kernel path they are
    padding rows after every expert's rows, counted for no expert (as in the fused pipeline's layout);
    the in-range slots keep the stable order."""
    from tlx_dist.comm.local import expert_order

    idx = torch.tensor([[0, 5], [2, -1], [1, 0], [7, 2]])
    order, offsets, counts = expert_order(idx, 3)
    assert counts.tolist() == [2, 1, 2] and offsets.tolist() == [2, 3, 5]
    assert order.tolist() == [0, 5, 4, 2, 7, 1, 3, 6]  # experts 0, 1, 2 in slot order, then ids 5, -1, 7
