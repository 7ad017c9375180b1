"""The overlapped hierarchical dispatch (``ExchangeConfig(overlap=True)`` on a buffer set with a
hierarchical part, a static capacity, more than one node): the inter-node leg's token rows land
while the fused gate/up GEMM computes the rows already present -- those of this rank's node, which
crossed NVLink inside the op. :class:`HierRowsOverlap` is its receive plan, an
:class:`tlx_dist.fused.arrival.ArrivalPlan` (the fused layer declares what it calls; nothing here
imports it).

Legend: W ranks in N nodes of L ranks, T_max tokens a rank, e local experts, R = W * T_max receive
rows, D hidden.

The op (``hier.dispatch_steps`` with ``overlap``) sends everything of the inter-node leg but the
token rows -- counts, HMETA, gates (``_hier_send_kernel`` SPLIT=1) -- the relays forward the
metadata (``_relay_forward_kernel`` SPLIT=1), and the expand kernel lays the rows out and copies
this node's rows out of RECV; the op does not end there. After it, on the side stream (real
ranks; in line in the emulated world, whose ranks run one after another), each rank sends its
other-node token rows to their relays (SPLIT=2: HRROWS adds), and each relay forwards them to
its node's owners (SPLIT=2: HFROWS adds) and ends the op -- so no peer's next op starts before
the rows it forwards have landed, and the next op on this rank must join the side stream first
(:func:`settle`). :meth:`HierRowsOverlap.wait` waits for HFROWS and copies the other nodes'
rows out of RECV.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .buffers import SymmBuffers
from . import launch as flat
from .hier_launch import HierHandle, HierRoute, _hier_reduce_send, _hier_send, _relay_forward
from .tuning import _next_pow2

__all__ = ["HierRowsOverlap", "hier_rows_overlap", "far_rows_send", "far_rows_forward", "settle"]

_PLAN = "hier"  # SymmBuffers._overlap_plans key of the set's last overlapped hierarchical dispatch


class HierRowsOverlap:
    """The receive plan of an overlapped hierarchical dispatch: the op ended once every source's
    metadata and this node's token rows were in place; the other nodes' token rows are still on
    their way (sent, and forwarded by the relays, on the side stream of each rank).

    ``offsets_V``: ``[3e]`` int32, each local expert's expert-major rows as three runs (sources on
    nodes before this rank's | this node's sources, already present | sources on nodes after),
    cumulative ends: what the gate/up GEMM's first launch computes while the rows land
    (:func:`tlx_dist.fused.fused_experts_rows` ``overlap=``). ``present_rows``: ``(lo, hi)``
    receive rows of this node's sources (``[node*L*T_max, (node+1)*L*T_max)``). ``side_sms``: the
    side stream's SM budget (``ExchangeConfig.overlap_sms``). :meth:`wait` enqueues the arrival wait
    (one program; bounded, a relay that never forwards is reported by ``check()`` like every
    exchange wait) and the copy of the other nodes' rows into ``recv_RD`` on the current stream
    (the rows their sources sent, nothing past them);
    :meth:`finish` (the combine calls it, and so does the set's next op) waits if nobody did and
    joins the side stream into the current one."""

    def __init__(self, handle: HierHandle, recv_RD: torch.Tensor, offsets_V: torch.Tensor, side_sms: int,
                 side_done: Optional[torch.cuda.Event]):
        bufs = handle.buffers
        L, Lh = bufs.layout, bufs.hier.layout.ranks_per_node
        node = bufs.rank // Lh
        self.buffers = bufs
        self.offsets_V, self.side_sms, self.side_done = offsets_V, side_sms, side_done
        self.offsets_e = handle.offsets_e
        self.present_rows = (node * Lh * L.max_tokens, (node + 1) * Lh * L.max_tokens)
        r = handle.route
        self._far_W = r.rows_from_near_W.neg().add_(handle.rows_from_W)  # rows from each other-node source
        # The receive rows the GEMMs read (a view without autograd history: the plan must not keep a
        # step's graph alive) -- dropped once the plan is finished.
        self._x: Optional[torch.Tensor] = recv_RD.detach()
        # the combine's early kernel reads the handle without the caller's gates and without the plan
        self._handle = dataclasses.replace(handle, gate_TK=None, overlap=None)
        self.waited = False
        self.joined = False
        self.partials_sent: Optional[int] = None  # data_ptr of the part_RD whose far rows left early

    def wait(self) -> None:
        """Enqueues, on the current stream (once): the wait for every other-node source's rows
        (their counts taken off HFROWS), then their copy out of RECV into the receive rows."""
        if self.waited:
            return
        self.waited = True
        bufs = self.buffers
        flat.kernels(bufs.device)._rows_wait_kernel[(1,)](self._far_W, bufs.peers, bufs.rank,
                                                          bufs.hier.layout.off_hfrows, W=bufs.world_size,
                                                          num_warps=1, **flat._wait(bufs))
        lo, hi = self.present_rows
        recv, x = bufs.recv_rows(), self._x
        R, D = x.shape
        br, bd = 16, min(256, _next_pow2(D))
        # only the rows each source sent (those past its count are never read)
        flat.kernels(bufs.device)._landed_rows_copy_kernel[(-(-R // br), -(-D // bd))](
            recv, x, self._far_W, lo, hi, R, bufs.layout.max_tokens, D, recv.stride(0), x.stride(0),
            BLOCK_R=br, BLOCK_D=bd, num_warps=4)

    def check_rows(self, src_N, dst_N, offsets_E, num_dst: int, num_local: int) -> None:
        """What the overlapped forward assumes of the call it serves (checked before it launches
        anything): this dispatch's row form -- ``dst_N`` is ``src_N``, one output row per receive
        row, this dispatch's ``offsets_e``, its number of local experts."""
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
        """The other nodes' partial rows of ``part_RD`` are final (the down GEMM's far runs are done):
        their first leg -- into the relay of this node that sums them (``_hier_reduce_send_kernel``)
        -- goes now, on the side stream after what the current stream enqueued (in line in the
        emulated world); the combine (``combine_rows`` with this same ``part_RD``) then sends this
        node's rows, lets the relays sum and send home, and receives. With ``acc_RD`` (the fp32
        accumulator the rows come from) the same kernel rounds them once, sends them and writes them
        into ``part_RD`` (every row outside ``present_rows``; zeros past a source's count): one pass
        over the rows instead of a cast and a send; those rows of ``part_RD`` are there once
        :meth:`finish` joined the side stream (the combine does)."""
        if self.partials_sent is not None:
            raise RuntimeError("send_partials: this dispatch's partial rows were already sent")
        if acc_RD is not None and (acc_RD.shape != part_RD.shape or acc_RD.device != part_RD.device
                                   or not (acc_RD.is_contiguous() and part_RD.is_contiguous())):
            raise ValueError(f"acc_RD {tuple(acc_RD.shape)} must be part_RD's shape {tuple(part_RD.shape)} "
                             "on its device, both contiguous (the send kernel reads and writes whole rows)")
        self.wait()
        bufs = self.buffers
        y = part_RD if acc_RD is None else acc_RD
        done = flat.on_side(bufs, lambda: _hier_reduce_send(bufs, y, self._handle, gated=False, rows=True,
                                                            part=None if acc_RD is None else part_RD),
                            part_RD, y)
        if done is not None:
            self.side_done = done
        self.partials_sent = part_RD.data_ptr()

    def join(self) -> None:
        """The current stream waits for what the side stream did so far."""
        if self.side_done is not None:
            torch.cuda.current_stream(self.buffers.device).wait_event(self.side_done)

    def finish(self) -> None:
        """Waits if nobody did, and joins the side stream (once); the set forgets the plan."""
        self.wait()
        if not self.joined:
            self.joined = True
            self.join()
            self._x = None
            if self.buffers._overlap_plans.get(_PLAN) is self:
                del self.buffers._overlap_plans[_PLAN]


def settle(bufs: SymmBuffers) -> None:
    """At the start of every op of a hierarchical set: an overlapped dispatch not finished yet (its
    forward abandoned before the combine) is finished now -- its rows' counts taken off, the side
    stream that ends its op joined -- so this op starts after it, as every peer's does."""
    plan = bufs._overlap_plans.get(_PLAN)
    if plan is not None and not plan.joined:
        plan.finish()


def far_rows_send(bufs: SymmBuffers, x_TD: torch.Tensor, route: HierRoute, send_row_TW: torch.Tensor,
                  side_sms: int) -> Optional[torch.cuda.Event]:
    """The other-node token rows to their relays (``_hier_send_kernel`` SPLIT=2, ``side_sms``
    programs), on the side stream (``launch.on_side``)."""
    return flat.on_side(bufs, lambda: _hier_send(bufs, x_TD, route, send_row_TW, split=2, programs=side_sms),
                        x_TD, route.nrow_TN, send_row_TW)


def far_rows_forward(bufs: SymmBuffers, route: HierRoute, side_sms: int) -> Optional[torch.cuda.Event]:
    """The relay's forward of those rows to its node's owners, the op's last kernel
    (``_relay_forward_kernel`` SPLIT=2 END), on the side stream."""
    return flat.on_side(bufs, lambda: _relay_forward(bufs, route, from_region=False, split=2, programs=side_sms,
                                                     end=True), route.hmeta_RM, route.hcnt_W)


def hier_rows_overlap(h: HierHandle, recv_RD: torch.Tensor, starts: torch.Tensor, lay: torch.Tensor, cap: int,
                      side_sms: int, side_done) -> HierRowsOverlap:
    """The plan of an overlapped hierarchical dispatch: ``offsets_V`` from the layout the expand
    kernel computed (one launch of ``_phase_offsets_kernel``, the present sources this node's)."""
    bufs = h.buffers
    L, Lh = bufs.layout, bufs.hier.layout.ranks_per_node
    E, W = L.num_experts, L.world_size
    e = E // W
    node = bufs.rank // Lh
    offsets_V = torch.empty(3 * e, dtype=torch.int32, device=bufs.device)
    flat.kernels(bufs.device)._phase_offsets_kernel[(1,)](starts, lay[E:E + e], h.offsets_e, offsets_V, node * Lh,
                                                          (node + 1) * Lh, cap, W=W, E_LOCAL=e, EP=_next_pow2(e),
                                                          num_warps=1)
    plan = HierRowsOverlap(h, recv_RD, offsets_V, side_sms, side_done)
    bufs._overlap_plans[_PLAN] = plan
    return plan
