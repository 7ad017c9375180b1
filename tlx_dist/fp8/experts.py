"""The routed experts of an MoE layer in FP8: gate/up GEMM -> SwiGLU -> down GEMM, differentiable.

Legend: N rows in expert-major order (what a dispatcher delivers), D hidden, F expert intermediate,
E local experts, ``offsets_E`` cumulative end row of each expert.

    h_N2F = grouped_mm_fp8(x_ND, w13_EDF2, offsets_E)      # x quantized 1 x 128 along D
    a_NF  = silu(h[:, :F]) * h[:, F:]                        # in x's dtype
    y_ND  = grouped_mm_fp8(a_NF, w2_EFD, offsets_E)        # a quantized 1 x 128 along F

Each GEMM quantizes its activation operand where it enters (the forward's rows along the
reduction dim; the backward's ``dy`` rows for dX and the expert-aligned 128-row column tiles of
``x`` and ``dy`` for dW, tlx_dist/fp8/api.py), and reads its weight's FP8 copy: pass ``w13_fp8`` /
``w2_fp8`` from an :class:`~tlx_dist.fp8.Fp8WeightCache` to quantize the weights once per optimizer
step. The master weights receive their gradients in their own dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .api import grouped_mm_fp8
from .quant import Fp8Rows, Fp8Weight
from .tlx_gemm import Fp8GemmConfig

__all__ = ["swiglu_experts_fp8", "swiglu_experts_ref"]


def swiglu_experts_fp8(x_ND: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor, *,
                       w13_fp8: Optional[Fp8Weight] = None, w2_fp8: Optional[Fp8Weight] = None,
                       backend: Optional[str] = None, config: Optional[Fp8GemmConfig] = None,
                       x_fp8: Optional[Fp8Rows] = None) -> torch.Tensor:
    """SwiGLU experts with both GEMMs (and their dgrad and wgrad) in FP8.

    Args:
        x_ND: ``[N, D]`` rows grouped by expert (bf16 / fp16; fp32 on the reference backend).
        w13_EDF2: ``[E, D, 2F]`` gate | up master weights; w2_EFD: ``[E, F, D]``.
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (rows past the last are padding).
        w13_fp8, w2_fp8: the weights' FP8 copies (quantized here when None).
        backend, config: as :func:`~tlx_dist.fp8.grouped_mm_fp8` (both GEMMs).
        x_fp8: ``x_ND``'s rows already quantized (an FP8 dispatch delivered them): the gate/up GEMM
            reads them instead of quantizing ``x_ND``.
    Returns:
        ``[N, D]`` in ``x_ND.dtype``; padding rows are zero.
    """
    if w13_EDF2.dim() != 3 or w13_EDF2.shape[2] % 2:
        raise ValueError(f"w13_EDF2 must be [E, D, 2F], got shape {tuple(w13_EDF2.shape)}")
    if w2_EFD.dim() != 3 or w2_EFD.shape[0] != w13_EDF2.shape[0] or 2 * w2_EFD.shape[1] != w13_EDF2.shape[2] \
            or w2_EFD.shape[2] != w13_EDF2.shape[1]:
        raise ValueError(f"w2_EFD must be [E, F, D] = {[w13_EDF2.shape[0], w13_EDF2.shape[2] // 2, w13_EDF2.shape[1]]}"
                         f" to match w13_EDF2 {tuple(w13_EDF2.shape)}, got {tuple(w2_EFD.shape)}")
    h = grouped_mm_fp8(x_ND, w13_EDF2, offsets_E, w_fp8=w13_fp8, backend=backend, config=config, x_fp8=x_fp8)
    gate, up = h.chunk(2, dim=-1)
    return grouped_mm_fp8(F.silu(gate) * up, w2_EFD, offsets_E, w_fp8=w2_fp8, backend=backend, config=config)


def swiglu_experts_ref(x_ND: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The unquantized experts in ``dtype`` (float64: the oracle of the FP8 experts). Differentiable;
    reads the offsets on the host. Returns ``[N, D]`` in ``dtype`` (padding rows zero)."""
    ends = offsets_E.tolist()
    y = x_ND.new_zeros(x_ND.shape[0], w2_EFD.shape[2], dtype=dtype)
    parts = []
    for e, hi in enumerate(ends):
        lo = ends[e - 1] if e else 0
        h = x_ND[lo:hi].to(dtype) @ w13_EDF2[e].to(dtype)
        gate, up = h.chunk(2, dim=-1)
        parts.append((F.silu(gate) * up) @ w2_EFD[e].to(dtype))
    n = ends[-1] if ends else 0
    return torch.cat(parts + [y[n:]]) if parts else y
