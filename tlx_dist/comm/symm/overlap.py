"""The overlapped row form's receive plan (``ExchangeConfig(overlap=True)``): :class:`RowsOverlap`,
what the fused GEMMs wait on while the peers' rows land, and the side-stream send behind it.
:class:`RowsOverlap` is the exchange's :class:`tlx_dist.fused.arrival.ArrivalPlan` (the fused layer
declares what it calls; nothing here imports it)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .buffers import SymmBuffers
from .ce_transport import ce_ready, ce_send_partials
from .handle import SymmHandle
from .launch import kernels, on_side, reduce_send, rows_wait, send_tokens
from .tuning import _next_pow2, reduce_recv_shape

__all__ = ["RowsOverlap", "rows_overlap", "send_rows_side", "finish_abandoned"]


class RowsOverlap:
    """The receive plan of an overlapped row-form dispatch (``ExchangeConfig(overlap=True)``): the
    op ended once every peer's META and gates landed; the peers' token rows are still on their way
    into this rank's receive region, sent by a kernel on a side stream of each rank.

    ``offsets_V``: ``[3e]`` int32, each local expert's expert-major rows as three runs (sources
    before this rank | this rank's own rows, already present | sources after), cumulative ends:
    what the gate/up GEMM's first launch computes while the rows land
    (:func:`tlx_dist.fused.fused_experts_rows` ``overlap=``). ``side_sms``: the send's SM budget
    (``ExchangeConfig.overlap_sms``). ``present_rows``: ``(lo, hi)`` receive rows of this rank's own
    tokens, present on return (their partial rows never cross a link).
    :meth:`wait` enqueues the arrival wait (one program; bounded, an unarrived peer is reported by
    ``check()`` like every exchange wait) on the current stream; :meth:`finish` (the combine calls
    it) waits if nobody did and joins the side stream into the current one."""

    def __init__(self, handle: "SymmHandle", region: int, offsets_V: torch.Tensor, side_sms: int,
                 side_done: Optional[torch.cuda.Event]):
        bufs = handle.buffers
        self.buffers, self.region, self.rows_from_W = bufs, region, handle.rows_from_W
        self.offsets_V, self.side_sms, self.side_done = offsets_V, side_sms, side_done
        self.offsets_e = handle.offsets_e
        # What the combine's first kernel reads (send_partials): the handle without the caller's
        # gates (gate_TK carries the router's autograd graph: held here, and by the buffers until the
        # next dispatch into this region, it would keep that step's AccumulateGrad nodes, made on
        # another stream, alive into a later CUDA-graph capture, whose backward then fails) and
        # without the plan itself.
        self._handle = dataclasses.replace(handle, gate_TK=None, overlap=None)
        self.waited = False
        self.joined = False
        L = bufs.layout
        # the receive rows of this rank's own tokens (their partial rows never cross a link)
        self.present_rows = (bufs.rank * L.max_tokens, (bufs.rank + 1) * L.max_tokens)
        # data_ptr of the part_RD whose peers' rows went home early (send_partials); not the tensor,
        # which carries the autograd graph (held here, it would keep the graph's AccumulateGrad nodes,
        # and their streams, alive into the next step: a CUDA-graph capture then fails)
        self.partials_sent: Optional[int] = None

    def wait(self) -> None:
        """Enqueues the arrival wait on the current stream (once)."""
        if self.waited:
            return
        self.waited = True
        rows_wait(self.buffers, self.region, self.rows_from_W)

    def check_rows(self, src_N, dst_N, offsets_E, num_dst: int, num_local: int) -> None:
        """What the overlapped forward assumes of the call it serves (checked before it launches
        anything): the row form of this dispatch -- each row's destination its receive row
        (``dst_N`` is ``src_N``), one output row per receive row, this dispatch's ``offsets_e``."""
        L = self.buffers.layout
        if dst_N is not src_N and (dst_N.data_ptr() != src_N.data_ptr() or dst_N.shape != src_N.shape):
            raise ValueError("an overlapped dispatch's rows go back to their receive rows: dst_N must be src_N")
        if num_dst != L.recv_rows:
            raise ValueError(f"num_dst={num_dst}: an overlapped dispatch's output has one row per receive row "
                             f"({L.recv_rows} = W*T_max)")
        if offsets_E.data_ptr() != self.offsets_e.data_ptr():
            raise ValueError("offsets_E must be this dispatch's handle.offsets_e (the overlap's runs cut them)")
        if num_local * 3 != self.offsets_V.shape[0]:
            raise ValueError(f"the weights hold {num_local} experts, the dispatch {self.offsets_V.shape[0] // 3}")

    def send_partials(self, part_RD: torch.Tensor, acc_RD: Optional[torch.Tensor] = None) -> None:
        """The combine's first kernel (``reduce_send``, row form) launched early: the peers'
        partial rows of ``part_RD`` are final (the down GEMM's peer runs are done), this rank's own
        are still being computed on the current stream. Real ranks: on the side stream, after what
        the current stream enqueued, ``side_sms`` programs; the combine (``combine_rows``, with this
        same ``part_RD``) then only joins and receives. The emulated world: in line. With ``acc_RD``
        (the fp32 accumulator of the rows) the peers' rows of ``part_RD`` are first cast from it on
        the current stream."""
        if self.partials_sent is not None:
            raise RuntimeError("send_partials: this dispatch's partial rows were already sent")
        if acc_RD is not None:
            if acc_RD.shape != part_RD.shape or acc_RD.device != part_RD.device:
                raise ValueError(f"acc_RD {tuple(acc_RD.shape)} must be part_RD's shape {tuple(part_RD.shape)} "
                                 "on its device")
            lo, hi = self.present_rows
            part_RD[:lo].copy_(acc_RD[:lo])
            part_RD[hi:].copy_(acc_RD[hi:])
        self.wait()
        bufs = self.buffers
        if self._handle.dense:  # copy-engine row form: the partial rows go by copy engines
            reduce_recv_shape(bufs, self._handle.num_tokens, blk=True, dense=True)  # (a bad tile raises first)
            self.join()  # (the dispatch's copies) then: ready, and the copies on the side streams
            ce_ready(bufs)
            done = ce_send_partials(bufs, part_RD, self._handle)
        else:
            done = on_side(bufs, lambda: reduce_send(bufs, part_RD, self._handle, gated=False, rows=True,
                                                     programs=self.side_sms), part_RD)
        if done is not None:
            self.side_done = done
        self.partials_sent = part_RD.data_ptr()

    def join(self) -> None:
        """The current stream waits for what the side stream did so far (the rows' send)."""
        if self.side_done is not None:
            torch.cuda.current_stream(self.buffers.device).wait_event(self.side_done)

    def finish(self) -> None:
        """Waits if nobody did, and joins the side stream (once)."""
        self.wait()
        if not self.joined:
            self.joined = True
            self.join()


def send_rows_side(bufs: SymmBuffers, x_TD: torch.Tensor, send_row_TW: torch.Tensor, own_rows: torch.Tensor,
                   region: int, side_sms: int) -> Optional[torch.cuda.Event]:
    """The overlapped dispatch's second half (``send_tokens`` ``split=2``): every peer's token rows
    into its region ``region``, each of ``side_sms`` programs (one an SM) adding its rows to the
    destination's region counter when done; on the side stream (``on_side``)."""
    return on_side(bufs, lambda: send_tokens(bufs, x_TD, send_row_TW, None, None, None, None, with_meta=False,
                                             own_rows=own_rows, region=region, split=2, programs=side_sms),
                   x_TD, send_row_TW)


def finish_abandoned(bufs: SymmBuffers, region: int) -> None:
    """An overlapped dispatch into this region whose rows were never waited for (its forward was
    abandoned before the GEMMs): take its rows off the region counters now, or the next dispatch's
    wait would count them as its own. (The counters are additive and each wait subtracts exactly its
    dispatch's rows, so the order of the two waits does not matter.)"""
    prev = bufs._overlap_plans.pop(region, None)
    if prev is not None and not prev.joined:
        prev.finish()


def rows_overlap(h: SymmHandle, region: int, starts: torch.Tensor, lay: torch.Tensor, cap: int, side_sms: int,
                 side_done) -> RowsOverlap:
    """The overlapped dispatch's :class:`RowsOverlap`: ``offsets_V`` from the layout the expand
    kernel computed (one launch of ``_phase_offsets_kernel``)."""
    bufs = h.buffers
    L = bufs.layout
    E, W = L.num_experts, L.world_size
    e = E // W
    offsets_V = torch.empty(3 * e, dtype=torch.int32, device=bufs.device)
    kernels(bufs.device)._phase_offsets_kernel[(1,)](starts, lay[E:E + e], h.offsets_e, offsets_V, bufs.rank,
                                                     bufs.rank + 1, cap, W=W, E_LOCAL=e, EP=_next_pow2(e), num_warps=1)
    return RowsOverlap(h, region, offsets_V, side_sms, side_done)
