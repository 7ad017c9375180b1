"""The routed experts of an MoE layer in FP8: gate/up GEMM -> SwiGLU -> down GEMM, differentiable.

Legend: N rows in expert-major order (what a dispatcher delivers), D hidden, F expert intermediate,
E local experts, ``offsets_E`` cumulative end row of each expert.

Forward (the SwiGLU fused with the down GEMM's input quantization, tlx_dist/fp8/swiglu.py; every
tensor read in two forms is quantized both ways in one pass, tlx_dist/fp8/quant.py ``quantize_both``):

    x_fp8, x_cols = quant_both(x_ND)                       # rows 1 x 128 along D + 128-row expert tiles
    (the dispatched rows x_fp8 given: x_cols = quant_cols_from_rows(x_fp8), x_ND's values unread)
    h_N2F        = mm(x_fp8, w13)
    a_fp8, a_cols = swiglu_quant_both(h_N2F)               # a = silu(gate) * up, fp32 math, one rounding
    y_ND         = mm(a_fp8, w2)

Backward (the SwiGLU's gradient fused with both quantizations of dh; no cat):

    dy_fp8, dy_cols = quant_both(dy)
    dA_NF        = mm(dy_fp8, w2 in its dX layout)
    dW2          = wgrad(a_cols, dy_cols)
    dh_fp8, dh_cols = swiglu_bwd_quant_both(h_N2F, dA_NF)  # d gate | d up, fp32 math, one rounding each
    dx_ND        = mm(dh_fp8, w13 in its dX layout)
    dW13         = wgrad(x_cols, dh_cols)

Saved for the backward: ``h`` and the column forms of ``x`` and ``a`` (FP8: about half of their
bf16 bytes; neither ``x`` nor ``a`` is kept, and ``a`` / ``dh`` are never stored in bf16). A gradient
that is not asked for (or a call outside autograd) skips the column forms it would read. Every step
is a custom op (tlx_dist/fp8/api.py, swiglu.py), so torch.compile and CUDA graphs see opaque ops
with fake shapes; nothing syncs the host. The weights are read through their FP8 copies: pass
``w13_fp8`` / ``w2_fp8`` from an :class:`~tlx_dist.fp8.Fp8WeightCache` to quantize them once per
optimizer step. The master weights receive their gradients in their own dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .api import (_OUT, _check_w_fp8, _config_json, _mm_op, _quant_backend, _quant_both_op, _quant_cols_from_rows_op,
                  _quant_cols_op, _quant_rows_op, _resolve, _wgrad_op, select_fp8_backend)
from .quant import Fp8Rows, Fp8Weight, is_values_placeholder, quantize_weight
from .swiglu import _swiglu_bwd_quant_both_op, _swiglu_bwd_quant_op, _swiglu_quant_both_op, _swiglu_quant_op
from .tlx_gemm import Fp8GemmConfig

__all__ = ["swiglu_experts_fp8", "swiglu_experts_ref"]


def _wgrad(x_cols, dy_cols, tile_cum, safe, n_rows, w_dtype, backend, config):
    """dW ``[E, D, F]`` in the master weight's dtype from the column quantizations ``(q [D, P],
    s [T, D])`` of ``x`` and ``(q [F, P], s [T, F])`` of ``dy`` over the same offsets."""
    out = w_dtype if w_dtype in _OUT + (torch.float32,) else torch.float32
    return _wgrad_op(*x_cols, *dy_cols, tile_cum, safe, n_rows, out, backend, config).to(w_dtype)


class _SwigluExpertsFp8(torch.autograd.Function):
    """Differentiable in ``x_ND``, ``w13_EDF2`` and ``w2_EFD`` (the other inputs are their FP8
    copies, the offsets and the options). ``grad``: whether autograd records the call (the
    forward then also makes the column forms the weight gradients read)."""

    @staticmethod
    def forward(ctx, x_ND, w13_EDF2, w2_EFD, q13_EFD, s13_EFbDb, q13_EDF, s13_EDbFb, q2_EFD, s2_EFbDb, q2_EDF,
                s2_EDbFb, offsets_E, backend, config, x_q, x_s_CbN, grad):
        _, need_w13, need_w2 = (grad and n for n in ctx.needs_input_grad[:3])
        x_qc = x_sc = a_qc = a_sc = tiles = None
        if need_w13 and x_q is None:  # x's rows for the gate/up GEMM and its expert tiles for dW13, one read
            x_q, x_s_CbN, x_qc, x_sc, *tiles = _quant_both_op(x_ND, offsets_E, backend)
        elif need_w13 and (backend != "reference" or is_values_placeholder(x_ND)):
            # the rows came quantized (an FP8 dispatch): the tiles are made from them, bit for bit
            # those of x_ND = the rows dequantized, with no [N, D] read of it (x_ND may be a placeholder)
            x_qc, x_sc, *tiles = _quant_cols_from_rows_op(x_q, x_s_CbN, offsets_E, x_ND.dtype, backend)
        elif need_w13:  # the reference backend keeps its oracle: the tiles of x_ND itself
            x_qc, x_sc, *tiles = _quant_cols_op(x_ND, offsets_E, backend)
        elif x_q is None:
            x_q, x_s_CbN = _quant_rows_op(x_ND, backend)
        h = _mm_op(x_q, x_s_CbN, q13_EFD, s13_EFbDb, offsets_E, x_ND.dtype, backend, config)
        if need_w2:  # a's rows for the down GEMM and its expert tiles for dW2; a itself is not kept
            a_q, a_s, a_qc, a_sc, *tiles = _swiglu_quant_both_op(h, offsets_E, backend)
        else:
            _, a_q, a_s = _swiglu_quant_op(h, backend)
        y = _mm_op(a_q, a_s, q2_EFD, s2_EFbDb, offsets_E, x_ND.dtype, backend, config)
        tile_cum, safe = tiles or (None, None)
        ctx.save_for_backward(h, x_qc, x_sc, a_qc, a_sc, tile_cum, safe, q13_EDF, s13_EDbFb, q2_EDF, s2_EDbFb,
                              offsets_E)
        ctx.backend, ctx.config, ctx.n_rows = backend, config, x_ND.shape[0]
        ctx.w_dtypes = (w13_EDF2.dtype, w2_EFD.dtype)
        return y

    @staticmethod
    def backward(ctx, dy_ND):
        h, x_qc, x_sc, a_qc, a_sc, tile_cum, safe, q13_EDF, s13_EDbFb, q2_EDF, s2_EDbFb, offsets_E = ctx.saved_tensors
        backend, config, n = ctx.backend, ctx.config, ctx.n_rows
        need_x, need_w13, need_w2 = ctx.needs_input_grad[:3]
        dy_ND = dy_ND.contiguous()
        dx = dw13 = dw2 = None
        need_dA = need_x or need_w13
        if need_dA and need_w2:  # dy's row form (dA's GEMM) and column form (dW2) from one read of it
            dy_q, dy_s, dy_qc, dy_sc, _, _ = _quant_both_op(dy_ND, offsets_E, backend)
        elif need_dA:
            dy_q, dy_s = _quant_rows_op(dy_ND, backend)
        elif need_w2:
            dy_qc, dy_sc, _, _ = _quant_cols_op(dy_ND, offsets_E, backend)
        if need_w2:
            dw2 = _wgrad((a_qc, a_sc), (dy_qc, dy_sc), tile_cum, safe, n, ctx.w_dtypes[1], backend, config)
        if need_dA:
            dA = _mm_op(dy_q, dy_s, q2_EDF, s2_EDbFb, offsets_E, dy_ND.dtype, backend, config)
            if need_w13:  # dh's rows for the dX GEMM and its expert tiles for dW13; dh itself is not kept
                dh_q, dh_s, dh_qc, dh_sc, _, _ = _swiglu_bwd_quant_both_op(h, dA, offsets_E, backend)
                dw13 = _wgrad((x_qc, x_sc), (dh_qc, dh_sc), tile_cum, safe, n, ctx.w_dtypes[0], backend, config)
            else:
                _, dh_q, dh_s = _swiglu_bwd_quant_op(h, dA, backend)
            if need_x:
                dx = _mm_op(dh_q, dh_s, q13_EDF, s13_EDbFb, offsets_E, h.dtype, backend, config)
        return (dx, dw13, dw2) + (None,) * 14


def swiglu_experts_fp8(x_ND: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor, *,
                       w13_fp8: Optional[Fp8Weight] = None, w2_fp8: Optional[Fp8Weight] = None,
                       backend: Optional[str] = None, config: Optional[Fp8GemmConfig] = None,
                       x_fp8: Optional[Fp8Rows] = None) -> torch.Tensor:
    """SwiGLU experts with both GEMMs (and their dgrad and wgrad) in FP8, the SwiGLU fused with the
    quantizations around it (module docstring).

    Args:
        x_ND: ``[N, D]`` rows grouped by expert (bf16 / fp16; fp32 on the reference backend).
        w13_EDF2: ``[E, D, 2F]`` gate | up master weights; w2_EFD: ``[E, F, D]``.
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (rows past the last are padding).
        w13_fp8, w2_fp8: the weights' FP8 copies (quantized here when None).
        backend, config: as :func:`~tlx_dist.fp8.grouped_mm_fp8` (both GEMMs).
        x_fp8: ``x_ND``'s rows already quantized (an FP8 dispatch delivered them), with ``x_ND =
            dequantize_rows_rounded(x_fp8, x_ND.dtype)`` (what :func:`~tlx_dist.fp8.dispatch.dispatch_fp8`
            returns): the gate/up GEMM reads them instead of quantizing ``x_ND``, and on the kernel
            backends the weight gradient's 128-row tiles are made from them too
            (``quantize_cols_from_rows``: bit for bit the tiles of ``x_ND``); the reference backend
            quantizes ``x_ND`` itself. ``x_ND`` may then be a values placeholder
            (``dispatch_fp8(dequantize=False)``): only its shape, dtype and gradient are used, on
            every backend. A placeholder without ``x_fp8`` is a ValueError.
    Returns:
        ``[N, D]`` in ``x_ND.dtype``; padding rows are zero.
    """
    if not isinstance(w13_EDF2, torch.Tensor) or w13_EDF2.dim() != 3 or w13_EDF2.shape[2] % 2:
        raise ValueError(f"w13_EDF2 must be [E, D, 2F], got shape {tuple(getattr(w13_EDF2, 'shape', ()))}")
    if not isinstance(w2_EFD, torch.Tensor) or w2_EFD.dim() != 3 or w2_EFD.shape[0] != w13_EDF2.shape[0] \
            or 2 * w2_EFD.shape[1] != w13_EDF2.shape[2] or w2_EFD.shape[2] != w13_EDF2.shape[1]:
        raise ValueError(f"w2_EFD must be [E, F, D] = {[w13_EDF2.shape[0], w13_EDF2.shape[2] // 2, w13_EDF2.shape[1]]}"
                         f" to match w13_EDF2 {tuple(w13_EDF2.shape)}, got {tuple(getattr(w2_EFD, 'shape', ()))}")
    if x_fp8 is None and is_values_placeholder(x_ND):
        raise ValueError("x_ND is a values placeholder (strides (0, 0): dispatch_fp8(dequantize=False)), whose values "
                         "are not there: pass the rows it stands for as x_fp8=, or dequantize=True")
    name, w13_fp8, x_q, x_s = _resolve(x_ND, w13_EDF2, offsets_E, w13_fp8, backend, config, x_fp8)
    Fi, D = w2_EFD.shape[1], w2_EFD.shape[2]
    if w2_EFD.device != x_ND.device:
        raise ValueError(f"w2_EFD is on {w2_EFD.device} but x_ND on {x_ND.device}")
    name2 = select_fp8_backend(x_ND.device, Fi, D, backend, f"w2_EFD's (F, D) = ({Fi}, {D})")
    if name2 != name:  # the automatic choice depends on the device only, once both shapes pass
        raise ValueError(f"precision='fp8': the gate/up GEMM runs backend {name!r} but the down GEMM {name2!r}")
    if w2_fp8 is None:
        w2_fp8 = quantize_weight(w2_EFD.detach(), backend=_quant_backend(name))
    else:
        _check_w_fp8(w2_fp8, w2_EFD, "w2_fp8", "w2_EFD")
    return _SwigluExpertsFp8.apply(x_ND, w13_EDF2, w2_EFD, w13_fp8.q_EFD, w13_fp8.s_EFbDb, w13_fp8.q_EDF,
                                   w13_fp8.s_EDbFb, w2_fp8.q_EFD, w2_fp8.s_EFbDb, w2_fp8.q_EDF, w2_fp8.s_EDbFb,
                                   offsets_E, name, _config_json(config), x_q, x_s, torch.is_grad_enabled())


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
