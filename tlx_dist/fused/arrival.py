"""What the fused EP forward needs of an overlapped dispatch's receive plan: :class:`ArrivalPlan`.

An overlapped dispatch returns before some sources' token rows have landed in the receive rows
``x_RD``; its plan tells the fused GEMMs which expert-major rows are present now -- a contiguous
range of sources: this rank's own rows (the flat exchange), or every source of this rank's node
(the hierarchical one, whose other nodes' rows come over the slow inter-node leg) -- and how to
wait for the rest. The fused layer depends on this protocol only; the symmetric exchange's
``tlx_dist.comm.symm.RowsOverlap`` and ``HierRowsOverlap`` implement it (nothing here imports them).

Legend: e local experts, R receive rows (``W * T_max``), N expert-major rows.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

__all__ = ["ArrivalPlan"]


@runtime_checkable
class ArrivalPlan(Protocol):
    """The receive plan of an overlapped dispatch, as the fused forward uses it.

    Attributes:
        offsets_V: ``[3e]`` int32 cumulative ends of each local expert's expert-major rows as three
            runs -- rows from sources before the present ones | the present sources' rows | rows
            from sources after -- the "virtual experts" of the phased gate/up and down GEMMs.
        present_rows: ``(lo, hi)``: the receive rows of the present sources (already there when
            the dispatch returns; their partial rows are computed last, and leave with the combine).
        side_sms: SMs the dispatch's side-stream work keeps busy while the GEMMs compute the
            present rows (the GEMMs' first launches take the rest).
    """

    offsets_V: torch.Tensor
    present_rows: tuple[int, int]
    side_sms: int

    def check_rows(self, src_N: torch.Tensor, dst_N: torch.Tensor, offsets_E: torch.Tensor, num_dst: int,
                   num_local: int) -> None:
        """Raises ValueError unless the call the plan serves is the dispatch's own row form
        (``dst_N`` is ``src_N``, one output row per receive row, the dispatch's ``offsets_E`` and
        ``num_local`` experts); called before anything is launched."""
        ...

    def wait(self) -> None:
        """Enqueues on the current stream the wait for every other source's rows (bounded;
        idempotent); the rows are in ``x_RD`` for what the stream runs after it."""
        ...

    def send_partials(self, part_RD: torch.Tensor, acc_RD: Optional[torch.Tensor] = None) -> None:
        """Sends the partial rows of ``part_RD`` (``[R, D]``) outside ``present_rows`` -- final, the
        present rows still being computed -- on their way home ahead of the combine, which must
        then get ``part_RD`` as it is. ``acc_RD`` (``[R, D]``, the accumulator those rows are
        rounded from, once): the plan writes them into ``part_RD`` itself (where it can, in the
        pass that sends them); they are in ``part_RD`` for what runs after :meth:`finish`."""
        ...

    def finish(self) -> None:
        """Waits if nobody did and joins the dispatch's side stream into the current one."""
        ...
