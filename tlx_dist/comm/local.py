"""Single-rank dispatcher: a permutation of (token, k) slots into expert-major order. No host sync."""

from __future__ import annotations

import torch

from .dispatcher import DispatchHandle, Dispatcher, check_dispatch_args, inverse_permutation, permute_rows, replicate_rows
from .layout import sort_slots

__all__ = ["LocalDispatcher"]


class LocalDispatcher(Dispatcher):
    """All experts on this rank. ``recv_ND`` has exactly N = T*K rows."""

    def __init__(self, num_experts: int, validate: bool = True):
        super().__init__(num_experts, world_size=1, rank=0, validate=validate)

    def dispatch(self, x_TD, idx_TK, gate_TK=None):
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        T, K = idx_TK.shape
        slots = sort_slots(idx_TK, self.num_experts)
        inverse_S = inverse_permutation(slots.order_S)
        # Backward: gather each slot's gradient back and sum over k -- the combine of dx.
        recv_ND = replicate_rows(x_TD, slots.order_S, inverse_S, K)
        handle = DispatchHandle(
            num_tokens=T, top_k=K, num_recv_rows=T * K,
            offsets_e=torch.cumsum(slots.counts_E, 0).to(torch.int32),
            recv_counts_e=slots.counts_E, tokens_per_expert_E=slots.counts_E,
            order_S=slots.order_S, inverse_S=inverse_S)
        return recv_ND, handle

    def combine(self, y_ND, handle):
        self._check_combine(y_ND, handle)
        # Backward: a gather back into expert-major order -- a dispatch of dy.
        y_SD = permute_rows(y_ND, handle.inverse_S, handle.order_S)
        return y_SD.view(handle.num_tokens, handle.top_k, y_ND.shape[1])
