"""Interpreter-only cases (run by tests/test_fp8_cols_from_rows.py in a child with TRITON_INTERPRET=1):
``quantize_cols_from_rows``'s kernel (tlx/common/fp8_quant.py ``_quant_cols_from_rows_kernel``:
e4m3 decode, fp32 -> bf16 rounding and e4m3 encode emulated in integer arithmetic) against the
composition it replaces bit for bit (tests/fp8_cols_from_rows_cases.py), and the FP8 experts on the
kernel path fed a values placeholder equal to the composition of the single-purpose quantizers."""

import os

import pytest
import torch
import triton
import triton.language as tl

from fp8_cols_from_rows_cases import BF, CASES, HF, adversarial_x, check_cols_from_rows, dispatched_rows, raw_rows
from fp8_swiglu_cases import assert_experts_equal, previous_experts
from tlx.common.fp8_quant import decode_fp8
from tlx_dist.fp8 import quant as Q

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@triton.jit
def _decode_kernel(b_ptr, y_ptr, FMT: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(y_ptr + i, decode_fp8(tl.load(b_ptr + i), FMT, True))


@pytest.mark.parametrize("fmt,dt", [(0, torch.float8_e4m3fn), (1, torch.float8_e4m3fnuz)])
def test_decode_every_code(fmt, dt):
    # the integer decode (the interpreter's own turns e4m3fn's NaN into 480): all 256 codes, bit for
    # bit torch's (-0 stays -0, subnormals exact, NaN stays NaN)
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    y = torch.empty(256)
    _decode_kernel[(1,)](b, y, FMT=fmt)
    want = b.view(dt).float()
    assert torch.equal(y.isnan(), want.isnan()) and want.isnan().sum() == (2 if fmt == 0 else 1)
    ok = ~want.isnan()
    assert torch.equal(y[ok].view(torch.int32), want[ok].view(torch.int32))


@pytest.mark.parametrize("dtype", [BF, HF])
@pytest.mark.parametrize("counts,M,C,why", CASES, ids=[c[3].split(";")[0] for c in CASES])
def test_dispatched_rows(counts, M, C, why, dtype):
    # the packed dispatch rows' strided q and [Cb, M] scales, both offset dtypes
    x = adversarial_x(M, C, dtype, M + C)
    off = torch.tensor(counts).cumsum(0).to(torch.int64 if M % 2 else torch.int32)
    check_cols_from_rows(dispatched_rows(x), off, dtype, what=f"{why} {dtype}")


@pytest.mark.parametrize("fmt,pow2", [("e4m3fn", True), ("e4m3fnuz", False), ("e4m3fnuz", True)])
@pytest.mark.parametrize("dtype", [BF, HF])
def test_formats_and_pow2(fmt, pow2, dtype):
    x = adversarial_x(230, 300, dtype, 7)
    off = torch.tensor([150, 150, 211, 212], dtype=torch.int32)
    check_cols_from_rows(dispatched_rows(x), off, dtype, fmt, pow2, what=f"{fmt} pow2={pow2}")


@pytest.mark.parametrize("in_fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("dtype", [BF, HF, torch.float32])
def test_every_code_and_scale(in_fmt, dtype):
    # every finite e4m3 code (the decode, -0 and subnormals included) times scales from 2**-50 up:
    # products rounded at and between the dtype's ties, fp16's subnormals and its flush to zero
    rows = raw_rows(300, 264, 3, in_fmt)
    off = torch.tensor([100, 0, 180, 300], dtype=torch.int32)
    check_cols_from_rows(rows, off, dtype, what=f"{in_fmt} rows to {dtype}")


def test_contiguous_rows_and_guarded_offsets():
    # rows as quantize_rows makes them (q [M, C] contiguous, s strides (1, M)), and offsets past
    # the rows and decreasing: the tiles follow the device guard's safe offsets, as quantize_cols'
    x = adversarial_x(100, 128, BF, 11)
    rows = Q.quantize_rows(x, backend="triton")
    c = check_cols_from_rows(rows, torch.tensor([60, 30, 500], dtype=torch.int32), BF, what="guarded")
    assert c.offsets_E.tolist() == [60, 60, 100]


@pytest.mark.parametrize("counts,N,D,Fi", [([40, 0, 50, 7], 110, 256, 128), ([0, 130], 141, 200, 64)],
                         ids=["zero_expert_padding", "one_expert_straddling_tiles_D200"])
def test_experts_on_a_placeholder_equal_the_composition(counts, N, D, Fi):
    """backend="torch" on CPU: every quantization in the interpreted kernels, the GEMMs through
    torch._scaled_mm. The experts fed the dispatched rows and a values placeholder (dW13's tiles
    from the rows) give the output and every gradient of the single-purpose quantizers' composition
    on the dequantized rows, bit for bit."""
    g = torch.Generator().manual_seed(N)
    E = len(counts)
    rows = dispatched_rows(adversarial_x(N, D, BF, 5))
    x_hat = Q.dequantize_rows_rounded(rows, BF)
    w13 = (torch.randn(E, D, 2 * Fi, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, Fi, D, generator=g) / Fi ** 0.5).bfloat16()
    dy = torch.randn(N, D, generator=g).bfloat16()
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    from tlx_dist import fp8

    ts = [Q.values_placeholder(N, D, BF, "cpu").requires_grad_(True), w13.clone().requires_grad_(True),
          w2.clone().requires_grad_(True)]
    y = fp8.swiglu_experts_fp8(*ts, off, backend="torch", x_fp8=rows)
    got = [y.detach()] + list(torch.autograd.grad((y * dy).sum(), ts))
    assert_experts_equal(got, previous_experts(x_hat, w13, w2, dy, off, "torch", x_fp8=rows), str(counts))
