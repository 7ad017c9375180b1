"""Single-rank dispatcher: a permutation of (token, k) slots into expert-major order. No host sync.

The weighted combine and the payload dispatch's backward are gather-reduces over that permutation:
on a GPU (and on CPU under TRITON_INTERPRET=1) for bf16 / fp16 rows they run as one fused kernel each
(local_combine.py: no [T, K, D] intermediate, forward or backward); elsewhere the torch composition
of :class:`Dispatcher` (the reference) runs."""

from __future__ import annotations

import torch

from ..grouped_gemm.host import expert_slots, sched_order_offset, slots_kernel_runs
from .dispatcher import DispatchHandle, Dispatcher, check_dispatch_args, inverse_permutation, permute_rows, replicate_rows
from .layout import sort_slots
from .local_combine import combine_weighted_local, dispatch_backward_local, use_combine_kernels

__all__ = ["LocalDispatcher", "expert_order"]


def expert_order(idx_TK: torch.Tensor, E: int):
    """``(order_S int64, offsets_E int32, counts_E int64)``: the slots in expert-major order (a
    stable sort by expert id), each expert's cumulative end row and its row count. Where the
    Triton kernels run (real tensors, nothing tracing) one launch of the routing kernel
    (``grouped_gemm.host.expert_slots``), else torch's stable sort (``sort_slots``): the same order
    for ids in ``[0, E)``. Ids outside it (never from the router; ``LocalDispatcher(validate=True)``
    rejects them on the host) are padding rows after ``offsets_E[-1]`` on the kernel path, counted
    for no expert, as in the fused pipeline's layout (``fused.expert_major_layout``); torch's path
    raises on them."""
    if _slots_kernel_runs(idx_TK):
        _, order_S, offsets_E, _ = expert_slots(idx_TK, E, 128, sched_order_offset(E))
        counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).long()
        return order_S, offsets_E, counts_E
    slots = sort_slots(idx_TK, E)
    return slots.order_S, torch.cumsum(slots.counts_E, 0).to(torch.int32), slots.counts_E


def _slots_kernel_runs(idx_TK: torch.Tensor) -> bool:
    """The routing kernel takes this call (``grouped_gemm.host.slots_kernel_runs``) with between 1
    and 2**31 - 1 slots (it indexes them in int32; torch's sort takes the rest)."""
    return 0 < idx_TK.shape[0] * idx_TK.shape[1] < 2**31 and slots_kernel_runs(idx_TK)


class LocalDispatcher(Dispatcher):
    """All experts on this rank. ``recv_ND`` has exactly N = T*K rows."""

    def __init__(self, num_experts: int, validate: bool = True):
        super().__init__(num_experts, world_size=1, rank=0, validate=validate)

    def dispatch(self, x_TD, idx_TK, gate_TK=None):
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        T, K = idx_TK.shape
        order_S, offsets_e, counts_E = expert_order(idx_TK, self.num_experts)
        inverse_S = inverse_permutation(order_S)
        # Backward: gather each slot's gradient back and sum over k -- the combine of dx.
        recv_ND = replicate_rows(x_TD, order_S, inverse_S, K)
        handle = DispatchHandle(
            num_tokens=T, top_k=K, num_recv_rows=T * K, offsets_e=offsets_e,
            recv_counts_e=counts_E, tokens_per_expert_E=counts_E,
            order_S=order_S, inverse_S=inverse_S)
        return recv_ND, handle

    def combine(self, y_ND, handle):
        self._check_combine(y_ND, handle)
        # Backward: a gather back into expert-major order -- a dispatch of dy.
        y_SD = permute_rows(y_ND, handle.inverse_S, handle.order_S)
        return y_SD.view(handle.num_tokens, handle.top_k, y_ND.shape[1])

    def combine_weighted(self, y_ND, handle, gate_TK):
        """:meth:`Dispatcher.combine_weighted`; ``gate_TK`` ``[T, K]`` (fp32 / bf16 / fp16 for the kernel)."""
        self._check_combine(y_ND, handle)
        if not isinstance(gate_TK, torch.Tensor) or tuple(gate_TK.shape) != (handle.num_tokens, handle.top_k):
            raise ValueError(f"gate_TK must be a [T={handle.num_tokens}, K={handle.top_k}] tensor, got "
                             f"{getattr(gate_TK, 'shape', type(gate_TK))}")
        if not use_combine_kernels(y_ND, gate_TK):
            return super().combine_weighted(y_ND, handle, gate_TK)
        return combine_weighted_local(y_ND, gate_TK, handle.order_S, handle.inverse_S)

    def dispatch_backward(self, g_ND, handle):
        """:meth:`Dispatcher.dispatch_backward` (one fused gather + k-sum where the kernels run)."""
        self._check_combine(g_ND, handle, "g_ND")
        if not use_combine_kernels(g_ND):
            return super().dispatch_backward(g_ND, handle)
        with torch.no_grad():
            return dispatch_backward_local(g_ND, handle.inverse_S, handle.num_tokens, handle.top_k)
