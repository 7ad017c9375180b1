"""Single-rank gather-reduce ops: the gate-weighted combine and a dispatch's backward, fused
(tlx/common/combine.py), as torch custom ops with fake impls and autograd.

Legend: T tokens, K top-k, S = T*K slots (slot s = t*K + k), D hidden, N = S expert-major rows;
``order_S[n]`` the slot of row n, ``inverse_S[s]`` the row of slot s (a :class:`DispatchHandle`'s).

    out_TD         = combine_weighted_local(y_ND, gate_TK, order_S, inverse_S)   # differentiable
    g_TD           = dispatch_backward_local(g_ND, inverse_S, T, K)             # not differentiable

Semantics are those of the torch composition in ``Dispatcher.combine_weighted`` /
``Dispatcher.dispatch_backward`` (tlx_dist/comm/dispatcher.py), which stays the reference and the
CPU path: the gate rounded to y's dtype, each product rounded to it, the k-sum accumulated in fp32
and rounded once. Gradients: ``g_y[n] = act(g[t] * gate[s])`` (what the product's backward gives,
bit for bit), ``g_gate[s] = sum_d g[t, d] * y[n, d]`` with fp32 products and sum, rounded once to
the gate's dtype (torch's autograd rounds each product to y's dtype first: this is no less
accurate). The k-sum order may differ from torch's reduction, within one rounding of the result.

:func:`use_combine_kernels` says where the kernels run: bf16 / fp16 rows, fp32 / bf16 / fp16
gates, on a GPU or under TRITON_INTERPRET=1 (CPU tests). Elsewhere callers keep the torch path; the
ops themselves fall back to ``*_ref`` (the same semantics in torch) so that they run anywhere.
Nothing here reads device values on the host.
"""

from __future__ import annotations

import torch

from ..grouped_gemm.eager import custom_op
from ..grouped_gemm.host import interpret_mode, launch_meta

__all__ = ["use_combine_kernels", "combine_weighted_local", "dispatch_backward_local", "combine_weighted_ref",
           "combine_weighted_backward_ref", "gather_ksum_ref"]

_ACT = (torch.bfloat16, torch.float16)
_GATE = (torch.float32, torch.bfloat16, torch.float16)
# Launch: 4 warps over a [BLOCK_R, BLOCK_D] tile, 8 contiguous 2-byte elements (16 B) per thread.
# ``_launch=`` of the launch functions below overrides them for one call (bench/fp8_kernels.py --sweep).
_KSUM_LAUNCH = {"BLOCK_R": 4, "BLOCK_D": 256, "num_warps": 4}
_COMBINE_BWD_LAUNCH = {"BLOCK_R": 4, "BLOCK_D": 256, "num_warps": 4}


def use_combine_kernels(rows: torch.Tensor, gate_TK: torch.Tensor | None = None) -> bool:
    """True where the fused kernels compute these operands exactly as the torch composition
    (dtypes above) and can run (a CUDA device, or CPU under TRITON_INTERPRET=1)."""
    if rows.dtype not in _ACT or (gate_TK is not None and (gate_TK.dtype not in _GATE
                                                           or gate_TK.device != rows.device)):
        return False
    return _runnable(rows.device.type)


def _runnable(device_type: str) -> bool:
    from tlx import triton_available

    return triton_available() and (device_type == "cuda" or (device_type == "cpu" and interpret_mode()))


# Evaluated eagerly while torch.compile traces (the first probe of triton fills a cache, a side
# effect dynamo cannot trace inside an autograd.Function's backward), its result a constant: what
# torch.compiler.assume_constant_result(_runnable) does, without importing torch._dynamo at import
# time (as tlx_dist/grouped_gemm/backends.py does for its loader).
_runnable._dynamo_marked_constant = True


# --- references (the same semantics in torch; the ops' fallback) ------------------------------------


def combine_weighted_ref(y_ND, gate_TK, inverse_S):
    """``out_TD[t] = act(sum_k act(act(gate[t, k]) * y[inverse_S[t*K + k]]))`` (fp32 k-sum)."""
    T, K = gate_TK.shape
    y_TKD = y_ND.index_select(0, inverse_S).view(T, K, y_ND.shape[1])
    return (y_TKD * gate_TK.to(y_ND.dtype).unsqueeze(-1)).sum(1, dtype=torch.float32).to(y_ND.dtype)


def combine_weighted_backward_ref(g_TD, y_ND, gate_TK, order_S):
    """``(g_y_ND, g_gate_TK)``: ``g_y[n] = act(g[t] * act(gate[s]))``, ``g_gate[s] = sum_d g[t, d] *
    y[n, d]`` in fp32, rounded once to ``gate_TK``'s dtype (s = order_S[n], t = s // K)."""
    T, K = gate_TK.shape
    t_N = torch.div(order_S, K, rounding_mode="floor")
    g_ND = g_TD.index_select(0, t_N)
    w_N1 = gate_TK.reshape(-1).index_select(0, order_S).to(y_ND.dtype).unsqueeze(-1)
    dot_N = (g_ND.float() * y_ND.float()).sum(1)
    g_gate = torch.empty(T * K, dtype=gate_TK.dtype, device=gate_TK.device)
    g_gate[order_S] = dot_N.to(gate_TK.dtype)
    return g_ND * w_N1, g_gate.view(T, K)


def gather_ksum_ref(g_ND, inverse_S, T, K):
    """``g_TD[t] = act(sum_k g_ND[inverse_S[t*K + k]])`` (fp32 sum)."""
    return g_ND.index_select(0, inverse_S).view(T, K, g_ND.shape[1]).sum(1, dtype=torch.float32).to(g_ND.dtype)


# --- kernel launches --------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _gather_ksum(rows_ND, gate_TK, inverse_S, T, K, _launch=None):
    """``[T, D]``: the (gate-weighted when ``gate_TK`` is given) k-sum of ``rows_ND`` ``[T*K, D]``;
    ``_launch``: the kernel's meta-parameter overrides (None: ``_KSUM_LAUNCH``)."""
    from tlx.common.combine import _gather_ksum_kernel

    rows_ND = _rows(rows_ND)
    D = rows_ND.shape[1]
    out = torch.empty(T, D, dtype=rows_ND.dtype, device=rows_ND.device)
    if T and D and K:
        gate = gate_TK.contiguous() if gate_TK is not None else rows_ND  # unread without HAS_GATE
        meta = launch_meta(_KSUM_LAUNCH, _launch)
        grid = (-(-T // meta["BLOCK_R"]), -(-D // meta["BLOCK_D"]))
        _gather_ksum_kernel[grid](rows_ND, gate, inverse_S.contiguous(), out, T, K, D, rows_ND.stride(0), D,
                                  HAS_GATE=gate_TK is not None, EMULATE=interpret_mode(), **meta)
    elif T and D:
        out.zero_()
    return out


def _combine_bwd(g_TD, y_ND, gate_TK, order_S, _launch=None):
    """``(g_y_ND, g_gate_TK)`` of :func:`combine_weighted_backward_ref`; ``_launch``: the kernel's
    meta-parameter overrides (None: ``_COMBINE_BWD_LAUNCH``)."""
    from tlx.common.combine import _combine_bwd_kernel

    g_TD, y_ND, gate = _rows(g_TD), _rows(y_ND), gate_TK.contiguous()
    N, D = y_ND.shape
    K = gate_TK.shape[1]
    g_y = torch.empty(N, D, dtype=y_ND.dtype, device=y_ND.device)
    g_gate = torch.empty(gate_TK.shape, dtype=gate_TK.dtype, device=gate_TK.device)
    if N:
        meta = launch_meta(_COMBINE_BWD_LAUNCH, _launch)
        _combine_bwd_kernel[(-(-N // meta["BLOCK_R"]),)](g_TD, y_ND, gate, order_S.contiguous(), g_y, g_gate, N, K, D,
                                                         g_TD.stride(0), y_ND.stride(0), D, EMULATE=interpret_mode(),
                                                         **meta)
    return g_y, g_gate


# --- custom ops ---------------------------------------------------------------------------------------
# Eager calls run the bodies directly (the combine's autograd formula through an eager
# autograd.Function); anything that traces gets the ops (tlx_dist/grouped_gemm/eager.py).


@custom_op("tlx_dist::local_combine_weighted")
def _combine_op(y_ND: torch.Tensor, gate_TK: torch.Tensor, order_S: torch.Tensor,
                inverse_S: torch.Tensor) -> torch.Tensor:
    if use_combine_kernels(y_ND, gate_TK):
        return _gather_ksum(y_ND, gate_TK, inverse_S, gate_TK.shape[0], gate_TK.shape[1])
    return combine_weighted_ref(y_ND, gate_TK, inverse_S)


@_combine_op.register_fake
def _(y_ND, gate_TK, order_S, inverse_S):
    return y_ND.new_empty(gate_TK.shape[0], y_ND.shape[1])


@custom_op("tlx_dist::local_combine_weighted_backward")
def _combine_bwd_op(g_TD: torch.Tensor, y_ND: torch.Tensor, gate_TK: torch.Tensor,
                    order_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_combine_kernels(y_ND, gate_TK) and g_TD.dtype == y_ND.dtype and g_TD.device == y_ND.device:
        return _combine_bwd(g_TD, y_ND, gate_TK, order_S)
    return combine_weighted_backward_ref(g_TD, y_ND, gate_TK, order_S)


@_combine_bwd_op.register_fake
def _(g_TD, y_ND, gate_TK, order_S):
    return torch.empty_like(y_ND, memory_format=torch.contiguous_format), torch.empty_like(
        gate_TK, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    y_ND, gate_TK, order_S, _inverse_S = inputs
    ctx.save_for_backward(y_ND, gate_TK, order_S)


def _backward(ctx, g_TD):
    y_ND, gate_TK, order_S = ctx.saved_tensors
    g_y, g_gate = _combine_bwd_op(g_TD.to(y_ND.dtype), y_ND, gate_TK, order_S)
    return (g_y if ctx.needs_input_grad[0] else None, g_gate if ctx.needs_input_grad[1] else None, None, None)


_combine_op.register_autograd(_backward, setup_context=_setup_context)


@custom_op("tlx_dist::local_gather_ksum")
def _ksum_op(g_ND: torch.Tensor, inverse_S: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    if use_combine_kernels(g_ND):
        return _gather_ksum(g_ND, None, inverse_S, num_tokens, top_k)
    return gather_ksum_ref(g_ND, inverse_S, num_tokens, top_k)


@_ksum_op.register_fake
def _(g_ND, inverse_S, num_tokens, top_k):
    return g_ND.new_empty(num_tokens, g_ND.shape[1])


# --- public functions ---------------------------------------------------------------------------------


def _check(rows_ND, inverse_S, T, K, what):
    if not isinstance(rows_ND, torch.Tensor) or rows_ND.dim() != 2:
        raise ValueError(f"{what} must be a 2-D tensor [N, D], got {getattr(rows_ND, 'shape', type(rows_ND))}")
    if rows_ND.shape[0] != T * K:
        raise ValueError(f"{what} has {rows_ND.shape[0]} rows, expected N = T*K = {T}*{K}")
    if inverse_S.shape != (T * K,) or inverse_S.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"inverse_S must be [T*K = {T * K}] int32/int64, got {tuple(inverse_S.shape)} {inverse_S.dtype}")
    if inverse_S.device != rows_ND.device:
        raise ValueError(f"inverse_S is on {inverse_S.device} but {what} is on {rows_ND.device}")


def combine_weighted_local(y_ND: torch.Tensor, gate_TK: torch.Tensor, order_S: torch.Tensor,
                           inverse_S: torch.Tensor) -> torch.Tensor:
    """Gate-weighted k-sum of a single-rank dispatch's expert outputs (module docstring).

    Args:
        y_ND: ``[N = T*K, D]`` bf16 / fp16 expert outputs in expert-major order.
        gate_TK: ``[T, K]`` fp32 / bf16 / fp16 gates.
        order_S, inverse_S: ``[S]`` int64 / int32, the dispatch handle's permutation and its inverse.
    Returns:
        ``out_TD`` ``[T, D]`` in ``y_ND``'s dtype; differentiable in ``y_ND`` and ``gate_TK``.
    """
    if not isinstance(gate_TK, torch.Tensor) or gate_TK.dim() != 2:
        raise ValueError(f"gate_TK must be a 2-D tensor [T, K], got {getattr(gate_TK, 'shape', type(gate_TK))}")
    T, K = gate_TK.shape
    _check(y_ND, inverse_S, T, K, "y_ND")
    if order_S.shape != inverse_S.shape or order_S.device != inverse_S.device:
        raise ValueError(f"order_S {tuple(order_S.shape)} on {order_S.device} does not match inverse_S "
                         f"{tuple(inverse_S.shape)} on {inverse_S.device}")
    if gate_TK.device != y_ND.device:
        raise ValueError(f"gate_TK is on {gate_TK.device} but y_ND is on {y_ND.device}")
    return _combine_op(y_ND, gate_TK, order_S, inverse_S)


def dispatch_backward_local(g_ND: torch.Tensor, inverse_S: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``g_TD[t] = sum_k g_ND[inverse_S[t*K + k]]`` (fp32 sum, one rounding to ``g_ND``'s dtype):
    the gradient of a single-rank dispatch. ``g_ND`` ``[T*K, D]``; returns ``[T, D]``. Not
    differentiable."""
    _check(g_ND, inverse_S, num_tokens, top_k, "g_ND")
    return _ksum_op(g_ND, inverse_S, num_tokens, top_k)
