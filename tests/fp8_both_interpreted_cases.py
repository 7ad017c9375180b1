"""Interpreter-only cases (run by tests/test_fp8_quant_both.py in a child with TRITON_INTERPRET=1):
the kernels that quantize a tensor both ways in one pass -- ``quantize_both`` (tlx/common/fp8_quant.py)
and the SwiGLU kernels over the expert-aligned tile grid (tlx/common/fp8_swiglu.py) -- against
``quantize_rows_ref`` / ``quantize_cols_ref`` bit for bit (FP8 encoding emulated), and the FP8
experts built on them against the single-purpose quantizers' composition, bit for bit."""

import os

import pytest
import torch

from fp8_swiglu_cases import (adversarial_h, assert_experts_equal, check_swiglu_bwd_quant, check_swiglu_quant,
                              fused_experts, previous_experts)
from tlx_dist.fp8 import quant as Q
from tlx_dist.fp8 import swiglu as S

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else t


def rows_x(M, C, seed, dtype=torch.bfloat16):
    """Random rows with a 1e4 outlier per row; all-zero groups both ways (a zero row, a zero column,
    a zero 128 x 128 block); tiny values both ways (a row and a column of 1e-30); -0.0; values that
    go subnormal in e4m3 after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g) * 3
    if M and C:
        x[:, 3 % C] = 1e4
        x[:, 7 % C] *= 1e-30
        x[:, -1] = 0.0
    if M > 4:
        x[1] = 0.0
        x[2] = 1e-30 * torch.randn(C, generator=g)
        x[3, ::2] = -0.0
        x[4, 1::2] = torch.rand(len(range(1, C, 2)), generator=g) * 2.0 ** -12
    if C > 128:
        x[:128, 128:256] = 0.0
    return x.to(dtype)


def assert_both_equal(r, c, x, off, fmt="e4m3fn", pow2=False, what=""):
    """``(r, c)`` equal ``quantize_rows_ref(x)`` (every row) and ``quantize_cols_ref(x, off)`` (every
    expert tile; the padding and slack tiles are not written, as quantize_cols leaves them). Compared
    on the CPU, whatever the device."""
    r = Q.Fp8Rows(r.q_MC.cpu(), r.s_MCb.cpu())
    c = Q.Fp8Cols(c.q_CP.cpu(), c.s_TC.cpu(), c.tile_cum_E1.cpu(), c.offsets_E.cpu(), c.n_rows)
    x, off = x.cpu(), off.cpu()
    rr, cr = Q.quantize_rows_ref(x, fmt, pow2), Q.quantize_cols_ref(x, off, fmt, pow2)
    assert r.q_MC.shape == rr.q_MC.shape and r.q_MC.dtype == rr.q_MC.dtype, what
    assert torch.equal(_bits(r.q_MC), _bits(rr.q_MC)), f"{what}: row codes"
    assert torch.equal(r.s_MCb, rr.s_MCb) and r.s_MCb.t().is_contiguous(), f"{what}: row scales"
    assert c.q_CP.shape == cr.q_CP.shape and c.s_TC.shape == cr.s_TC.shape, what
    assert torch.equal(c.tile_cum_E1, cr.tile_cum_E1) and torch.equal(c.offsets_E, cr.offsets_E), what
    assert c.n_rows == cr.n_rows, what
    T = int(cr.tile_cum_E1[-2])
    assert torch.equal(_bits(c.q_CP[:, :128 * T]), _bits(cr.q_CP[:, :128 * T])), f"{what}: column codes"
    assert torch.equal(c.s_TC[:T], cr.s_TC[:T]), f"{what}: column scales"


# (counts, M, C, why)
BOTH_CASES = [
    ([150, 0, 61, 1], 230, 300, "zero-token expert; a 1-row expert; 18 padding rows; C = 300 (partial group)"),
    ([0, 200, 0], 200, 128, "one expert takes every row (a full tile + 72 rows)"),
    ([128, 128], 300, 136, "tile-aligned experts; 44 padding rows past the last offset"),
    ([0, 0], 9, 64, "every expert empty: only padding rows, C < 128"),
    ([40], 40, 72, "one expert, fewer rows than a tile"),
    ([1], 1, 200, "a single row"),
    ([0, 0, 0], 0, 128, "no rows at all"),
]


@pytest.mark.parametrize("counts,M,C,why", BOTH_CASES, ids=[c[3].split(";")[0] for c in BOTH_CASES])
def test_quantize_both(counts, M, C, why):
    x = rows_x(M, C, M + C)
    off = torch.tensor(counts).cumsum(0).to(torch.int64 if M % 2 else torch.int32)  # both offset dtypes
    r, c = Q.quantize_both(x, off, backend="triton")
    assert_both_equal(r, c, x, off, what=why)


@pytest.mark.parametrize("fmt,pow2", [("e4m3fnuz", False), ("e4m3fn", True), ("e4m3fnuz", True)])
def test_quantize_both_formats_and_pow2(fmt, pow2):
    x = rows_x(230, 200, 7)
    off = torch.tensor([150, 150, 211, 212], dtype=torch.int32)
    r, c = Q.quantize_both(x, off, fmt=fmt, pow2=pow2, backend="triton")
    assert_both_equal(r, c, x, off, fmt, pow2, what=f"{fmt} pow2={pow2}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_both_input_dtypes_and_strides(dtype):
    # fp16 / fp32 rows, and rows that are a column slice of a wider buffer (row stride != C)
    x = rows_x(140, 200, 3, dtype)
    buf = torch.zeros(140, 264, dtype=dtype)
    buf[:, :200] = x
    off = torch.tensor([3, 131], dtype=torch.int64)
    r, c = Q.quantize_both(buf[:, :200], off, backend="triton")
    assert_both_equal(r, c, x, off, what=str(dtype))


def test_quantize_both_guarded_offsets():
    # offsets past the rows and decreasing: both forms follow the device guard's safe offsets, as
    # quantize_cols does (the flag it raises is the guard's business, tests/test_offsets_guard*)
    x = rows_x(100, 128, 11)
    off = torch.tensor([60, 30, 500], dtype=torch.int32)
    r, c = Q.quantize_both(x, off, backend="triton")
    assert c.offsets_E.tolist() == [60, 60, 100]
    assert_both_equal(r, c, x, off, what="guarded")


def check_swiglu_both(h, dA, off, fmt="e4m3fn", pow2=False, backend="triton", what=""):
    """The tile-grid SwiGLU kernels: the kept output within the float64 bound and equal to the plain
    kernels' (the same fp32 math), both quantizations equal to the references' of it bit for bit,
    and the same quantizations when the output is not kept."""
    kw = dict(fmt=fmt, pow2=pow2, backend=backend)
    a, r, c = S.swiglu_quant_both(h, off, keep_a=True, **kw)
    check_swiglu_quant(lambda *_: (a, r), h, fmt, pow2, what=f"{what} fwd")
    assert torch.equal(a, S.swiglu_quant(h, **kw)[0]), f"{what}: a differs from swiglu_quant's"
    assert_both_equal(r, c, a, off, fmt, pow2, what=f"{what} fwd")
    none, r2, c2 = S.swiglu_quant_both(h, off, **kw)
    assert none is None
    assert_both_equal(r2, c2, a, off, fmt, pow2, what=f"{what} fwd, a not kept")
    dh, r, c = S.swiglu_bwd_quant_both(h, dA, off, keep_dh=True, **kw)
    check_swiglu_bwd_quant(lambda *_: (dh, r), h, dA, fmt, pow2, what=f"{what} bwd")
    assert torch.equal(dh, S.swiglu_bwd_quant(h, dA, **kw)[0]), f"{what}: dh differs from swiglu_bwd_quant's"
    assert_both_equal(r, c, dh, off, fmt, pow2, what=f"{what} bwd")
    none, r2, c2 = S.swiglu_bwd_quant_both(h, dA, off, **kw)
    assert none is None
    assert_both_equal(r2, c2, dh, off, fmt, pow2, what=f"{what} bwd, dh not kept")


BF, HF, I32, I64 = torch.bfloat16, torch.float16, torch.int32, torch.int64
# (counts, M, F, h's dtype, the offsets' dtype, why)
SWIGLU_CASES = [
    ([40, 0, 50, 7], 110, 256, BF, I32, "zero-token expert; 13 padding rows; paired backward tiles"),
    ([0, 200, 0], 200, 200, HF, I64, "one expert takes every row; F = 200: backward tiles straddle gate and up"),
    ([130, 126], 270, 128, BF, I64, "experts straddling the 128-row tiles; 14 padding rows"),
    ([0, 0], 9, 48, HF, I32, "only padding rows; F < 128"),
    ([1], 1, 136, BF, I32, "a single row; F = 136"),
    ([0, 0], 0, 128, HF, I64, "no rows"),
]


@pytest.mark.parametrize("counts,M,F_,dtype,odt,why", SWIGLU_CASES, ids=[c[5].split(";")[0] for c in SWIGLU_CASES])
def test_swiglu_both(counts, M, F_, dtype, odt, why):
    h, dA = adversarial_h(M, F_, dtype, seed=M + F_)
    check_swiglu_both(h, dA, torch.tensor(counts).cumsum(0).to(odt), what=why)


@pytest.mark.parametrize("fmt,pow2", [("e4m3fnuz", False), ("e4m3fn", True)])
def test_swiglu_both_formats_and_pow2(fmt, pow2):
    h, dA = adversarial_h(140, 128, torch.bfloat16, seed=2)
    check_swiglu_both(h, dA, torch.tensor([3, 131], dtype=torch.int32), fmt, pow2, what=f"{fmt} pow2={pow2}")


def test_swiglu_both_strided_inputs():
    # h and dA column slices of wider buffers (row strides != 2F, F): the kernels read strides
    h, dA = adversarial_h(140, 128, torch.bfloat16, seed=1)
    hb = torch.zeros(140, 2 * 128 + 64, dtype=h.dtype)
    hb[:, :256] = h
    db = torch.zeros(140, 128 + 32, dtype=dA.dtype)
    db[:, :128] = dA
    check_swiglu_both(hb[:, :256], db[:, :128], torch.tensor([3, 131], dtype=torch.int32), what="strided")


def _experts_data(counts, N, D, Fi, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = rows_x(N, D, seed + 1)
    w13 = (torch.randn(E, D, 2 * Fi, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, Fi, D, generator=g) / Fi ** 0.5).bfloat16()
    dy = torch.randn(N, D, generator=g).bfloat16()
    return x, w13, w2, dy, torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts,N,D,Fi", [([40, 0, 50, 7], 110, 128, 128), ([0, 130], 141, 128, 64)],
                         ids=["zero_expert_padding", "one_expert_straddling_tiles"])
def test_experts_equal_the_single_purpose_quantizers(counts, N, D, Fi):
    """backend="torch" on CPU: every quantization in the interpreted kernels, the GEMMs through
    torch._scaled_mm; the fused quantizations change no bit of the output or of any gradient."""
    x, w13, w2, dy, off = _experts_data(counts, N, D, Fi)
    assert_experts_equal(fused_experts(x, w13, w2, dy, off, "torch"), previous_experts(x, w13, w2, dy, off, "torch"),
                         str(counts))


def test_experts_eager_calls_equal_the_ops(monkeypatch):
    """Eager calls run the ops' bodies directly (tlx_dist/grouped_gemm/eager.py): with the
    interpreted quantization kernels, the output and every gradient equal the ops' bit for bit."""
    from tlx_dist.grouped_gemm import eager

    x, w13, w2, dy, off = _experts_data([40, 0, 50, 7], 110, 128, 64, seed=3)
    direct = fused_experts(x, w13, w2, dy, off, "torch")
    with monkeypatch.context() as m:
        m.setattr(eager, "traced", lambda args, kwargs: True)  # every call through the registered op
        via_op = fused_experts(x, w13, w2, dy, off, "torch")
    assert_experts_equal(direct, via_op, "eager vs op")
