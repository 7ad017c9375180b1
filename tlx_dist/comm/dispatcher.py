"""The dispatcher interface every backend implements, and its frozen handle.

Legend: T tokens on this rank, D hidden, K top-k, S = T*K slots, E global experts, W ranks,
e = E/W local experts, N rows received by this rank (expert-major, see ``layout.py``).

    recv_ND, handle = dispatcher.dispatch(x_TD, idx_TK, gate_TK)   # rows for this rank's experts
    y_ND            = experts(recv_ND, handle.offsets_e)           # grouped GEMMs
    out_TD          = dispatcher.combine_weighted(y_ND, handle, gate_TK)   # sum_k gate * y, at the source

Differentiable: the backward of dispatch is a combine (summed over k, since one token row fed K
slots) and the backward of combine is a dispatch. ``combine(y_ND, handle) -> y_TKD`` (each slot's
row back at its source; the gates applied outside, in ops autograd understands) exists where the
backend returns rows per slot (local, all-to-all: the references). The deduplicated symmetric
backend sends one row per (token, rank), so it applies the gates where the experts live and only
offers ``combine_weighted``; its gate gradient is computed there too.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch

from .local_combine import dispatch_backward_local, use_combine_kernels

__all__ = ["DispatchHandle", "Dispatcher", "check_dispatch_args", "permute_rows", "replicate_rows", "inverse_permutation"]


@dataclass(frozen=True)
class DispatchHandle:
    """What combine and the backward need to undo a dispatch.

    num_tokens: T of the source tensor; top_k: K.
    num_recv_rows: N, rows of the receive buffer (may exceed ``offsets_e[-1]`` for padded buffers).
    offsets_e: ``[e]`` int32 cumulative end rows of the local experts (the grouped GEMM's offsets).
    recv_counts_e: ``[e]`` int64 rows received per local expert.
    tokens_per_expert_E: ``[E]`` int64 slots this rank sent to each global expert.
    order_S: ``[S]`` slot ids in send order (sorted by global expert, stable); None where a backend
        ranks slots without sorting them (SymmDispatcher).
    inverse_S: ``[S]`` position of each slot in ``order_S`` (None likewise).
    """

    num_tokens: int
    top_k: int
    num_recv_rows: int
    offsets_e: torch.Tensor
    recv_counts_e: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    order_S: Optional[torch.Tensor]
    inverse_S: Optional[torch.Tensor]


def check_dispatch_args(x_TD: torch.Tensor, idx_TK: torch.Tensor, num_experts: int, validate_ids: bool) -> None:
    if not isinstance(x_TD, torch.Tensor):
        raise TypeError(f"x_TD must be a torch.Tensor, got {type(x_TD).__name__}")
    if not isinstance(idx_TK, torch.Tensor):
        raise TypeError(f"idx_TK must be a torch.Tensor, got {type(idx_TK).__name__}")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be 2-D [T, D], got shape {tuple(x_TD.shape)}")
    if idx_TK.dim() != 2 or idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"idx_TK must be [T={x_TD.shape[0]}, K], got shape {tuple(idx_TK.shape)}")
    if idx_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx_TK must be int32 or int64, got {idx_TK.dtype}")
    if idx_TK.device != x_TD.device:
        raise ValueError(f"idx_TK is on {idx_TK.device} but x_TD is on {x_TD.device}")
    if not x_TD.is_floating_point():
        raise TypeError(f"x_TD must be a floating tensor, got {x_TD.dtype}")
    if validate_ids and idx_TK.numel():
        # Host sync: only on the checked path (user-supplied ids); the router's ids are in range by
        # construction and MoELayer turns this off.
        lo, hi = int(idx_TK.min()), int(idx_TK.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"idx_TK holds expert ids in [{lo}, {hi}], outside [0, {num_experts})")


class _PermuteRows(torch.autograd.Function):
    """``out = x[index]`` for a permutation ``index``; the backward gathers with its inverse (a
    gather, not the atomic ``index_add`` autograd would use for ``index_select``)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _ReplicateRows(torch.autograd.Function):
    """``out[i] = x_TD[order_S[i] // K]``: each token row once per slot, in slot order ``order_S``.
    Backward: ``dx[t] = sum_k grad[inverse_S[t*K + k]]`` -- a gather and a k-sum accumulated in fp32
    and rounded once, deterministic (``index_select``'s own backward is an atomic ``index_add``);
    one fused kernel where local_combine.py's run."""

    @staticmethod
    def forward(ctx, x_TD, order_S, inverse_S, K):
        ctx.save_for_backward(inverse_S)
        ctx.K = K
        return x_TD.index_select(0, torch.div(order_S, K, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (inverse_S,) = ctx.saved_tensors
        if ctx.K and use_combine_kernels(grad):  # the same gather + k-sum, fused (local_combine.py)
            return dispatch_backward_local(grad, inverse_S, inverse_S.shape[0] // ctx.K, ctx.K), None, None, None
        g_TKD = grad.index_select(0, inverse_S).view(-1, ctx.K, grad.shape[1])
        return g_TKD.sum(1, dtype=torch.promote_types(grad.dtype, torch.float32)).to(grad.dtype), None, None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x[index]`` for a permutation ``index`` whose inverse is ``inverse``."""
    return _PermuteRows.apply(x, index, inverse)


def replicate_rows(x_TD: torch.Tensor, order_S: torch.Tensor, inverse_S: torch.Tensor, K: int) -> torch.Tensor:
    """Differentiable ``x_TD[order_S // K]`` (one row per (token, k) slot, in ``order_S`` order)."""
    return _ReplicateRows.apply(x_TD, order_S, inverse_S, K)


def inverse_permutation(order_S: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order_S)
    inv[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    return inv


class Dispatcher(abc.ABC):
    """Moves (token, k) rows to the ranks owning their experts and back. See the module docstring."""

    def __init__(self, num_experts: int, world_size: int, rank: int, validate: bool = True):
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
        if num_experts % world_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP world size {world_size}")
        self.num_experts = num_experts
        self.world_size = world_size
        self.rank = rank
        self.num_local_experts = num_experts // world_size
        self.validate = validate

    @abc.abstractmethod
    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor,
                 gate_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, DispatchHandle]:
        """Returns ``recv_ND`` (expert-major rows for this rank's local experts) and the handle.
        ``gate_TK`` (the router's gates) is needed by backends that combine with the gates where
        the experts live; the others ignore it."""

    @abc.abstractmethod
    def combine(self, y_ND: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Returns ``y_TKD``: row ``[t, k]`` is the expert output for slot (t, k) of this rank."""

    def combine_weighted(self, y_ND: torch.Tensor, handle: DispatchHandle, gate_TK: torch.Tensor) -> torch.Tensor:
        """``out_TD[t] = sum_k gate_TK[t, k] * y[t, k]``: products in the activation dtype (as the
        per-token reference does), the k-sum accumulated in fp32 and rounded once. No [T, K, D]
        fp32 copy, no batched tiny GEMMs."""
        y_TKD = self.combine(y_ND, handle)
        w_TK1 = gate_TK.to(y_TKD.dtype).unsqueeze(-1)
        acc = torch.promote_types(y_TKD.dtype, torch.float32)
        return (y_TKD * w_TK1).sum(1, dtype=acc).to(y_ND.dtype)

    def dispatch_payload(self, payload_TP: torch.Tensor, idx_TK: torch.Tensor, gate_TK: Optional[torch.Tensor],
                         x_TD: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
        """Moves per-token *payload* rows (``[T, P]``, any width, in ``x_TD``'s dtype: e.g. packed FP8
        rows with their scales, tlx_dist/fp8/dispatch.py) as :meth:`dispatch` moves ``x_TD``'s rows,
        bit for bit and not differentiably; returns ``(recv_NP, handle)``, the handle combining and
        back-propagating rows of ``x_TD``'s width D (:meth:`combine_weighted`,
        :meth:`dispatch_backward`). Default: the ordinary dispatch (its handle does not depend on the
        row width)."""
        with torch.no_grad():
            return self.dispatch(payload_TP, idx_TK, gate_TK)

    def dispatch_backward(self, g_ND: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """The gradient of a dispatch: ``g_TD[t] = sum_k g_ND[row of (t, k)]`` (fp32 sum, one
        rounding to ``g_ND``'s dtype), what autograd of :meth:`dispatch` computes -- for callers that
        dispatched a payload (:meth:`dispatch_payload`). Not differentiable."""
        with torch.no_grad():
            g_TKD = self.combine(g_ND, handle)
            return g_TKD.sum(1, dtype=torch.promote_types(g_ND.dtype, torch.float32)).to(g_ND.dtype)

    def _check_combine(self, y_ND: torch.Tensor, handle: DispatchHandle, what: str = "y_ND") -> None:
        if not isinstance(y_ND, torch.Tensor) or y_ND.dim() != 2:
            raise ValueError(f"{what} must be a 2-D tensor [N, D], got {getattr(y_ND, 'shape', type(y_ND))}")
        if y_ND.shape[0] != handle.num_recv_rows:
            raise ValueError(f"{what} has {y_ND.shape[0]} rows but the dispatch received N={handle.num_recv_rows}")

    @property
    def name(self) -> str:
        return type(self).__name__

    def extra_repr(self) -> Optional[str]:
        return f"E={self.num_experts}, W={self.world_size}, rank={self.rank}"
