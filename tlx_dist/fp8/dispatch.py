"""FP8 dispatch: token rows leave quantized, the receiver feeds the FP8 GEMM with them.

Legend: T tokens on this rank, D hidden, Db = cdiv(D, 128) scale groups, K top-k, N received rows
(expert-major), P the packed row's width in the activation dtype.

    x_hat_ND, rows_N, handle = dispatch_fp8(dispatcher, x_TD, idx_TK, gate_TK, dequantize=False)
    y_ND  = swiglu_experts_fp8(x_hat_ND, w13, w2, handle.offsets_e, x_fp8=rows_N)   # no requantization
    out   = dispatcher.combine_weighted(y_ND, handle, gate_TK)                      # bf16, fp32 k-sum

Each token row is quantized where it is (1 x 128 tiles along D, tlx_dist/fp8/quant.py) and packed
into one row of bytes -- ``[q: D e4m3 | s: Db fp32 | zero padding to 16 bytes]``, viewed as P
elements of the activation dtype (``packed_width``: P = 2112 for D = 4096 in bf16, 0.52 of the
bf16 row) -- which every dispatcher moves bit for bit (:meth:`Dispatcher.dispatch_payload`: peer
pointers, NVSHMEM, the emulated world, all-to-all, one rank). The receiver's FP8 rows are the
packed rows' q columns as they landed (a strided view the GEMMs read in place) and their scales
(copied to the GEMMs' ``[Db, N]`` layout). ``x_hat_ND`` is what autograd sees as the dispatched
activation: its gradient goes back through :meth:`Dispatcher.dispatch_backward` (a bf16 combine
with an fp32 k-sum). By default it holds the rows dequantized to the activation dtype (the fp32
product rounded once); with ``dequantize=False`` it is a zero-stride placeholder that carries the
gradient and nothing else -- for the FP8 experts, whose gate/up GEMM reads the rows and whose
weight gradient makes its 128-row tiles from them (``quantize_cols_from_rows``, bit for bit the
tiles of the dequantized rows), so no ``[N, D]`` tensor in the activation dtype is written or read.
Combine is unchanged (bf16 rows, fp32 accumulation).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.dispatcher import Dispatcher, DispatchHandle
from .quant import GROUP, Fp8Rows, dequantize_rows_rounded, quantize_rows, values_placeholder

__all__ = ["packed_width", "pack_rows", "unpack_rows", "dispatch_fp8"]

_ALIGN = 16  # bytes: TMA rows and the exchange kernels' vector accesses


def packed_width(D: int, dtype: torch.dtype) -> int:
    """P: elements of ``dtype`` in a packed row of hidden size D (module docstring)."""
    nbytes = D + 4 * -(-D // GROUP)
    nbytes = -(-nbytes // _ALIGN) * _ALIGN
    item = torch.empty((), dtype=dtype).element_size()
    return nbytes // item


def pack_rows(rows: Fp8Rows, dtype: torch.dtype) -> torch.Tensor:
    """``[M, P]`` of ``dtype`` holding each row's e4m3 values, then its fp32 scales (the bytes,
    not the values: the result is a container, not numbers)."""
    M, D = rows.q_MC.shape
    Db = -(-D // GROUP)
    P = packed_width(D, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    out = torch.zeros(M, P * item, dtype=torch.uint8, device=rows.q_MC.device)
    out[:, :D] = rows.q_MC.view(torch.uint8)
    s_rm = torch.empty(M, Db, dtype=torch.float32, device=rows.q_MC.device)  # row-major whatever Db
    s_rm.copy_(rows.s_MCb)
    out[:, D:D + 4 * Db] = s_rm.view(torch.uint8)
    return out.view(dtype)


def unpack_rows(packed_NP: torch.Tensor, D: int) -> Fp8Rows:
    """The :class:`Fp8Rows` of ``[N, P]`` packed rows: ``q`` a strided view of their first D bytes
    (row stride P elements), ``s`` their scales copied to ``[Db, N]`` storage."""
    if packed_NP.dim() != 2 or packed_NP.shape[1] != packed_width(D, packed_NP.dtype):
        raise ValueError(f"packed_NP must be [N, {packed_width(D, packed_NP.dtype)}] for D={D} in {packed_NP.dtype}, "
                         f"got {tuple(packed_NP.shape)}")
    Db = -(-D // GROUP)
    b = packed_NP.contiguous().view(torch.uint8)
    q = b[:, :D].view(torch.float8_e4m3fn)
    s = b[:, D:D + 4 * Db].contiguous().view(torch.float32)  # [N, Db]
    return Fp8Rows(q, s.t().contiguous().t())


class _Fp8Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, idx_TK, gate_TK, dispatcher, backend, dequantize):
        D = x_TD.shape[1]
        packed = pack_rows(quantize_rows(x_TD.detach(), backend=backend), x_TD.dtype)
        recv_NP, handle = dispatcher.dispatch_payload(packed, idx_TK, gate_TK, x_TD)
        rows = unpack_rows(recv_NP, D)
        if dequantize:
            x_hat = dequantize_rows_rounded(rows, x_TD.dtype)
        else:  # only the gradient's carrier: nothing is written
            x_hat = values_placeholder(rows.q_MC.shape[0], D, x_TD.dtype, x_TD.device)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.mark_non_differentiable(rows.q_MC, rows.s_MCb)
        return x_hat, rows.q_MC, rows.s_MCb, handle

    @staticmethod
    def backward(ctx, g_hat, _g_q, _g_s, _g_handle):
        return ctx.dispatcher.dispatch_backward(g_hat.contiguous(), ctx.handle), None, None, None, None, None


def dispatch_fp8(dispatcher: Dispatcher, x_TD: torch.Tensor, idx_TK: torch.Tensor,
                 gate_TK: Optional[torch.Tensor] = None, backend: Optional[str] = None, *,
                 dequantize: bool = True) -> tuple[torch.Tensor, Fp8Rows, DispatchHandle]:
    """Dispatch with the token rows quantized before they leave (module docstring).

    Args:
        dispatcher: any :class:`~tlx_dist.comm.Dispatcher`.
        x_TD: ``[T, D]`` bf16 / fp16 (fp32 on CPU) token rows, differentiable.
        idx_TK, gate_TK: the router's ``[T, K]`` expert ids and gates (as for ``dispatch``).
        backend: the quantizer's (``None``: the kernel where it runs; ``"reference"``).
        dequantize: write the dequantized rows (``x_hat_ND``'s values). False: ``x_hat_ND`` is a
            placeholder (:func:`~tlx_dist.fp8.quant.values_placeholder`: strides ``(0, 0)``, NaN,
            nothing written) that only carries the gradient back to ``x_TD``; its values must never
            be read -- for a consumer that reads the rows alone, as :func:`swiglu_experts_fp8` given
            ``x_fp8=rows_N`` does (it refuses the placeholder without them).
    Returns:
        ``(x_hat_ND, rows_N, handle)``: the dequantized received rows ``[N, D]`` in ``x_TD``'s dtype
        (``dequantize_rows_rounded(rows_N, x_TD.dtype)``, or the placeholder; differentiable back to
        ``x_TD``), their :class:`Fp8Rows` (``q`` ``[N, D]`` e4m3, ``s`` ``[N, Db]`` fp32, bit for
        bit ``quantize_rows`` of what :meth:`dispatch` would have delivered), and the handle for
        ``combine_weighted``.
    """
    if not isinstance(dispatcher, Dispatcher):
        raise TypeError(f"dispatcher must be a Dispatcher, got {type(dispatcher).__name__}")
    if not isinstance(x_TD, torch.Tensor) or x_TD.dim() != 2:
        raise ValueError(f"x_TD must be a 2-D tensor [T, D], got {getattr(x_TD, 'shape', type(x_TD))}")
    if not isinstance(dequantize, bool):
        raise TypeError(f"dequantize must be a bool, got {type(dequantize).__name__}")
    x_hat, q, s, handle = _Fp8Dispatch.apply(x_TD, idx_TK, gate_TK, dispatcher, backend, dequantize)
    return x_hat, Fp8Rows(q, s), handle
