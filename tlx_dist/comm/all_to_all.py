"""Expert parallelism over a ProcessGroup with ``all_to_all_single`` (gloo on CPU, NCCL on GPU).

The portable and reference EP path. Split sizes must be known on the host, so each dispatch syncs
once (one ``[W, E]`` count matrix to the CPU), as torchtitan's all-to-all path does. The receive
buffer is then sized exactly: N = rows routed to this rank's experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dispatcher import DispatchHandle, Dispatcher, check_dispatch_args, inverse_permutation, permute_rows, replicate_rows
from .layout import layout_from_counts, sort_slots

__all__ = ["AllToAllDispatcher", "AllToAllHandle", "all_to_all_rows"]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAllRows.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """``[W * numel]`` concatenation of every rank's ``t`` (flat output: what gloo accepts)."""
    out = t.new_empty(dist.get_world_size(group) * t.numel())
    # torch >= 2.13 renames all_gather_into_tensor to all_gather_single; support both.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out


def all_to_all_rows(rows: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over rows; its backward is the reverse exchange."""
    return _AllToAllRows.apply(rows, tuple(out_splits), tuple(in_splits), group)


@dataclass(frozen=True)
class AllToAllHandle(DispatchHandle):
    """Adds the host split sizes and the src-major <-> expert-major row maps.

    input_splits / output_splits: rows sent to / received from each rank.
    gather_N: expert-major row i is received (src-major) row ``gather_N[i]``.
    scatter_N: received row j goes to expert-major row ``scatter_N[j]``.
    """

    input_splits: tuple
    output_splits: tuple
    gather_N: torch.Tensor
    scatter_N: torch.Tensor


class AllToAllDispatcher(Dispatcher):
    def __init__(self, num_experts: int, group: dist.ProcessGroup, validate: bool = True):
        if not dist.is_initialized():
            raise ValueError("AllToAllDispatcher needs torch.distributed to be initialised (group=...)")
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group), validate)
        self.group = group

    def dispatch(self, x_TD, idx_TK, gate_TK=None):
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        T, K = idx_TK.shape
        W, r, e = self.world_size, self.rank, self.num_local_experts
        slots = sort_slots(idx_TK, self.num_experts)

        counts_WE = _all_gather_rows(slots.counts_E, self.group).view(W, self.num_experts)
        layout = layout_from_counts(counts_WE)

        counts_host = counts_WE.cpu()  # the one host sync: NCCL/gloo need split sizes on the host
        input_splits = tuple(counts_host[r].view(W, e).sum(1).tolist())
        mine = counts_host[:, r * e:(r + 1) * e]  # [W, e] rows each source sends to my experts
        output_splits = tuple(mine.sum(1).tolist())
        n_recv = sum(output_splits)

        # Rows arrive src-major (src, local expert, q); place each at its expert-major row.
        dev = x_TD.device
        block_counts = mine.reshape(-1).to(dev)
        block_start = layout.block_start_WE[:, r * e:(r + 1) * e].reshape(-1)
        arrival_start = torch.cumsum(block_counts, 0) - block_counts
        within = torch.arange(n_recv, device=dev) - torch.repeat_interleave(arrival_start, block_counts, output_size=n_recv)
        scatter_N = torch.repeat_interleave(block_start, block_counts, output_size=n_recv) + within
        gather_N = inverse_permutation(scatter_N)

        inverse_S = inverse_permutation(slots.order_S)
        send_SD = replicate_rows(x_TD, slots.order_S, inverse_S, K)
        recv_src_major = all_to_all_rows(send_SD, output_splits, input_splits, self.group)
        recv_ND = permute_rows(recv_src_major, gather_N, scatter_N)
        handle = AllToAllHandle(
            num_tokens=T, top_k=K, num_recv_rows=n_recv,
            offsets_e=layout.offsets_We[r].to(torch.int32), recv_counts_e=layout.recv_counts_We[r],
            tokens_per_expert_E=slots.counts_E, order_S=slots.order_S, inverse_S=inverse_S,
            input_splits=input_splits, output_splits=output_splits, gather_N=gather_N, scatter_N=scatter_N)
        return recv_ND, handle

    def combine(self, y_ND, handle):
        self._check_combine(y_ND, handle)
        if not isinstance(handle, AllToAllHandle):
            raise TypeError(f"handle must come from AllToAllDispatcher.dispatch, got {type(handle).__name__}")
        y_src_major = permute_rows(y_ND, handle.scatter_N, handle.gather_N)
        y_sorted_SD = all_to_all_rows(y_src_major, handle.input_splits, handle.output_splits, self.group)
        y_SD = permute_rows(y_sorted_SD, handle.inverse_S, handle.order_S)
        return y_SD.view(handle.num_tokens, handle.top_k, y_ND.shape[1])
