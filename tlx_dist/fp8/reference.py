"""Reference FP8 grouped GEMMs on quantized operands: the CPU fallback and the test oracles.

Legend: N rows (expert-major), K reduction dim, NN output columns, E experts, G = 128; D, F the
weight's dims (``w_EDF``). Operands come from tlx_dist/fp8/quant.py.

    mm_fp8_ref(a: Fp8Rows [N, K], b_q [E, NN, K], b_s [E, NNb, Kb], offsets_E)  -> [N, NN]
    wgrad_fp8_ref(x: Fp8Cols over [N, D], dy: Fp8Cols over [N, F])            -> [E, D, F]

``*_ref`` dequantize (``q * s``) and multiply in ``dtype``: float64 is exact up to the final
summation's rounding (every product of two e4m3 values and two fp32 scales is exact in float64),
so ``dtype=torch.float64`` is the oracle ``ref64``; float32 is the CPU fallback.
``*_torch`` run torch's own FP8 tensor-core path on the same quantized operands -- one
``torch._scaled_mm`` per expert and 128-wide k-group with unit scales (fp32 out), the block scales
applied in fp32 after each -- the algorithm of the TLX kernels with cuBLAS doing the FP8 products:
the "torch in the same dtype" of the tolerance rule (tlx_dist/testing.py) and the FP8 path of GPUs
without the TLX kernels. Both read the offsets on the host (a sync).
"""

from __future__ import annotations

import torch

from ..grouped_gemm.reference import safe_offsets_ref
from .quant import GROUP, Fp8Cols, Fp8Rows, dequantize_cols, dequantize_rows

__all__ = ["mm_fp8_ref", "wgrad_fp8_ref", "mm_fp8_torch", "wgrad_fp8_torch", "dequantize_b"]


def _bounds(offsets_E: torch.Tensor, n_rows: int) -> list[tuple[int, int]]:
    ends = safe_offsets_ref(offsets_E, n_rows)[0].tolist()
    return list(zip([0] + ends[:-1], ends))


def dequantize_b(b_q: torch.Tensor, b_s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[E, NN, K]`` in ``dtype`` from a block-quantized B (``q * s`` per 128 x 128 block)."""
    E, NN, K = b_q.shape
    s = b_s.to(dtype).repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)[:, :NN, :K]
    return b_q.to(dtype) * s


def mm_fp8_ref(a: Fp8Rows, b_q: torch.Tensor, b_s: torch.Tensor, offsets_E: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y[rows of e] = dequant(a)[rows of e] @ dequant(b[e])^T`` in ``dtype`` (rows past the last
    offset are zero)."""
    N = a.q_MC.shape[0]
    x = dequantize_rows(a, dtype)
    w = dequantize_b(b_q, b_s, dtype)
    y = x.new_zeros(N, b_q.shape[1])
    for e, (lo, hi) in enumerate(_bounds(offsets_E, N)):
        if hi > lo:
            y[lo:hi] = x[lo:hi] @ w[e].t()
    return y


def wgrad_fp8_ref(x: Fp8Cols, dy: Fp8Cols, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dw[e] = dequant(x)[rows of e]^T @ dequant(dy)[rows of e]`` in ``dtype``."""
    xd, dyd = dequantize_cols(x, dtype), dequantize_cols(dy, dtype)
    E = x.offsets_E.shape[0]
    dw = xd.new_zeros(E, xd.shape[1], dyd.shape[1])
    for e, (lo, hi) in enumerate(_bounds(x.offsets_E, x.n_rows)):
        if hi > lo:
            dw[e] = xd[lo:hi].t() @ dyd[lo:hi]
    return dw


def _scaled_mm_f32(a_q: torch.Tensor, b_q_t: torch.Tensor) -> torch.Tensor:
    # a_q [m, k] row-major, b_q_t [k, n] column-major: torch._scaled_mm's layout; unit scales.
    one = torch.ones((), dtype=torch.float32, device=a_q.device)
    return torch._scaled_mm(a_q, b_q_t, one, one, out_dtype=torch.float32)


def mm_fp8_torch(a: Fp8Rows, b_q: torch.Tensor, b_s: torch.Tensor, offsets_E: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`mm_fp8_ref` through ``torch._scaled_mm`` (fp32 partials per 128-wide k-group, block
    scales applied in fp32, one rounding to ``out_dtype``). K must be a multiple of 16."""
    N, K = a.q_MC.shape
    E, NN, _ = b_q.shape
    y = torch.zeros(N, NN, dtype=torch.float32, device=a.q_MC.device)
    for e, (lo, hi) in enumerate(_bounds(offsets_E, N)):
        if hi <= lo:
            continue
        acc = y[lo:hi]
        for kb in range(-(-K // GROUP)):
            k0, k1 = kb * GROUP, min(K, (kb + 1) * GROUP)
            part = _scaled_mm_f32(a.q_MC[lo:hi, k0:k1].contiguous(), b_q[e, :, k0:k1].contiguous().t())
            sb = b_s[e, :, kb].repeat_interleave(GROUP)[:NN]
            acc += part * a.s_MCb[lo:hi, kb, None] * sb[None, :]
    return y.to(out_dtype)


def wgrad_fp8_torch(x: Fp8Cols, dy: Fp8Cols, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`wgrad_fp8_ref` through ``torch._scaled_mm``, one call per expert and 128-row tile."""
    D, F = x.q_CP.shape[0], dy.q_CP.shape[0]
    E = x.offsets_E.shape[0]
    dw = torch.zeros(E, D, F, dtype=torch.float32, device=x.q_CP.device)
    first = [0] + x.tile_cum_E1.tolist()[:-1]
    for e, (lo, hi) in enumerate(_bounds(x.offsets_E, x.n_rows)):
        for j in range(-(-(hi - lo) // GROUP)):
            t = first[e] + j
            cols = slice(GROUP * t, GROUP * (t + 1))
            part = _scaled_mm_f32(x.q_CP[:, cols].contiguous(), dy.q_CP[:, cols].contiguous().t())
            dw[e] += part * x.s_TC[t, :, None] * dy.s_TC[t, None, :]
    return dw.to(out_dtype)
