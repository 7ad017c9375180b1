"""Dispatch layout math, shared by every dispatcher backend. Pure tensor ops: no host sync.

Legend: T tokens on this rank, K top-k, S = T*K (token, k) slots, W ranks in the expert-parallel
group, E global experts, e = E/W local experts (rank d owns global experts [d*e, (d+1)*e)).

Receive layout on rank d (what the grouped GEMM consumes) is **expert-major, source-minor**:

    [ local expert 0: rows from src 0 | src 1 | ... | src W-1 ][ local expert 1: ... ] ... [ padding ]

Within one (src, expert) block, rows keep the source's slot order (token-major, then k).
From the all-gathered count matrix ``C_WE[s, g]`` (slots rank s sends to global expert g):

    recv_counts_e(d)   = sum_s C[s, d*e:(d+1)*e]
    offsets_e(d)       = cumsum(recv_counts_e(d))                       (end rows, int32)
    block_start_WE[s,g] = excl_cumsum_j(recv_counts(g's rank))[g % e] + excl_cumsum_s(C[:, g])[s]

and slot i of rank s, routed to expert g as the q-th slot of s for g, lands on row
``block_start_WE[s, g] + q`` of rank ``g // e``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SlotOrder", "sort_slots", "Layout", "layout_from_counts", "dest_rows"]


def _excl_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(t, dim=dim) - t


@dataclass(frozen=True)
class SlotOrder:
    """This rank's slots sorted by global expert (stable, so token order is kept within an expert).

    order_S: ``[S]`` slot ids (t*K + k) in expert-major order.
    counts_E: ``[E]`` int64 slots per global expert.
    rank_in_expert_S: ``[S]`` for the i-th sorted slot, its position q among this rank's slots
        for the same expert.
    """

    order_S: torch.Tensor
    counts_E: torch.Tensor
    rank_in_expert_S: torch.Tensor


def sort_slots(idx_TK: torch.Tensor, num_experts: int) -> SlotOrder:
    flat_S = idx_TK.reshape(-1).long()
    order_S = torch.sort(flat_S, stable=True).indices
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_TK.device)
    counts_E.scatter_add_(0, flat_S, torch.ones_like(flat_S))
    sorted_expert_S = flat_S[order_S]
    start_E = _excl_cumsum(counts_E, 0)
    rank_in_expert_S = torch.arange(flat_S.numel(), device=idx_TK.device) - start_E[sorted_expert_S]
    return SlotOrder(order_S, counts_E, rank_in_expert_S)


@dataclass(frozen=True)
class Layout:
    """Where every (source rank, global expert) block lands. All int64 on the counts' device.

    counts_WE: ``[W, E]`` the all-gathered send counts.
    block_start_WE: ``[W, E]`` first destination row of block (s, g) on rank g // e.
    recv_counts_We: ``[W, e]`` rows each rank receives per local expert.
    offsets_We: ``[W, e]`` cumulative end rows of each rank's local experts.
    """

    counts_WE: torch.Tensor
    block_start_WE: torch.Tensor
    recv_counts_We: torch.Tensor
    offsets_We: torch.Tensor

    @property
    def world_size(self) -> int:
        return self.counts_WE.shape[0]

    @property
    def num_local_experts(self) -> int:
        return self.recv_counts_We.shape[1]


def layout_from_counts(counts_WE: torch.Tensor) -> Layout:
    """Receive layout of every rank from the all-gathered ``[W, E]`` send counts."""
    W, E = counts_WE.shape
    if E % W:
        raise ValueError(f"counts_WE has E={E} experts, not divisible by W={W} ranks")
    e = E // W
    c = counts_WE.long()
    per_expert_E = c.sum(0)                                   # rows each global expert receives
    recv_counts_We = per_expert_E.view(W, e)
    expert_start_E = _excl_cumsum(recv_counts_We, 1).reshape(E)   # start of expert g on its rank
    block_start_WE = expert_start_E.unsqueeze(0) + _excl_cumsum(c, 0)
    offsets_We = torch.cumsum(recv_counts_We, 1)
    return Layout(c, block_start_WE, recv_counts_We, offsets_We)


def dest_rows(layout: Layout, src_rank: int, slots: SlotOrder, idx_TK: torch.Tensor) -> torch.Tensor:
    """``[S]`` destination row (on rank ``g // e``) of each slot of ``src_rank``, in *sorted* order."""
    sorted_expert_S = idx_TK.reshape(-1).long()[slots.order_S]
    return layout.block_start_WE[src_rank][sorted_expert_S] + slots.rank_in_expert_S
