"""Interpreter-only cases (run by tests/test_fp8_swiglu.py in a child with TRITON_INTERPRET=1): the
fused SwiGLU + FP8 row quantization kernels (tlx/common/fp8_swiglu.py, FP8 encoding emulated)
against float64 and the row quantizer's reference (tests/fp8_swiglu_cases.py says the bound), and
the fused FP8 experts with every quantization in the interpreted kernels against the unfused path."""

import os

import pytest
import torch
import torch.nn.functional as F

from fp8_swiglu_cases import adversarial_h, check_swiglu_bwd_quant, check_swiglu_quant
from tlx_dist import fp8
from tlx_dist.fp8 import swiglu as S
from tlx_dist.testing import assert_close_to_ref

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _fwd(h, fmt, pow2):
    return S.swiglu_quant(h, fmt=fmt, pow2=pow2, backend="triton")


def _bwd(h, dA, fmt, pow2):
    return S.swiglu_bwd_quant(h, dA, fmt=fmt, pow2=pow2, backend="triton")


# (M, F, why)
SHAPES = [
    (70, 256, "F a multiple of 128: the backward's paired tiles; M not a multiple of the 32-row block"),
    (37, 200, "F = 200: a partial last group; the backward's tile 1 straddles the gate and up halves"),
    (5, 48, "F < 128: one partial group; 2F = 96 below a tile too"),
    (1, 136, "a single row; F = 136 (a multiple of 8, not of 128)"),
    (0, 128, "no rows: empty outputs, nothing launched"),
]


@pytest.mark.parametrize("M,F_,why", SHAPES, ids=[s[2].split(":")[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_e4m3fn(M, F_, why, dtype):
    h, dA = adversarial_h(M, F_, dtype, seed=M + F_)
    check_swiglu_quant(_fwd, h, what=why)
    check_swiglu_bwd_quant(_bwd, h, dA, what=why)


@pytest.mark.parametrize("fmt,pow2", [("e4m3fnuz", False), ("e4m3fn", True), ("e4m3fnuz", True)])
@pytest.mark.parametrize("M,F_", [(40, 128), (9, 72)])
def test_kernels_formats_and_pow2(fmt, pow2, M, F_):
    h, dA = adversarial_h(M, F_, torch.bfloat16, seed=3 * M + F_)
    check_swiglu_quant(_fwd, h, fmt, pow2, what=f"{fmt} pow2={pow2}")
    check_swiglu_bwd_quant(_bwd, h, dA, fmt, pow2, what=f"{fmt} pow2={pow2}")


def test_kernels_strided_inputs():
    # h a column slice of a wider buffer (row stride != 2F), dA likewise: the kernels read strides
    h, dA = adversarial_h(33, 128, torch.bfloat16, seed=1)
    hb = torch.zeros(33, 2 * 128 + 64, dtype=h.dtype)
    hb[:, :256] = h
    db = torch.zeros(33, 128 + 32, dtype=dA.dtype)
    db[:, :128] = dA
    check_swiglu_quant(_fwd, hb[:, :256], what="strided h")
    check_swiglu_bwd_quant(_bwd, hb[:, :256], db[:, :128], what="strided h and dA")


def _unfused(x, w13, w2, off, backend):
    # the composition the fused experts replace, with the same fp32 SwiGLU (one rounding)
    h = fp8.grouped_mm_fp8(x, w13, off, backend=backend)
    g, u = h.chunk(2, dim=-1)
    return fp8.grouped_mm_fp8((F.silu(g.float()) * u.float()).to(h.dtype), w2, off, backend=backend)


def test_fused_experts_with_interpreted_kernels():
    """backend="torch" on CPU: every quantization runs in the interpreted kernels (the SwiGLU ones
    included), the GEMMs through torch._scaled_mm. Against float64 with the unfused path on the same
    backend as the same-dtype computation (STYLE.md 6): the fused path loses nothing."""
    counts, N, D, Fi = [40, 0, 50, 7], 110, 256, 64
    g = torch.Generator().manual_seed(0)
    E = len(counts)
    x = torch.randn(N, D, generator=g).bfloat16()
    w13 = (torch.randn(E, D, 2 * Fi, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, Fi, D, generator=g) / Fi ** 0.5).bfloat16()
    dy = torch.randn(N, D, generator=g).bfloat16()
    off = torch.tensor(counts).cumsum(0).to(torch.int32)

    def run(fn, dt):
        xs, a, b = (t.to(dt).requires_grad_(True) for t in (x, w13, w2))
        y = fn(xs, a, b)
        return [y.detach()] + list(torch.autograd.grad((y * dy.to(dt)).sum(), [xs, a, b]))

    ours = run(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="torch"), torch.bfloat16)
    theirs = run(lambda *t: _unfused(*t, off, "torch"), torch.bfloat16)
    ref = run(lambda *t: fp8.swiglu_experts_ref(*t, off), torch.float64)
    for n, o, t, r in zip(("y", "dx", "dw13", "dw2"), ours, theirs, ref):
        assert_close_to_ref(o, r, t, dtype=torch.bfloat16, name=n)
    assert (ours[0][sum(counts):] == 0).all() and (ours[1][sum(counts):] == 0).all()
