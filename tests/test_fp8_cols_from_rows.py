"""The weight gradient's column form of x made straight from the FP8 dispatch's rows
(tlx_dist/fp8/quant.py ``quantize_cols_from_rows``) and the dequantized rows it makes unnecessary
(``dispatch_fp8(dequantize=False)``'s values placeholder), on CPU: the reference against the
composition it replaces, bad inputs, the custom op (opcheck, fake shapes, torch.compile), the
placeholder refused wherever values would be read, and the experts and the FP8 layer giving the
same output and every gradient bit for bit with and without the dequantized rows (reference
backend); the kernel under the interpreter in a child process
(tests/fp8_cols_from_rows_interpreted_cases.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _interp import run_interpreted_suite
from _util import make_cfg
from fp8_cols_from_rows_cases import BF, HF, adversarial_x, assert_cols_equal, dispatched_rows, raw_rows
from fp8_swiglu_cases import assert_experts_equal
from test_fp8_quant_both import EXPERT_CASES
from tlx_dist import MoELayer, fp8
from tlx_dist.fp8 import quant as Q


def test_cpu_tensors_take_the_reference():
    # the definition: quantize_cols of the rows dequantized to the dtype (one rounding of q * s)
    for dtype, rows in ((BF, dispatched_rows(adversarial_x(230, 300, BF, 1))), (HF, raw_rows(230, 300, 2))):
        off = torch.tensor([150, 150, 211, 212])
        got = Q.quantize_cols_from_rows(rows, off, dtype=dtype, pow2=True)
        want = Q.quantize_cols(Q.dequantize_rows(rows, torch.float32).to(dtype), off, pow2=True)
        assert_cols_equal(got, want, str(dtype))
        assert torch.equal(Q.dequantize_rows(rows, torch.float32).to(dtype), Q.dequantize_rows_rounded(rows, dtype))


def test_bad_inputs():
    rows = Q.quantize_rows(torch.randn(8, 200).bfloat16())
    off = torch.tensor([8])
    f = Q.quantize_cols_from_rows
    with pytest.raises(TypeError, match="rows must be an Fp8Rows"):
        f(rows.q_MC, off, dtype=BF)
    with pytest.raises(ValueError, match=r"rows.q_MC must be a 2-D e4m3fn / e4m3fnuz"):
        f(Q.Fp8Rows(rows.q_MC.float(), rows.s_MCb), off, dtype=BF)
    with pytest.raises(ValueError, match=r"rows.s_MCb must be fp32 \[8, 2\]"):
        f(Q.Fp8Rows(rows.q_MC, rows.s_MCb[:, :1]), off, dtype=BF)
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32"):
        f(rows, off, dtype=torch.float64)
    with pytest.raises(ValueError, match="offsets_E must be a 1-D int32 / int64"):
        f(rows, torch.tensor([8.0]), dtype=BF)
    with pytest.raises(ValueError, match="E=0"):
        f(rows, torch.zeros(0, dtype=torch.int32), dtype=BF)
    with pytest.raises(ValueError, match="fmt="):
        f(rows, off, dtype=BF, fmt="e5m2")
    with pytest.raises(ValueError, match="backend="):
        f(rows, off, dtype=BF, backend="cuda")


def test_custom_op_opcheck_and_fake_shapes():
    from tlx_dist.fp8.api import _quant_cols_from_rows_op, _quant_cols_op

    rows = dispatched_rows(adversarial_x(140, 200, BF, 3))
    off = torch.tensor([3, 131], dtype=torch.int32)
    args = (rows.q_MC, rows.s_MCb.t(), off, BF, "reference")
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")  # test_schema cannot compare fp8 on CPU
    torch.library.opcheck(torch.ops.tlx_dist.fp8_quantize_cols_from_rows, args, test_utils=utils)
    got = _quant_cols_from_rows_op(*args)
    want = _quant_cols_op(Q.dequantize_rows_rounded(rows, BF), off, "reference")
    for o, w in zip(got, want):
        assert o.shape == w.shape and o.dtype == w.dtype and o.stride() == w.stride()
        assert torch.equal(o.view(torch.uint8) if o.dtype == torch.float8_e4m3fn else o,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)


# --- the values placeholder ------------------------------------------------------------------------


def _routing(T, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:T // 3] = torch.arange(K)  # a crowded expert
    return idx, torch.rand(T, K, generator=g).bfloat16()


def test_dispatch_without_dequantizing():
    # the same rows and handle; x_hat a zero-stride NaN placeholder of [N, D] that carries the
    # same gradient back to x_TD (dispatch_backward); nothing else changes
    from tlx_dist.comm import LocalDispatcher
    from tlx_dist.fp8.dispatch import dispatch_fp8

    disp = LocalDispatcher(5)
    x = adversarial_x(37, 200, BF, 4)
    idx, gate = _routing(37, 5, 2)
    got = {}
    for deq in (True, False):
        xs = x.clone().requires_grad_(True)
        x_hat, rows, h = dispatch_fp8(disp, xs, idx, gate, dequantize=deq)
        g = torch.randn(x_hat.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
        x_hat.backward(g)
        got[deq] = (x_hat, rows, h, xs.grad)
    (xh, r1, h1, g1), (ph, r0, h0, g0) = got[True], got[False]
    assert torch.equal(xh, Q.dequantize_rows_rounded(r1, BF))
    assert ph.shape == xh.shape == (74, 200) and ph.dtype == BF and ph.stride() == (0, 0) and ph.isnan().all()
    assert Q.is_values_placeholder(ph) and not Q.is_values_placeholder(xh)
    assert torch.equal(r0.q_MC.view(torch.uint8), r1.q_MC.view(torch.uint8)) and torch.equal(r0.s_MCb, r1.s_MCb)
    assert torch.equal(h0.offsets_e, h1.offsets_e)
    assert torch.equal(g0, g1) and g0.abs().sum() > 0
    with pytest.raises(TypeError, match="dequantize must be a bool"):
        dispatch_fp8(disp, x, idx, gate, dequantize=None)


def test_a_placeholder_is_refused_where_its_values_would_be_read():
    ph = Q.values_placeholder(16, 128, BF, "cpu")
    w13, w2 = torch.randn(2, 128, 128).bfloat16(), torch.randn(2, 64, 128).bfloat16()
    off = torch.tensor([10, 16])
    with pytest.raises(ValueError, match=r"x_ND is a values placeholder .*pass the rows it stands for as x_fp8="):
        fp8.swiglu_experts_fp8(ph, w13, w2, off)
    with pytest.raises(ValueError, match=r"x_ND is a values placeholder .*weight gradient quantizes its values"):
        fp8.grouped_mm_fp8(ph, w13, off, x_fp8=Q.quantize_rows(torch.randn(16, 128).bfloat16()))
    with pytest.raises(ValueError, match=r"dy_NF is a values placeholder"):
        fp8.grouped_mm_fp8_wgrad(torch.randn(16, 128).bfloat16(), ph, off)
    # an expanded row (strides (0, 1)) holds real values: not a placeholder
    assert not Q.is_values_placeholder(torch.randn(1, 128).expand(16, 128))


def _experts_data(counts, N, D, Fi, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    rows = dispatched_rows(adversarial_x(N, D, BF, seed + 1))
    w13 = (torch.randn(E, D, 2 * Fi, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, Fi, D, generator=g) / Fi ** 0.5).bfloat16()
    dy = torch.randn(N, D, generator=g).bfloat16()
    return rows, w13, w2, dy, torch.tensor(counts).cumsum(0).to(torch.int32)


def _experts(x_ND, rows, w13, w2, dy, off, backend, wrt=(0, 1, 2), compile=False):
    """``[y, dx, dw13, dw2]`` (the ones not in ``wrt``: None) under the loss ``sum(y * dy)``."""
    ts = [t.detach().clone() if i else t.detach() for i, t in enumerate((x_ND, w13, w2))]
    for i in wrt:
        ts[i].requires_grad_(True)
    fn = lambda *t: fp8.swiglu_experts_fp8(*t, off, backend=backend, x_fp8=rows)  # noqa: E731
    if compile:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y = fn(*ts)
    grads = torch.autograd.grad((y * dy).sum(), [ts[i] for i in wrt]) if wrt else ()
    out = [None, None, None]
    for i, gr in zip(wrt, grads):
        out[i] = gr
    return [y.detach()] + out



@pytest.mark.parametrize("counts,N,D,Fi,why", EXPERT_CASES, ids=[c[4].split(";")[0] for c in EXPERT_CASES])
def test_experts_equal_with_and_without_the_dequantized_rows(counts, N, D, Fi, why):
    # reference backend: given the dequantized rows it quantizes them (quantize_cols_ref); given the
    # placeholder it makes dW13's tiles from the rows (quantize_cols_from_rows_ref): the same bits
    rows, w13, w2, dy, off = _experts_data(counts, N, D, Fi)
    x_hat = Q.dequantize_rows_rounded(rows, BF)
    ph = Q.values_placeholder(N, D, BF, "cpu")
    assert_experts_equal(_experts(ph, rows, w13, w2, dy, off, "reference"),
                         _experts(x_hat, rows, w13, w2, dy, off, "reference"), why)


def test_experts_on_a_placeholder_partial_gradients_and_compile():
    # dW13 alone, dx alone and no gradient at all read only the rows; torch.compile (aot_eager,
    # fullgraph) traces the placeholder and the new op
    rows, w13, w2, dy, off = _experts_data([40, 0, 50, 7], 110, 256, 64)
    ph = Q.values_placeholder(110, 256, BF, "cpu")
    full = _experts(ph, rows, w13, w2, dy, off, "reference")
    for wrt in ((1,), (0,), ()):
        part = _experts(ph, rows, w13, w2, dy, off, "reference", wrt=wrt)
        assert torch.equal(part[0], full[0])
        for i in wrt:
            assert torch.equal(part[1 + i], full[1 + i]), wrt
    compiled = _experts(ph, rows, w13, w2, dy, off, "reference", compile=True)
    assert_experts_equal(compiled, full, "compiled")


def test_experts_on_the_torch_backend_make_the_tiles_from_the_rows(monkeypatch):
    # a kernel backend (torch._scaled_mm runs on CPU too; the quantizers take their references
    # here): dW13's tiles come from the rows even when the dequantized rows are given, and equal
    # the reference backend's tiles of the dequantized rows
    from tlx_dist.fp8 import api

    rows, w13, w2, dy, off = _experts_data([40, 0, 50, 7], 110, 256, 64)
    x_hat = Q.dequantize_rows_rounded(rows, BF)
    calls = []
    real = api.quantize_cols_from_rows
    monkeypatch.setattr(api, "quantize_cols_from_rows", lambda *a, **k: calls.append(k["backend"]) or real(*a, **k))
    on_hat = _experts(x_hat, rows, w13, w2, dy, off, "torch", wrt=(1,))
    on_ph = _experts(Q.values_placeholder(110, 256, BF, "cpu"), rows, w13, w2, dy, off, "torch", wrt=(1,))
    assert calls == [None, None]
    assert torch.equal(on_hat[2], on_ph[2]) and torch.equal(on_hat[0], on_ph[0])
    _experts(x_hat, rows, w13, w2, dy, off, "reference", wrt=(1,))
    assert calls == [None, None], "the reference backend quantizes the dequantized rows themselves"


# --- the layer -------------------------------------------------------------------------------------


def _force_dequantize(monkeypatch, value):
    """Make the FP8 layer's dispatch_fp8 calls take ``dequantize=value``; returns the values the
    layer asked for."""
    from tlx_dist import moe

    asked = []
    real = moe.dispatch_fp8

    def spy(*a, dequantize, **k):
        asked.append(dequantize)
        return real(*a, dequantize=dequantize if value is None else value, **k)

    monkeypatch.setattr(moe, "dispatch_fp8", spy)
    return asked


def _layer_step(layer, x):
    xi = x.clone().requires_grad_(True)
    out = layer(xi)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out.float() * g.float()).sum().backward()
    grads = [xi.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return [out.detach()] + grads


@pytest.mark.parametrize("dispatcher", ["local", "all_to_all"])
def test_layer_equal_with_and_without_the_dequantized_rows(dispatcher, monkeypatch):
    # the reference backend writes the dequantized rows (its oracle); the layer forced to skip them
    # gives the same output and every gradient (router, experts, shared experts, x) bit for bit
    from _train import one_rank_group

    cfg = make_cfg(dim=256, moe_inter_dim=64, num_experts=5, top_k=2, dtype="bfloat16", init_std=0.05,
                   num_shared_experts=1)
    x = adversarial_x(45, 256, BF, 9)
    with one_rank_group():
        torch.manual_seed(0)
        kw = dict(ep_group=dist.group.WORLD, dispatcher="all_to_all") if dispatcher == "all_to_all" else {}
        layer = MoELayer(cfg, precision="fp8", **kw)
        asked = _force_dequantize(monkeypatch, None)
        want = _layer_step(layer, x)
        assert asked == [True], "the reference backend keeps the dequantized rows"
        _force_dequantize(monkeypatch, False)
        got = _layer_step(layer, x)
    assert len(got) == len(want) > 5
    for i, (o, t) in enumerate(zip(got, want)):
        assert o.dtype == t.dtype and torch.equal(o, t), f"output / gradient {i} differs"


def test_layer_skips_the_dequantized_rows_on_a_kernel_backend(monkeypatch):
    # gemm_backend="torch" (a kernel backend; on CPU its quantizers take their references): the
    # layer dispatches without dequantizing, and equals the same layer made to dequantize
    cfg = make_cfg(dim=256, moe_inter_dim=64, num_experts=4, top_k=2, dtype="bfloat16", init_std=0.05)
    x = adversarial_x(40, 256, BF, 2)
    torch.manual_seed(0)
    layer = MoELayer(cfg, precision="fp8", gemm_backend="torch")
    asked = _force_dequantize(monkeypatch, None)
    got = _layer_step(layer, x)
    assert asked == [False]
    _force_dequantize(monkeypatch, True)
    want = _layer_step(layer, x)
    for i, (o, t) in enumerate(zip(got, want)):
        assert torch.equal(o, t), f"output / gradient {i} differs"


def test_kernel_interpreted():
    """The kernel bit for bit against the composition, and the experts on it (interpreted)."""
    pytest.importorskip("triton")
    run_interpreted_suite("fp8_cols_from_rows_interpreted_cases.py")
