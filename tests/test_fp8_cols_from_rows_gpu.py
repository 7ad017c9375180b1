"""The weight gradient's column form straight from FP8 rows on the GPU (tier T3):
``quantize_cols_from_rows`` compiled (hardware e4m3 decode, fp32 product, one hardware rounding,
hardware e4m3 encode) against the composition it replaces bit for bit -- both the CPU reference and
the GPU's own ``quantize_cols(dequantize_rows_rounded(rows))`` -- every expert tile written
(poisoned allocator), on the packed dispatch rows' strided view; and the FP8 experts on the TLX
GEMMs (sm_90) fed a values placeholder equal bit for bit to the single-purpose quantizers'
composition on the dequantized rows.
Run: ``pytest -m gpu tests/test_fp8_cols_from_rows_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from fp8_cols_from_rows_cases import (BF, CASES, HF, adversarial_x, assert_cols_equal, check_cols_from_rows,
                                      dispatched_rows, raw_rows)
from fp8_swiglu_cases import assert_experts_equal, previous_experts
from test_fp8_quant_both_gpu import DEV, _poisoned, needs_tlx
from tlx_dist.fp8 import quant as Q

# Collected everywhere (so a CPU run proves the module imports and parametrizes), run only on a GPU.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


GPU_CASES = CASES + [
    ([5000, 0, 3000, 1, 200], 8400, 2048, "OLMoE-like D: many tiles, a zero-token expert, 199 padding rows"),
]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("odt", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [BF, HF])
@pytest.mark.parametrize("counts,M,C,why", GPU_CASES, ids=[c[3].split(";")[0] for c in GPU_CASES])
def test_dispatched_rows_vs_the_composition(counts, M, C, why, dtype, odt, pow2):
    rows = dispatched_rows(adversarial_x(M, C, dtype, M + C).to(DEV))
    off = torch.tensor(counts).cumsum(0).to(odt).to(DEV)
    got = _poisoned(lambda: check_cols_from_rows(rows, off, dtype, pow2=pow2, what=f"{why} {dtype}"))
    # the GPU's own composition: the dequant kernel, then the cols kernel
    on_gpu = Q.quantize_cols(Q.dequantize_rows_rounded(rows, dtype), off, pow2=pow2, backend="triton")
    assert_cols_equal(got, on_gpu, f"{why}: vs the GPU's dequantize + quantize_cols")


@pytest.mark.parametrize("in_fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("dtype", [BF, HF, torch.float32])
def test_every_code_and_scale(in_fmt, dtype):
    rows = raw_rows(3000, 520, 3, in_fmt, device=DEV)
    off = torch.tensor([1000, 0, 1800, 2900], dtype=torch.int32, device=DEV)
    _poisoned(lambda: check_cols_from_rows(rows, off, dtype, what=f"{in_fmt} rows to {dtype}"))


@pytest.mark.parametrize("fmt,pow2", [("e4m3fnuz", False), ("e4m3fn", True)])
def test_formats_and_pow2(fmt, pow2):
    rows = dispatched_rows(adversarial_x(1000, 300, BF, 5).to(DEV))
    off = torch.tensor([600, 600, 811, 812], dtype=torch.int32, device=DEV)
    _poisoned(lambda: check_cols_from_rows(rows, off, BF, fmt, pow2, what=f"{fmt} pow2={pow2}"))


@needs_tlx
def test_experts_on_a_placeholder_equal_the_composition_olmoe_like():
    from test_fp8_swiglu_gpu import _olmoe_like

    x, w13, w2, dy, off = _olmoe_like(N=4096, E=16, pad=48)
    rows = dispatched_rows(x)
    x_hat = Q.dequantize_rows_rounded(rows, x.dtype)
    from tlx_dist import fp8

    ts = [Q.values_placeholder(*x.shape, x.dtype, DEV).requires_grad_(True), w13.clone().requires_grad_(True),
          w2.clone().requires_grad_(True)]
    y = fp8.swiglu_experts_fp8(*ts, off, backend="tlx", x_fp8=rows)
    got = [y.detach()] + list(torch.autograd.grad((y * dy).sum(), ts))
    assert_experts_equal(got, previous_experts(x_hat, w13, w2, dy, off, "tlx", x_fp8=rows), "olmoe-like, tlx")
