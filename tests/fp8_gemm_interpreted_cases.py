"""Interpreter-only cases (run by tests/test_fp8_gemm_interpreted.py with TRITON_INTERPRET=1): the
plain-Triton FP8 grouped GEMM (tlx/amd/fp8_grouped_gemm.py, tl.dot replaced by a broadcast-sum)
on CPU, forward / dX / dW in both formats, against float64 on the dequantized operands with
torch's FP8 path (``*_torch``, e4m3fn) or the float32 reference (e4m3fnuz, which torch._scaled_mm
does not take on CPU) as the same-dtype computation (STYLE.md 6, tlx_dist/testing.py).
Covers what the compiled kernels share: the tile walk, the expert-aligned token tiles of dW, the
scale indexing of both operands per k-step, K / NN tails, padding rows, zero-token experts."""

import os

import pytest
import torch

from tlx_dist import fp8
from tlx_dist.fp8 import quant as Q
from tlx_dist.fp8.amd_gemm import mm_fp8_portable, wgrad_fp8_portable
from tlx_dist.testing import assert_close_to_ref

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

# (counts, N, D, F, why)
CASES = [
    ([40, 0, 90, 7], 140, 200, 80, "zero-token expert; K = 200 and NN = 80 tails; 3 padding rows"),
    ([130], 130, 128, 48, "one expert takes all and spans two 32-row m-tiles x 128-row token tiles"),
    ([0, 0], 12, 128, 64, "no expert has rows: zeros everywhere"),
]


def _poisoned(fn):
    # torch.empty on CPU may hand back old values: fill the caching path with NaN first
    torch.empty(1 << 20).fill_(float("nan"))
    return fn()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("counts,N,D,F,why", CASES, ids=[c[4] for c in CASES])
def test_forms(counts, N, D, F, why, fmt):
    g = torch.Generator().manual_seed(N + D)
    x = torch.randn(N, D, generator=g)
    x[:, 3] = 1e4
    x = x.bfloat16()
    w = (torch.randn(len(counts), D, F, generator=g) / D ** 0.5).bfloat16()
    dy = torch.randn(N, F, generator=g).bfloat16()
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    wq = Q.quantize_weight(w, fmt=fmt)
    torch_path = fmt == "e4m3fn"
    for a, bq, bs, what in ((Q.quantize_rows(x, fmt=fmt), wq.q_EFD, wq.s_EFbDb, "fwd"),
                            (Q.quantize_rows(dy, fmt=fmt), wq.q_EDF, wq.s_EDbFb, "dX")):
        y = _poisoned(lambda: mm_fp8_portable(a, bq, bs, off, block=(32, 32)))
        ref64 = fp8.mm_fp8_ref(a, bq, bs, off, torch.float64)
        same = fp8.mm_fp8_torch(a, bq, bs, off) if torch_path else fp8.mm_fp8_ref(a, bq, bs, off).bfloat16()
        assert_close_to_ref(y, ref64, same, name=f"{what} {why}")
        assert (y[int(off[-1]):] == 0).all()
    xc, dyc = Q.quantize_cols(x, off, fmt=fmt), Q.quantize_cols(dy, off, fmt=fmt)
    dw = _poisoned(lambda: wgrad_fp8_portable(xc, dyc, block=(32, 32)))
    ref64 = fp8.wgrad_fp8_ref(xc, dyc, torch.float64)
    same = fp8.wgrad_fp8_torch(xc, dyc) if torch_path else fp8.wgrad_fp8_ref(xc, dyc).bfloat16()
    assert_close_to_ref(dw, ref64, same, name=f"dW {why}")
