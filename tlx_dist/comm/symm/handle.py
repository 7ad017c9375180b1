"""What a dispatch leaves for its combine and backward: :class:`SymmHandle`, and the expanded-row
capacity (``"exact"``, ``"worst"``, a factor of ``T_max*K`` or a row count)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..dispatcher import DispatchHandle
from .buffers import SymmBuffers

__all__ = ["SymmHandle", "Capacity", "check_capacity", "expanded_rows"]

Capacity = Union[str, float, int]


@dataclass(frozen=True)
class SymmHandle(DispatchHandle):
    """What combine and the backward need. ``num_recv_rows`` is N (expanded rows).

    send_row_TW: ``[T, W]`` int32 row of token t within this rank's block on rank d (-1: not sent).
    rows_to_W: ``[W]`` int64 token rows sent to each rank. rows_from_W: ``[W]`` int64 received from each.
    pos_RK: ``[R, K]`` int32 expanded row of received row n's slot k (-1: that expert is elsewhere,
        or row n is empty); row n came from source ``n // T_max``.
    gate_RK: ``[R, K]`` gates of the received rows (activation dtype). tok_R: ``[R]`` int32 their source token ids.
    src_map_N: ``[N]`` int32 ``n*K + k`` of each expanded row (the gather index of a fused GEMM;
        undefined past ``offsets_e[-1]``).
    gate_TK: the gates given to dispatch (combine must get the same tensor).
    ``order_S`` / ``inverse_S`` are None: no slot sort happens (the layout kernels rank slots in place).
    overlap: the receive plan of an overlapped row-form dispatch (:class:`RowsOverlap`), else None.
    """

    send_row_TW: torch.Tensor
    rows_to_W: torch.Tensor
    rows_from_W: torch.Tensor
    pos_RK: torch.Tensor
    gate_RK: torch.Tensor
    tok_R: torch.Tensor
    src_map_N: torch.Tensor
    gate_TK: Optional[torch.Tensor]
    buffers: SymmBuffers
    overlap: Optional["RowsOverlap"] = None  # (overlap.py; not imported here: it imports this file)
    dense: bool = False  # the copy-engine row form's dense layout (``policy.ce_mode``): receive row of token t = t


def check_capacity(capacity: Capacity) -> Capacity:
    """``capacity`` if it is one (ValueError naming it otherwise)."""
    if isinstance(capacity, str):
        if capacity not in ("exact", "worst"):
            raise ValueError(f"capacity={capacity!r} must be 'exact', 'worst', a float factor > 0 or a positive int")
    elif isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not (0 < capacity < math.inf):
        raise ValueError(f"capacity={capacity!r} must be 'exact', 'worst', a float factor > 0 or a positive int")
    return capacity


def expanded_rows(capacity: Capacity, bufs: SymmBuffers) -> Optional[int]:
    """Static expanded rows for ``capacity`` (None for ``"exact"``)."""
    L = bufs.layout
    if capacity == "exact":
        return None
    if capacity == "worst":
        return L.worst_case_rows
    if isinstance(capacity, float):
        return max(1, min(L.worst_case_rows, math.ceil(capacity * L.max_tokens * L.top_k)))
    return capacity


def _check_bufs(bufs: SymmBuffers, x_TD: torch.Tensor, K: int, num_experts: int) -> None:
    L = bufs.layout
    bufs._check_open()
    if x_TD.dtype != L.dtype:
        raise TypeError(f"x_TD.dtype={x_TD.dtype} differs from the symmetric buffers' dtype {L.dtype}")
    if x_TD.shape[1] != L.hidden:
        raise ValueError(f"x_TD has D={x_TD.shape[1]} but the symmetric buffers were built for hidden={L.hidden}")
    if x_TD.shape[0] > L.max_tokens:
        raise ValueError(f"x_TD has T={x_TD.shape[0]} tokens, more than the buffers' max_tokens={L.max_tokens}")
    if K != L.top_k:
        raise ValueError(f"idx_TK has K={K} but the symmetric buffers were built for top_k={L.top_k}")
    if num_experts != L.num_experts:
        raise ValueError(f"num_experts={num_experts} differs from the buffers' num_experts={L.num_experts}")
    if x_TD.device != bufs.device:
        raise ValueError(f"x_TD is on {x_TD.device} but the symmetric buffers are on {bufs.device}")
