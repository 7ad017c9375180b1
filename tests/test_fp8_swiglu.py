"""The SwiGLU fused with its FP8 row quantization (tlx_dist/fp8/swiglu.py) and the FP8 experts built
on it (tlx_dist/fp8/experts.py), on CPU: the references against float64 (bound in
tests/fp8_swiglu_cases.py), the fused experts against the unfused composition on the reference
backend (bit for bit: the same quantized operands and the same fp32 SwiGLU) and against float64
with the previous unfused path as the same-dtype computation (STYLE.md 6), partial gradients, the
FP8-dispatch input, custom-op checks, torch.compile(fullgraph=True), bad inputs; the Triton kernels
under the interpreter in a child process (tests/fp8_swiglu_interpreted_cases.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _interp import run_interpreted_suite
from fp8_swiglu_cases import adversarial_h, check_swiglu_bwd_quant, check_swiglu_quant
from tlx_dist import fp8
from tlx_dist.fp8 import swiglu as S
from tlx_dist.testing import assert_close_to_ref


# --- the references --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,F_", [(40, 128), (19, 200), (1, 48), (0, 64)], ids=["paired", "F_200", "one_row", "empty"])
def test_references_vs_float64(M, F_, dtype):
    h, dA = adversarial_h(M, F_, dtype, seed=M)
    check_swiglu_quant(S.swiglu_quant_ref, h, what="ref")
    check_swiglu_bwd_quant(S.swiglu_bwd_quant_ref, h, dA, what="ref")


def test_reference_backward_is_autograd_of_the_fp32_swiglu():
    # bit for bit what autograd gives through (silu(gate.float()) * up.float()).to(h.dtype), no cat
    h, dA = adversarial_h(33, 136, torch.bfloat16, seed=4)
    hh = h.clone().requires_grad_(True)
    g, u = hh.chunk(2, dim=-1)
    a = (F.silu(g.float()) * u.float()).to(h.dtype)
    (dh,) = torch.autograd.grad(a, [hh], dA)
    a_ref, _ = S.swiglu_quant_ref(h)
    dh_ref, _ = S.swiglu_bwd_quant_ref(h, dA)
    assert torch.equal(a.detach(), a_ref) and torch.equal(dh, dh_ref)


def test_cpu_tensors_take_the_reference():
    h, dA = adversarial_h(8, 128, torch.bfloat16)
    a, r = S.swiglu_quant(h)
    a2, r2 = S.swiglu_quant_ref(h)
    assert torch.equal(a, a2) and torch.equal(r.q_MC.view(torch.uint8), r2.q_MC.view(torch.uint8))
    dh, _ = S.swiglu_bwd_quant(h, dA)
    assert torch.equal(dh, S.swiglu_bwd_quant_ref(h, dA)[0])


def test_bad_inputs():
    h = torch.randn(4, 256).bfloat16()
    with pytest.raises(ValueError, match="h_M2F must be \\[M, 2F\\].*odd width 255"):
        S.swiglu_quant(h[:, :255])
    with pytest.raises(TypeError, match="h_M2F must be bfloat16, float16 or float32"):
        S.swiglu_quant(h.double())
    with pytest.raises(ValueError, match="h_M2F must be 2-D"):
        S.swiglu_quant(h[None])
    with pytest.raises(ValueError, match="fmt="):
        S.swiglu_quant(h, fmt="e5m2")
    with pytest.raises(ValueError, match=r"dA_MF must be \[M, F\] = \(4, 128\)"):
        S.swiglu_bwd_quant(h, torch.zeros(4, 256, dtype=h.dtype))
    with pytest.raises(TypeError, match="dA_MF .* must have h_M2F's dtype"):
        S.swiglu_bwd_quant(h, torch.zeros(4, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="backend="):
        S.swiglu_quant(h, backend="cuda")


# --- the fused experts --------------------------------------------------------------------------------

# (counts, N, D, F, why)
CASES = [
    ([40, 0, 50, 7], 110, 256, 64, "zero-token expert, 13 padding rows, a 7-row expert"),
    ([0, 64, 0], 64, 128, 200, "one expert takes every row; F = 200 (dh's tiles straddle gate and up)"),
    ([130, 126], 256, 208, 128, "experts straddling the 128-row wgrad tiles; D = 208 (partial k-group)"),
    ([1], 1, 128, 48, "a single row"),
    ([0, 0], 0, 128, 64, "no rows at all"),
]


def _data(counts, N, D, Fi, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(N, D, generator=g)
    if N > 2:
        x[:, 5 % D] = 1e4  # an outlier per row
        x[1, :128] = 0.0  # an all-zero tile
        x[2] *= 1e-20  # tiny scales
    w13 = torch.randn(E, D, 2 * Fi, generator=g) / D ** 0.5
    w2 = torch.randn(E, Fi, D, generator=g) / Fi ** 0.5
    dy = torch.randn(N, D, generator=g)
    off = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x.bfloat16(), w13.bfloat16(), w2.bfloat16(), dy.bfloat16(), off


def _unfused(x, w13, w2, off, backend, fp32_swiglu=True):
    """The composition the fused experts replace: two differentiable FP8 GEMMs with the SwiGLU between
    them in autograd (fp32 and one rounding, as the fused kernels; or the bf16 ``F.silu(gate) * up``
    of the previous path)."""
    h = fp8.grouped_mm_fp8(x, w13, off, backend=backend)
    g, u = h.chunk(2, dim=-1)
    a = (F.silu(g.float()) * u.float()).to(h.dtype) if fp32_swiglu else F.silu(g) * u
    return fp8.grouped_mm_fp8(a, w2, off, backend=backend)


def _run(fn, tensors, dy, dt=torch.bfloat16, wrt=(0, 1, 2)):
    ts = [t.detach().clone().to(dt).requires_grad_(i in wrt) for i, t in enumerate(tensors)]
    y = fn(*ts)
    grads = torch.autograd.grad((y.to(dt) * dy.to(dt)).sum(), [ts[i] for i in wrt]) if y.numel() else \
        [torch.zeros_like(ts[i]) for i in wrt]
    return [y.detach()] + list(grads)


@pytest.mark.parametrize("counts,N,D,Fi,why", CASES, ids=[c[4].split(";")[0] for c in CASES])
def test_fused_equals_unfused_on_the_reference_backend(counts, N, D, Fi, why):
    x, w13, w2, dy, off = _data(counts, N, D, Fi)
    ours = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="reference"), (x, w13, w2), dy)
    theirs = _run(lambda *t: _unfused(*t, off, "reference"), (x, w13, w2), dy)
    for n, o, t in zip(("y", "dx", "dw13", "dw2"), ours, theirs):
        assert o.dtype == t.dtype and torch.equal(o, t), f"{why}: {n}"
    assert (ours[0][sum(counts):] == 0).all() and (ours[1][sum(counts):] == 0).all()


SCALED_MM_CASES = [c for c in CASES if c[1] > 1 and c[2] % 16 == 0 and c[3] % 16 == 0]  # torch._scaled_mm's dims


@pytest.mark.parametrize("counts,N,D,Fi,why", SCALED_MM_CASES, ids=[c[4].split(";")[0] for c in SCALED_MM_CASES])
def test_fused_vs_float64_bounded_by_the_previous_path(counts, N, D, Fi, why):
    # STYLE.md 6 with the previous unfused path (bf16 silu(gate) * up, torch's FP8 GEMMs) as the
    # same-dtype computation: fusing the SwiGLU and its quantizations loses no accuracy.
    x, w13, w2, dy, off = _data(counts, N, D, Fi)
    ours = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="reference"), (x, w13, w2), dy)
    theirs = _run(lambda *t: _unfused(*t, off, "torch", fp32_swiglu=False), (x, w13, w2), dy)
    ref = _run(lambda *t: fp8.swiglu_experts_ref(*t, off), (x, w13, w2), dy, torch.float64)
    for n, o, t, r in zip(("y", "dx", "dw13", "dw2"), ours, theirs, ref):
        assert_close_to_ref(o, r, t, dtype=torch.bfloat16, name=f"{why}: {n}")


def test_partial_gradients_and_master_weight_dtype():
    # Only what is asked for is computed, and it equals the full backward's; fp32 master weights
    # get fp32 gradients (the activations stay bf16).
    x, w13, w2, dy, off = _data([40, 0, 50, 7], 110, 256, 64)
    fn = lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="reference")  # noqa: E731
    full = _run(fn, (x, w13, w2), dy)
    for wrt in ((2,), (0,), (1, 2)):
        part = _run(fn, (x, w13, w2), dy, wrt=wrt)
        for i, g in zip(wrt, part[1:]):
            assert torch.equal(g, full[1 + i]), wrt
    xs = x.clone().requires_grad_(True)
    a, b = w13.float().requires_grad_(True), w2.float().requires_grad_(True)
    y = fp8.swiglu_experts_fp8(xs, a, b, off, backend="reference")
    (y * dy).sum().backward()
    assert y.dtype == torch.bfloat16 and xs.grad.dtype == torch.bfloat16
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_fp8_dispatch_rows_are_read_and_x_still_gets_its_gradient():
    # x_fp8 (what an FP8 dispatch delivers) is what the gate/up GEMM reads; x_ND (its dequantized
    # rows) is what the weight gradient quantizes, and it receives dx.
    x, w13, w2, dy, off = _data([40, 0, 50, 7], 110, 256, 64)
    rows = fp8.quantize_rows(x)
    xd = fp8.dequantize_rows(rows, torch.float32).bfloat16()
    with_rows = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="reference", x_fp8=rows), (xd, w13, w2), dy)
    plain = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="reference"), (xd, w13, w2), dy)
    for o, t in zip(with_rows, plain):
        assert torch.equal(o, t)  # requantizing the dequantized rows gives the same rows
    other = fp8.quantize_rows(x * 2)  # different rows: the forward must read them
    y = fp8.swiglu_experts_fp8(xd, w13, w2, off, backend="reference", x_fp8=other)
    assert not torch.equal(y, plain[0])


def test_custom_ops_opcheck_and_compile():
    h, dA = adversarial_h(40, 128, torch.bfloat16)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")  # test_schema cannot compare fp8 on CPU
    torch.library.opcheck(torch.ops.tlx_dist.fp8_swiglu_quant, (h, "reference"), test_utils=utils)
    torch.library.opcheck(torch.ops.tlx_dist.fp8_swiglu_bwd_quant, (h, dA, "reference"), test_utils=utils)
    x, w13, w2, dy, off = _data([20, 0, 12], 40, 128, 64)
    q13, q2 = fp8.quantize_weight(w13), fp8.quantize_weight(w2)
    f = torch.compile(lambda *t: fp8.swiglu_experts_fp8(*t, off, w13_fp8=q13, w2_fp8=q2, backend="reference"),
                      fullgraph=True, backend="aot_eager")
    eager = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, w13_fp8=q13, w2_fp8=q2, backend="reference"),
                 (x, w13, w2), dy)
    compiled = _run(f, (x, w13, w2), dy)
    for n, o, t in zip(("y", "dx", "dw13", "dw2"), compiled, eager):
        assert torch.equal(o, t), n


def test_experts_bad_arguments():
    x, w13, w2, dy, off = _data([4, 4], 8, 128, 64)
    with pytest.raises(ValueError, match=r"w2_EFD must be \[E, F, D\]"):
        fp8.swiglu_experts_fp8(x, w13, w2.transpose(1, 2), off)
    with pytest.raises(ValueError, match=r"w13_EDF2 must be \[E, D, 2F\]"):
        fp8.swiglu_experts_fp8(x, w13[:, :, :127], w2, off)
    with pytest.raises(ValueError, match="w2_fp8 has shape .* but w2_EFD .*stale copy"):
        fp8.swiglu_experts_fp8(x, w13, w2, off, w2_fp8=fp8.quantize_weight(w13))
    with pytest.raises(TypeError, match="w2_fp8 must be an Fp8Weight"):
        fp8.swiglu_experts_fp8(x, w13, w2, off, w2_fp8=w2)
    with pytest.raises(ValueError, match="x_ND has D=64 columns but w_EDF expects D=128"):
        fp8.swiglu_experts_fp8(x[:, :64], w13, w2, off)
    with pytest.raises(ValueError, match="backend='tlx' needs a CUDA device"):
        fp8.swiglu_experts_fp8(x, w13, w2, off, backend="tlx")


# --- the kernels, interpreted ------------------------------------------------------------------------


def test_kernels_interpreted():
    """The Triton kernels against float64 and quantize_rows_ref (fp8_swiglu_interpreted_cases.py)."""
    pytest.importorskip("triton")
    run_interpreted_suite("fp8_swiglu_interpreted_cases.py")
