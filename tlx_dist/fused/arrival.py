"""What the fused EP forward needs of an overlapped dispatch's receive plan: :class:`ArrivalPlan`.

An overlapped dispatch returns before the peers' token rows have landed in the receive rows
``x_RD``; its plan tells the fused GEMMs which expert-major rows are already there (this rank's
own) and how to wait for the rest. The fused layer depends on this protocol only; the symmetric
exchange's ``tlx_dist.comm.symm.RowsOverlap`` is one implementation (nothing here imports it).

Legend: e local experts, R receive rows (``W * T_max``), N expert-major rows.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["ArrivalPlan"]


@runtime_checkable
class ArrivalPlan(Protocol):
    """The receive plan of an overlapped dispatch, as the fused forward uses it.

    Attributes:
        offsets_V: ``[3e]`` int32 cumulative ends of each local expert's expert-major rows as three
            runs -- rows from sources before this rank | this rank's own rows (present) | rows from
            sources after -- the "virtual experts" of the phased gate/up and down GEMMs.
        own_rows: ``(lo, hi)``: the receive rows of this rank's own tokens (already present; their
            partial rows never leave this rank).
        side_sms: SMs the dispatch's side-stream send keeps busy while the GEMMs compute the own
            rows (the GEMMs' first launches take the rest).
    """

    offsets_V: torch.Tensor
    own_rows: tuple[int, int]
    side_sms: int

    def check_rows(self, src_N: torch.Tensor, dst_N: torch.Tensor, offsets_E: torch.Tensor, num_dst: int,
                   num_local: int) -> None:
        """Raises ValueError unless the call the plan serves is the dispatch's own row form
        (``dst_N`` is ``src_N``, one output row per receive row, the dispatch's ``offsets_E`` and
        ``num_local`` experts); called before anything is launched."""
        ...

    def wait(self) -> None:
        """Enqueues on the current stream the wait for every peer's rows (bounded; idempotent)."""
        ...

    def send_partials(self, part_RD: torch.Tensor) -> None:
        """Sends the peers' partial rows of ``part_RD`` (``[R, D]``, final for every receive row but
        this rank's own) home ahead of the combine, which must then get ``part_RD`` as it is."""
        ...

    def finish(self) -> None:
        """Waits if nobody did and joins the dispatch's side stream into the current one."""
        ...
