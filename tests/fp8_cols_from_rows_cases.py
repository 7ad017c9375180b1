"""Cases of the weight gradient's column form made straight from FP8 rows
(tlx_dist/fp8/quant.py ``quantize_cols_from_rows``), shared by the interpreter cases
(tests/fp8_cols_from_rows_interpreted_cases.py) and the GPU tests (tests/test_fp8_cols_from_rows_gpu.py).
Not collected (no test_ prefix).

Oracle: the composition it replaces, ``quantize_cols_ref(dequantize_rows_rounded(rows, dtype))``
-- every value the fp32 product ``q * s`` rounded once to ``dtype``, then quantized in the
expert-aligned 128-row tiles -- bit for bit on every tile an expert owns (the padding rows' and the
host bound's slack tiles are not written, as ``quantize_cols`` leaves them)."""

from __future__ import annotations

import torch

from fp8_both_interpreted_cases import BOTH_CASES as CASES  # noqa: F401 (the tile-grid cases, shared)
from tlx_dist.fp8 import quant as Q
from tlx_dist.fp8.dispatch import pack_rows, unpack_rows

BF, HF = torch.bfloat16, torch.float16


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else t


def adversarial_x(M: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows whose quantization is adversarial for the dequantize -> requantize chain: random values
    with a 1e4 outlier per row (fp16: 6e4, near its top), an all-zero row (its scale is the floor),
    a row of 1e-30 (tiny values against the floor), a row of 1e-3 (tiny scales: products in the
    dtype's subnormal range for fp16), -0.0, values that go subnormal in e4m3, an all-zero 128 x 128
    block (a zero column tile)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g) * 3
    if M and C:
        x[:, 3 % C] = 6e4 if dtype == HF else 1e4
    if M > 5:
        x[1] = 0.0
        x[2] = 1e-30 * torch.randn(C, generator=g)
        x[3, ::2] = -0.0
        x[4, 1::2] = torch.rand(len(range(1, C, 2)), generator=g) * 2.0 ** -12
        x[5] = 1e-3 * torch.randn(C, generator=g)
    if C > 128:
        x[:128, 128:256] = 0.0
    return x.to(dtype)


def dispatched_rows(x: torch.Tensor, fmt: str = "e4m3fn") -> Q.Fp8Rows:
    """``quantize_rows_ref(x)`` as the FP8 dispatch's receiver sees it: ``q`` a strided view of the
    packed rows (row stride P elements of x's dtype, not C), ``s`` in ``[Cb, M]`` storage."""
    r = Q.quantize_rows_ref(x.cpu(), fmt)
    if fmt != "e4m3fn":  # the packed rows carry e4m3fn; the other format keeps its own layout
        return Q.Fp8Rows(r.q_MC.to(x.device), r.s_MCb.t().contiguous().t().to(x.device))
    return unpack_rows(pack_rows(r, x.dtype).to(x.device), x.shape[1])


def raw_rows(M: int, C: int, seed: int, fmt: str = "e4m3fn", top_scale: float = 100.0,
             device="cpu") -> Q.Fp8Rows:
    """Rows of arbitrary finite e4m3 bit patterns (every code but NaN: subnormals, +-0, +-max) with
    scales from 2**-50 to ``top_scale`` (fp16: products up to 448 * 100, below its top), some powers
    of two: the decode and the rounding of products at and between the dtype's ties."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (M, C), generator=g, dtype=torch.uint8)
    nan = (b & 0x7F) == 0x7F if fmt == "e4m3fn" else b == 0x80
    b = torch.where(nan, b ^ 1, b)
    Cb = -(-C // 128)
    s = torch.exp2(torch.rand(Cb, M, generator=g) * (50 + torch.log2(torch.tensor(top_scale))) - 50)
    if M and Cb:
        s[0, ::3] = torch.exp2(torch.randint(-20, 4, (len(range(0, M, 3)),), generator=g).float())
    return Q.Fp8Rows(b.view(Q.FORMATS[fmt][0]).to(device), s.to(device).t())


def assert_cols_equal(c: Q.Fp8Cols, want: Q.Fp8Cols, what: str = "") -> None:
    """``c`` equals ``want`` on every expert tile, with the same tile grid (compared on the CPU)."""
    assert c.q_CP.shape == want.q_CP.shape and c.q_CP.dtype == want.q_CP.dtype, what
    assert c.s_TC.shape == want.s_TC.shape and c.s_TC.dtype == torch.float32, what
    assert torch.equal(c.tile_cum_E1.cpu(), want.tile_cum_E1.cpu()), f"{what}: tile grid"
    assert torch.equal(c.offsets_E.cpu(), want.offsets_E.cpu()) and c.n_rows == want.n_rows, what
    T = int(want.tile_cum_E1[-2])
    assert torch.equal(_bits(c.q_CP[:, :128 * T].cpu()), _bits(want.q_CP[:, :128 * T].cpu())), f"{what}: column codes"
    assert torch.equal(c.s_TC[:T].cpu(), want.s_TC[:T].cpu()), f"{what}: column scales"


def check_cols_from_rows(rows: Q.Fp8Rows, off: torch.Tensor, dtype: torch.dtype, fmt: str = "e4m3fn",
                         pow2: bool = False, what: str = "") -> Q.Fp8Cols:
    """The kernel (``backend="triton"``) against the composition on the CPU, bit for bit; returns
    the kernel's result."""
    got = Q.quantize_cols_from_rows(rows, off, dtype=dtype, fmt=fmt, pow2=pow2, backend="triton")
    cpu = Q.Fp8Rows(rows.q_MC.cpu(), rows.s_MCb.cpu())
    want = Q.quantize_cols_ref(Q.dequantize_rows_rounded(cpu, dtype), off.cpu(), fmt, pow2)
    assert_cols_equal(got, want, what)
    return got
