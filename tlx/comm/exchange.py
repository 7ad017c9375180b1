"""Deduplicated token exchange over symmetric memory: the phase kernels of dispatch and combine.

Files: this one (the overview below; it re-exports every phase kernel, which the host launches
through it), ``route.py`` (phase 1 of a dispatch), ``send.py`` (the send and the row form's
receiving programs), ``expand.py`` (the expand kernel), ``reduce.py`` (reduce-send, reduce-receive,
gate-gradient receive), ``rows_overlap.py`` (the overlapped row form's wait, landed-row copy and offsets),
``copy_engine.py`` (the copy-engine row form's ready / signal / fix-up kernels) and
``protocol.py`` (bounded waits, the count post, the barrier and layout pass, arrival adds,
end-of-op readiness, the NVSHMEM route's puts and signals).

Legend: W ranks, E global experts, e = E/W local experts, K top-k, T tokens of this rank (at most
T_MAX), D hidden, R = W * T_MAX receive rows, N_EXP expanded (expert-major) rows of this rank.

A token crosses to a destination rank **once**, however many of that rank's experts it picked,
with its per-k metadata; the receiver expands it into the expert-major rows the grouped GEMMs
read, and the combine sums a token's local expert outputs on the owning rank and sends one row
back per (token, rank).

Symmetric region of every rank (byte offsets are constexprs from the host; ``peers[d]`` + offset):
    STATE  [8]      int64  [0] epoch (this rank's current op, from 1), [1] sticky overflow flag,
                           [2] error word, [3] done counter of the op's last kernel (``_end_op``)
    FLAGS  [2W]     int64  [0:W) FLAGS[s] = the op rank s is ready for (raised when it ended the
                           one before; 1 at creation), [W:2W) CFLAGS[s] = the dispatch whose counts
                           rank s posted here
    ARRIVE [3W]     int64  [0:W) token rows from src s, [W:2W) combine rows from rank d,
                           [2W:3W) gate-gradient rows from rank d
    COUNTS [2,W,NC] int64  per-source count vectors (NC = E + W: slots per global expert, then
                           token rows sent to each rank), double-buffered by epoch parity
    META   [R, K+1] int32  per received token row: expanded row of each k-slot on this rank (-1:
                           that slot's expert lives elsewhere; with RAW_META the raw code q*e + j of
                           local expert j, decoded by the expand kernel), then the source token id
    GATES  [R, K]          the K gates of each received row, in the activation dtype
    RECV   [R, D]          token rows; rows [s*T_MAX, s*T_MAX + rows_from[s]) come from source s
                           != RANK (a rank's own rows stay in x, or go straight to the row form's output)
    COMB   [W, T_MAX, D]   combine partial sums: row (d, t) = sum of rank d's expert outputs of t
                           (row form: (RANK, t) unused, the own partial row is read where it is); a
                           rank's rows are contiguous, so a copy engine can move them (``copy_engine.py``)
    DGATE  [T_MAX, K] f64  gate gradients of combine's backward, written by the owning rank (ACC)
    RBLK   [W, NRB]    int64  row form: RBLK[s, j] = rows of RECV block j of source s (RB rows each,
                           ``SymmLayout.recv_block``) landed so far; the sender adds after each of its
                           token blocks, the receive-side copy (``_copy_arrived``) waits for the
                           block's row count, copies the block out and zeroes the counter
  staging, only with the NVSHMEM backend (sources of NVSHMEM puts must be symmetric memory):
    SROWS  [T_MAX, D]      token rows (x or dy) of this rank bound for another node, staged once
                           per token whichever ranks receive it
    SMETA  [T_MAX, W, K+1] int32  META row of (token, destination) for off-node destinations
    SGATES [T_MAX, K]      the gates of a staged token
    SCOMB  [R, D]          combine partial row of received row n whose source is off-node
    SDGATE [R, K] f64      gate gradients of received row n whose source is off-node (ACC)

One op, kernels in launch order (the emulated world launches each phase for every virtual rank
before the next, so no kernel waits on a signal raised by a later launch):
    dispatch:  _route (single-pass source layout; its last block posts the counts) | _send_tokens
               (waits for every peer's counts, computes this rank's layout, sends rows + meta)
               | _expand (copy META out, expanded rows; ends the op)            -- 3 launches
               With a static capacity (RAW_META / LAYOUT) the send waits only for every peer's
               readiness and sends raw slot codes, so the rows leave without a round trip for the
               counts; the expand kernel waits for the counts, computes the layout and decodes META.
    combine:   _reduce_send (waits for every peer's readiness, gated partial rows) | _reduce_recv
               (ends the op)                                                    -- 2 launches
    dispatch backward = combine without gates; combine backward:
               _send_tokens (waits, dy rows) | _expand (gate-scaled rows + gate gradients to
               their source) | _gate_grad_recv (ends the op)
  ("|" separates phases; the waits of a phase sit at the top of its first kernel, ``_await``; the
  op's last kernel raises this rank's readiness for its next op, ``_end_op``.)
  Row form (the fused EP pipeline; dispatch and combine's backward): the other sources' rows are
  copied out of RECV into the op's ``[W*T_MAX, D]`` output block by block as they land (RBLK). On
  real ranks over peer pointers that copy runs in the send kernel itself, in extra programs after
  the sending ones (``RECV_ROLE``), so it overlaps the transfer; the emulated world (whose ranks
  launch one after another) runs it in the expand kernel; the NVSHMEM route copies after the
  whole-op ARRIVE wait, as before.
  Overlapped row form (``tlx_dist.comm.symm.RowsOverlap``; per-layer regions over peer pointers, static capacity):
    dispatch:  _route | _send_tokens SPLIT=1 (META, gates, own rows; ARRIVE) | _expand (layout, ends
               the op) -- and after SPLIT=1, on a side stream outside the op: _send_tokens SPLIT=2
               (the peers' rows into their regions, then RCNT[region, RANK] adds); _phase_offsets
               (the GEMMs' runs); _rows_wait (before the GEMMs that read the peers' rows: waits for
               RCNT, then takes the rows off it, so it reads 0 before the region's next dispatch)
    combine:   _reduce_send on the side stream as soon as the peers' partial rows are final (the
               down GEMM's peers' runs) | _reduce_recv (after joining the side stream; ends the op)
  RCNT [row_regions, W] int64 sits after the row regions; no op end touches it.
  Copy-engine row form (``ExchangeConfig.copy_engine``; per-layer regions over peer pointers, static capacity;
  ``copy_engine.py``): the dense layout -- token t of source s at receive row s*T_MAX + t everywhere,
  every token counted to every rank (DENSE variants of _route, _send_tokens, the block sums) -- so a
  rank's rows are one run per peer, which the host copies with cuMemcpyAsync:
    dispatch:  _ce_ready | side stream: copies of x to every peer's region, _ce_signal (RCNT adds) ||
               _route DENSE | _send_tokens SPLIT=1 DENSE (META, gates, own rows) | _expand (ends the
               op) | _rows_wait (in the op, or before the GEMMs that read the peers' rows)
    combine:   _ce_ready | side stream: chunked copies of the partial rows to every source's COMB[RANK],
               each followed by a _ce_signal (CBLK adds) on a second stream; _ce_fixup where a source
               has more tokens than the copies' extent || _reduce_recv BLK DENSE (ends the op)
Every wait is bounded (``_wait_geq``): after TIMEOUT_NS it records ``op << 16 | peer`` in the
error word, and later waits on that rank return at once; the host raises ExchangeError naming the
op, the rank and the peer (``SymmBuffers.check``). Expanded rows past N_EXP are not stored, raise
the overflow flag, and count as zero in the combine: never silently.

Peers on other nodes (``USE_NVSHMEM``, only in the kernels that send: ``_route`` (the counts),
``_send_tokens``, ``_reduce_send``, ``_expand`` with GATE_GRAD, and every op's last kernel (the
readiness signal of ``_end_op``)): their ``peers[d]`` is 0 and
``pes[d]`` is their NVSHMEM PE. A sender stages what would have been peer stores in its own
symmetric region (COUNTS row RANK, which it writes anyway, or the staging regions above), then
every thread of the CTA calls one block-collective ``nvshmemx_putmem_block`` per row (per run of
gate-gradient slots) from the staged copy to the same symmetric offset on the peer; after a CTA
barrier ONE thread (``tlx/comm/nvshmem.py: one_thread``) makes the CTA's stores visible system-wide,
calls ``nvshmem_quiet`` (every put complete) and raises the same counter the peer-pointer route
raises: ``nvshmemx_signal_op`` SET epoch on FLAGS / CFLAGS[RANK], ADD rows on ARRIVE. Receivers poll their own
memory the same way on both routes. With USE_NVSHMEM=False (default) none of this is compiled.

Row pointers into the symmetric regions are made from integer addresses (peer table + layout
offset), about which Triton assumes nothing: each is wrapped in ``tl.multiple_of(..., 16)`` (every
region starts 256-byte aligned: SymmLayout's offsets and the allocations), so a row moves as
16-byte vectors instead of one 2-byte load or store per bf16 (tests/test_symm_compile.py checks the
PTX).
"""

from __future__ import annotations

from .copy_engine import _ce_fixup_kernel, _ce_ready_kernel, _ce_signal_kernel
from .expand import _expand_kernel
from .protocol import CLOCK_GLOBALTIMER, CLOCK_MEMREALTIME, CLOCK_POLLS, _wait_geq  # (read by the host and the tests)
from .reduce import _gate_grad_recv_kernel, _reduce_recv_kernel, _reduce_send_kernel
from .route import _route_kernel
from .rows_overlap import _landed_rows_copy_kernel, _phase_offsets_kernel, _rows_wait_kernel
from .send import _send_tokens_kernel

__all__ = ["_route_kernel", "_send_tokens_kernel", "_expand_kernel", "_reduce_send_kernel", "_reduce_recv_kernel",
           "_gate_grad_recv_kernel", "_rows_wait_kernel", "_landed_rows_copy_kernel", "_phase_offsets_kernel",
           "_ce_ready_kernel", "_ce_signal_kernel", "_ce_fixup_kernel", "CLOCK_POLLS", "CLOCK_GLOBALTIMER",
           "CLOCK_MEMREALTIME", "_wait_geq"]
