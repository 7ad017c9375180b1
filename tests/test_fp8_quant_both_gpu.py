"""Both FP8 quantizations of a tensor in one pass on the GPU (tier T3): ``quantize_both`` and the
SwiGLU kernels over the expert tile grid (compiled: hardware ``cvt.rn.satfinite`` e4m3 encode)
against ``quantize_rows_ref`` / ``quantize_cols_ref`` bit for bit, every output element written
(poisoned allocator), and the fused FP8 experts on the TLX GEMMs (sm_90) equal bit for bit to the
single-purpose quantizers' composition on an OLMoE-like layer.
Run: ``pytest -m gpu tests/test_fp8_quant_both_gpu.py``."""

from __future__ import annotations

import pytest
import torch

import tlx
from fp8_both_interpreted_cases import BOTH_CASES, SWIGLU_CASES, assert_both_equal, check_swiglu_both, rows_x
from fp8_swiglu_cases import adversarial_h, assert_experts_equal, fused_experts, previous_experts
from tlx_dist.fp8 import quant as Q

# Collected everywhere (so a CPU run proves the module imports and parametrizes), run only on a GPU.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
needs_tlx = pytest.mark.skipif(not (tlx.tlx_available() and tlx.gpu_arch() == "sm_90"),
                               reason="the TLX FP8 kernels need sm_90 with fbtriton")


def _poisoned(fn):
    # the caching allocator hands back the poisoned block: an element no program wrote shows as NaN
    torch.empty(1 << 26, dtype=torch.float32, device=DEV).fill_(float("nan"))
    return fn()


GPU_CASES = BOTH_CASES + [
    ([5000, 0, 3000, 1, 200], 8400, 2048, "OLMoE-like D: many tiles, a zero-token expert, 199 padding rows"),
]


@pytest.mark.parametrize("odt", [torch.int32, torch.int64])
@pytest.mark.parametrize("counts,M,C,why", GPU_CASES, ids=[c[3].split(";")[0] for c in GPU_CASES])
def test_quantize_both_vs_references(counts, M, C, why, odt):
    x = rows_x(M, C, M + C).to(DEV)
    off = torch.tensor(counts).cumsum(0).to(odt).to(DEV)
    r, c = _poisoned(lambda: Q.quantize_both(x, off, backend="triton"))
    assert_both_equal(r, c, x, off, what=why)


@pytest.mark.parametrize("fmt,pow2", [("e4m3fnuz", False), ("e4m3fn", True)])
def test_quantize_both_formats_and_pow2(fmt, pow2):
    x = rows_x(1000, 300, 5).to(DEV)
    off = torch.tensor([600, 600, 811, 812], dtype=torch.int32, device=DEV)
    r, c = _poisoned(lambda: Q.quantize_both(x, off, fmt=fmt, pow2=pow2, backend="triton"))
    assert_both_equal(r, c, x, off, fmt, pow2, what=f"{fmt} pow2={pow2}")


GPU_SWIGLU = SWIGLU_CASES + [
    ([5000, 0, 3000, 1, 200], 8400, 1024, torch.bfloat16, torch.int32, "OLMoE's F: many tiles, paired backward"),
]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("counts,M,F_,dtype,odt,why", GPU_SWIGLU, ids=[c[5].split(";")[0] for c in GPU_SWIGLU])
def test_swiglu_both_vs_references(counts, M, F_, dtype, odt, why, pow2):
    # the compiled exp may differ from the interpreter's in the last fp32 bit: the kept output is
    # bounded against float64, and both quantizations must equal the references' of that output
    h, dA = adversarial_h(M, F_, dtype, seed=M + F_, device=DEV)
    off = torch.tensor(counts).cumsum(0).to(odt).to(DEV)
    _poisoned(lambda: check_swiglu_both(h, dA, off, pow2=pow2, what=why))


@needs_tlx
def test_fused_experts_equal_the_single_purpose_quantizers_olmoe_like():
    from test_fp8_swiglu_gpu import _olmoe_like

    x, w13, w2, dy, off = _olmoe_like(N=4096, E=16, pad=48)
    assert_experts_equal(fused_experts(x, w13, w2, dy, off, "tlx"), previous_experts(x, w13, w2, dy, off, "tlx"),
                         "olmoe-like, tlx")
