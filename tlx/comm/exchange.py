"""Deduplicated token exchange over symmetric memory: the phase kernels of dispatch and combine.

Files: this one (the overview below, and the data kernels: send, expand, reduce-send,
reduce-receive, gate-gradient receive), ``protocol.py`` (bounded waits, the count post, the
barrier and layout pass, arrival adds, end-of-op readiness, the NVSHMEM route's puts and
signals) and ``route.py`` (phase 1 of a dispatch).

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
  Overlapped row form (``symm.RowsOverlap``; per-layer regions over peer pointers, static capacity):
    dispatch:  _route | _send_tokens SPLIT=1 (META, gates, own rows; ARRIVE) | _expand (layout, ends
               the op) -- and after SPLIT=1, on a side stream outside the op: _send_tokens SPLIT=2
               (the peers' rows into their regions, then RCNT[region, RANK] adds); _phase_offsets
               (the GEMMs' runs); _rows_wait (before the GEMMs that read the peers' rows: waits for
               RCNT, then takes the rows off it, so it reads 0 before the region's next dispatch)
    combine:   _reduce_send on the side stream as soon as the peers' partial rows are final (the
               down GEMM's peers' runs) | _reduce_recv (after joining the side stream; ends the op)
  RCNT [row_regions, W] int64 sits after the row regions; no op end touches it.
  Copy-engine row form (``symm._ce_mode``; per-layer regions over peer pointers, static capacity;
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

import triton
import triton.language as tl

from .protocol import (  # noqa: F401  (CLOCK_*, _wait_geq: read here by the host and the tests)
    CLOCK_GLOBALTIMER,
    CLOCK_MEMREALTIME,
    CLOCK_POLLS,
    OP_COMBINE,
    OP_GATE_GRAD,
    OP_TOKENS,
    _await,
    _end_op,
    _nvshmem_put_gate_grads,
    _nvshmem_put_partials,
    _nvshmem_put_tokens,
    _publish,
    _wait_geq,
)
from .route import _route_kernel  # noqa: F401  (phase 1 of a dispatch)
from .copy_engine import _ce_fixup_kernel, _ce_ready_kernel, _ce_signal_kernel  # noqa: F401  (copy-engine row form)


@triton.jit
def _copy_arrived(out, rows_from_ptr, my, q, nq, RANK, err_ptr, DT: tl.constexpr, W: tl.constexpr,
                  T_MAX: tl.constexpr, D: tl.constexpr, OFF_RECV: tl.constexpr, OFF_RBLK: tl.constexpr,
                  RB: tl.constexpr, NRB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                  TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr):
    """The row form's receive-side copy, by program ``q`` of ``nq``: for every source s != RANK and
    its RECV blocks j = q, q + nq, ... (RB rows each, ``rows_from[s]`` rows in all), waits until
    RBLK[s, j] holds the block's row count (bounded: ``_wait_geq``, OP_TOKENS), copies receive rows
    ``s*T_MAX + [j*RB, min((j+1)*RB, rows_from[s]))`` to the same rows of ``out``, and zeroes the
    counter: its sender adds to it again only in a later op, after this rank ended this one."""
    recv = tl.multiple_of((my + OFF_RECV).to(tl.pointer_type(DT)), 16)
    ctr = (my + OFF_RBLK).to(tl.pointer_type(tl.int64))
    for s in range(W):
        if s != RANK:
            n_rows = tl.load(rows_from_ptr + s)
            for j in range(q, tl.cdiv(n_rows, RB), nq):
                lo = j * RB
                hi = tl.minimum(lo + RB, n_rows)
                c = ctr + s * NRB + j
                _wait_geq(c, hi - lo, err_ptr, OP_TOKENS, s, TIMEOUT_NS, CLOCK)
                tl.debug_barrier()
                for r0 in range(lo, hi, BLOCK_R):
                    i = r0 + tl.arange(0, BLOCK_R)
                    n = (s * T_MAX + i).to(tl.int64)
                    rm = i < hi
                    for c0 in range(0, D, BLOCK_D):
                        cols = c0 + tl.arange(0, BLOCK_D)
                        cm = rm[:, None] & (cols < D)[None, :]
                        rows = n[:, None] * D + cols[None, :]
                        tl.store(out + rows, tl.load(recv + rows, mask=cm), mask=cm)
                tl.atomic_xchg(c, 0, sem="relaxed", scope="sys")


@triton.jit
def _signal_blocks(t, tm, send_row_ptr, peers_ptr, RANK, W: tl.constexpr, OFF_RBLK: tl.constexpr,
                   RB: tl.constexpr, NRB: tl.constexpr, DENSE: tl.constexpr = False):
    """After a token block's rows went out (CTA barrier first): for each peer d != RANK, one release
    add per RECV block of d that the block's rows fell in, of the rows that fell there. A source's
    rows to d are numbered in token order (``send_row``), so a token block's rows to d are one
    contiguous run ``[lo, lo + cnt)``, which spans at most ``1 + BLOCK_T // RB`` counters. DENSE: the
    run is the block's tokens themselves (row t = token t, every token counted)."""
    tl.debug_barrier()
    for d in range(W):
        if d != RANK:
            row = tl.load(send_row_ptr + t * W + d, mask=tm, other=-1)
            sent = row >= 0
            if DENSE:
                sent = tm
                row = t
            cnt = tl.sum(sent.to(tl.int32))
            if cnt > 0:
                lo = tl.min(tl.where(sent, row, 2147483647))
                ctr = (tl.load(peers_ptr + d) + OFF_RBLK + RANK * NRB * 8).to(tl.pointer_type(tl.int64))
                for j in range(lo // RB, (lo + cnt - 1) // RB + 1):
                    a = tl.maximum(lo, j * RB)
                    e = tl.minimum(lo + cnt, j * RB + RB)
                    tl.atomic_add(ctr + j, (e - a).to(tl.int64), sem="release", scope="sys")


@triton.jit
def _send_tokens_kernel(x_ptr, stride_x, T, send_row_ptr, idx_ptr, q_ptr, start_ptr, gate_ptr, peers_ptr, RANK,
                        W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        E_LOCAL: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr, META_W: tl.constexpr,
                        OFF_ARRIVE: tl.constexpr, OFF_META: tl.constexpr, OFF_GATES: tl.constexpr,
                        OFF_RECV: tl.constexpr, WITH_META: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_D: tl.constexpr, pes_ptr=None, OFF_SROWS: tl.constexpr = 0,
                        OFF_SMETA: tl.constexpr = 0, OFF_SGATES: tl.constexpr = 0, USE_NVSHMEM: tl.constexpr = False,
                        offs_ptr=None, BARRIER: tl.constexpr = False, E: tl.constexpr = 1, EP: tl.constexpr = 1,
                        NC: tl.constexpr = 1, OFF_STATE: tl.constexpr = 0, OFF_FLAGS: tl.constexpr = 0,
                        OFF_COUNTS: tl.constexpr = 0, TIMEOUT_NS: tl.constexpr = 0, CLOCK: tl.constexpr = 0,
                        OFFS_CAP: tl.constexpr = -1, OWN_ADDR=0, LOCAL_ROWS: tl.constexpr = False,
                        LOCAL_X: tl.constexpr = False, RAW_META: tl.constexpr = False,
                        BLK_SIGNAL: tl.constexpr = False,
                        OFF_RBLK: tl.constexpr = 0, RB: tl.constexpr = 64, NRB: tl.constexpr = 1,
                        RECV_ROLE: tl.constexpr = False, N_SEND=1, rows_from_ptr=None,
                        RCV_R: tl.constexpr = 64, RCV_D: tl.constexpr = 256,
                        ROWS_REGION: tl.constexpr = False, ROWS_OFF=0, SPLIT: tl.constexpr = 0, RCNT_OFF=0,
                        DENSE: tl.constexpr = False):
    """BARRIER: first ``_await`` (with WITH_META: the layout, ``start`` = ``lay[0:E]``, and
    ``offs``, capped at OFFS_CAP when >= 0). Token t goes to row ``RANK*T_MAX + send_row[t, d]`` of every rank d with ``send_row[t, d]
    >= 0``; with WITH_META also its metadata row (the expanded row ``start[g] + q[t, k]`` of each
    slot whose expert g lives on d, else -1; then t) and ``gate[t, :]``. Then one release add per destination of the rows sent.
    USE_NVSHMEM: rows for off-node ranks are staged (SROWS/SMETA/SGATES) and put (``_nvshmem_put_tokens``).
    LOCAL_ROWS (the row form): this rank's own rows skip the shared region and go straight to row
    ``RANK*T_MAX + send_row[t, RANK]`` of the op's output ``[W*T_MAX, D]`` at address OWN_ADDR (its
    metadata still goes to META: the expand kernel reads it for every source). LOCAL_X: this rank's
    own rows are not copied at all (only their metadata); the expand kernel reads them from ``x``.
    RAW_META (with WITH_META; the static-capacity dispatch): the barrier waits only for every peer's
    readiness (FLAGS, as combine does), not for their counts, so the rows leave as soon as this
    rank's route is done; META then holds each slot's raw code ``q * E_LOCAL + j`` (j = the
    expert's index on d, q = ``q[t, k]``) and the expand kernel, which waits for the counts, turns
    it into the expanded row (``_await`` STARTS).
    ROWS_REGION (the row form, peer pointers only): the rows go to byte offset ROWS_OFF of every
    destination's region (a per-layer receive region, ``SymmLayout`` ROWS) instead of RECV, and
    stay there: no receive-side copy.
    Programs take token blocks pid, pid + N_SEND, ... so rows land at every receiver in token order.
    SPLIT (the overlapped row form, ROWS_REGION on peer pointers; ``symm.RowsOverlap``): the send in
    two launches. SPLIT=1, the op's phase 2 (BARRIER, WITH_META): every destination's META and
    gates and this rank's own rows (to OWN_ADDR), then the ARRIVE adds as usual -- so the expand
    kernel's wait covers the own rows, and everything a peer needs to lay out its rows. SPLIT=2,
    after it on a side stream, outside the op protocol (no barrier: SPLIT=1 passed it): the rows for
    every peer, then one release add per destination of this program's rows to that destination's
    region counter at RCNT_OFF + 8 * RANK (``rows_wait``, not ARRIVE: the op may have ended before
    they land, and its end zeroes ARRIVE).
    DENSE (the copy-engine row form's dense layout, ``send_row[t, d]`` = t or -1, peer pointers): the
    receive row of token t is ``RANK*T_MAX + t`` on every rank, and every token counts as sent to every
    rank -- META (empty slots for a rank t does not go to), gates, ARRIVE and RBLK adds cover all T
    tokens -- while only the routed rows (``send_row >= 0``) move.

    The row form's receive side (with LOCAL_ROWS): BLK_SIGNAL adds each token block's rows to the
    destination's RBLK counters (``_signal_blocks``); RECV_ROLE makes programs N_SEND.. of the
    launch receivers, not senders: after ``_await`` they copy the other sources' rows (``rows_from``
    of each) from this rank's RECV to OWN_ADDR as they land (``_copy_arrived``). Receivers only wait
    for peers' senders, and senders never wait for receivers, so the receiving programs (the last
    ones, fewer than the GPU holds at once) cannot starve the sending ones."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if BARRIER:
        if RAW_META:
            _await(peers_ptr, start_ptr, offs_ptr, RANK, W, WP, E, EP, E_LOCAL, NC, OFF_STATE, OFF_FLAGS, OFF_COUNTS,
                   False, TIMEOUT_NS, CLOCK, OFFS_CAP)
        else:
            _await(peers_ptr, start_ptr, offs_ptr, RANK, W, WP, E, EP, E_LOCAL, NC, OFF_STATE, OFF_FLAGS, OFF_COUNTS,
                   WITH_META, TIMEOUT_NS, CLOCK, OFFS_CAP)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblocks = tl.cdiv(T, BLOCK_T)
    b0 = pid
    if RECV_ROLE:
        nprog = N_SEND
        if pid >= N_SEND:  # a receiving program: copies, and sends nothing (b0 past the last block)
            if RAW_META:  # the senders did not wait for the counts: rows_from (lay[E+e:]) needs them
                _await(peers_ptr, start_ptr, offs_ptr, RANK, W, WP, E, EP, E_LOCAL, NC, OFF_STATE, OFF_FLAGS,
                       OFF_COUNTS, True, TIMEOUT_NS, CLOCK, OFFS_CAP)
            my_r = tl.load(peers_ptr + RANK)
            _copy_arrived(tl.multiple_of(OWN_ADDR.to(tl.pointer_type(DT)), 16), rows_from_ptr, my_r, pid - N_SEND,
                          tl.num_programs(0) - N_SEND, RANK, (my_r + OFF_STATE + 16).to(tl.pointer_type(tl.int64)),
                          DT, W, T_MAX, D, OFF_RECV, OFF_RBLK, RB, NRB, RCV_R, RCV_D, TIMEOUT_NS, CLOCK)
            b0 = nblocks
    wr = tl.arange(0, WP)
    hist = tl.zeros([WP], tl.int64)
    kk = tl.arange(0, KP)
    km = kk < K
    if USE_NVSHMEM:
        my = tl.load(peers_ptr + RANK)
    if DENSE:
        tl.static_assert(not USE_NVSHMEM, "DENSE: peer pointers")
    for b in range(b0, nblocks, nprog):
        t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        if USE_NVSHMEM:
            far_any = tl.zeros([BLOCK_T], tl.int32)
        for d in range(W):
            row = tl.load(send_row_ptr + t * W + d, mask=tm, other=-1)
            sent = row >= 0
            routed = sent
            if DENSE:  # every token has its row (and META) on every rank; only routed rows move
                sent = tm
                row = t
            if SPLIT == 2:
                sent = sent & (d != RANK)
            hist += tl.where(wr == d, tl.sum(sent.to(tl.int64)), 0)
            base = tl.load(peers_ptr + d)
            m = sent
            if USE_NVSHMEM:  # rows for another node: staged and put by _nvshmem_put_tokens
                far = sent & (base == 0)
                far_any = far_any | far.to(tl.int32)
                m = sent & (base != 0)
            dst = (RANK * T_MAX + row).to(tl.int64)
            if ROWS_REGION:
                rbase = base + ROWS_OFF
            else:
                rbase = base + OFF_RECV
            if LOCAL_ROWS:
                rbase = tl.where(d == RANK, OWN_ADDR, rbase)
            recv = tl.multiple_of(rbase.to(tl.pointer_type(DT)), 16) + dst * D
            mr = m & routed
            if LOCAL_X:
                mr = mr & (d != RANK)
            if SPLIT == 1:
                mr = mr & (d == RANK)
            elif SPLIT == 2:
                mr = mr & (d != RANK)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                cm = mr[:, None] & (cols < D)[None, :]
                v = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=cm)
                tl.store(recv[:, None] + cols[None, :], v, mask=cm)
            if WITH_META:
                mk = sent[:, None] & km[None, :]
                tk = t[:, None] * K + kk[None, :]
                gk = tl.load(idx_ptr + tk, mask=mk, other=0).to(tl.int32)
                here = mk & (gk // E_LOCAL == d)
                if RAW_META:
                    pk = tl.where(here, tl.load(q_ptr + tk, mask=here, other=0).to(tl.int32) * E_LOCAL
                                  + gk - d * E_LOCAL, -1)
                else:
                    pk = tl.where(here, (tl.load(start_ptr + gk, mask=here, other=0)
                                         + tl.load(q_ptr + tk, mask=here, other=0)).to(tl.int32), -1)
                ml = m[:, None] & km[None, :]
                meta = (base + OFF_META).to(tl.pointer_type(tl.int32)) + dst * META_W
                tl.store(meta[:, None] + kk[None, :], pk, mask=ml)
                tl.store(meta + K, t, mask=m)
                gates = tl.multiple_of((base + OFF_GATES).to(tl.pointer_type(DT)), 16) + dst * K
                tl.store(gates[:, None] + kk[None, :], tl.load(gate_ptr + tk, mask=ml, other=0.0), mask=ml)
                if USE_NVSHMEM:
                    smeta = (my + OFF_SMETA).to(tl.pointer_type(tl.int32)) + (t.to(tl.int64) * W + d) * META_W
                    tl.store(smeta[:, None] + kk[None, :], pk, mask=far[:, None] & km[None, :])
                    tl.store(smeta + K, t, mask=far)
        if USE_NVSHMEM:
            _nvshmem_put_tokens(x_ptr, stride_x, b, T, far_any, send_row_ptr, gate_ptr, peers_ptr, pes_ptr, my, RANK,
                                W, K, KP, D, T_MAX, META_W, OFF_META, OFF_GATES, OFF_RECV, OFF_SROWS, OFF_SMETA,
                                OFF_SGATES, WITH_META, BLOCK_T, BLOCK_D)
        if BLK_SIGNAL:
            _signal_blocks(t, tm, send_row_ptr, peers_ptr, RANK, W, OFF_RBLK, RB, NRB, DENSE)
    if SPLIT == 2:
        _publish(hist, peers_ptr, RCNT_OFF + RANK * 8, W, WP, pes_ptr, RANK, USE_NVSHMEM)
    else:
        _publish(hist, peers_ptr, OFF_ARRIVE + RANK * 8, W, WP, pes_ptr, RANK, USE_NVSHMEM)


@triton.jit
def _store_slot_chunk(v, k, kk, pos_t, ok_i, cols, cm, out_ptr, D: tl.constexpr):
    """Stores chunk ``v`` of a row block's receive rows into their slot-``k`` expanded rows."""
    sel = kk[None, :] == k
    p64 = tl.sum(tl.where(sel, pos_t, 0), axis=1).to(tl.int64)
    m = (tl.sum(tl.where(sel, ok_i, 0), axis=1) > 0)[:, None] & cm
    tl.store(out_ptr + p64[:, None] * D + cols[None, :], v, mask=m)


@triton.jit
def _recv_chunk(recv, n, ok, cols, cm, x_ptr, stride_x, tok, s, RANK, D: tl.constexpr, LOCAL_X: tl.constexpr):
    """One column chunk of received rows ``n`` (rows with ``ok``); LOCAL_X: rows whose source is this
    rank itself are read from its own ``x`` (row ``tok``), as the send kernel skipped them."""
    if LOCAL_X:
        mine = s == RANK
        v = tl.load(recv + n.to(tl.int64)[:, None] * D + cols[None, :], mask=(ok & (s != RANK))[:, None] & cm,
                    other=0.0)
        vx = tl.load(x_ptr + tok.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=(ok & mine)[:, None] & cm,
                     other=0.0)
        v = tl.where(mine[:, None], vx, v)
    else:
        v = tl.load(recv + n.to(tl.int64)[:, None] * D + cols[None, :], mask=ok[:, None] & cm, other=0.0)
    return v


@triton.jit
def _expand_kernel(out_ptr, src_map_ptr, pos_ptr, gate_ptr, tok_ptr, rows_from_ptr, y_ptr, peers_ptr, RANK,
                   N_EXP,
                   W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr,
                   META_W: tl.constexpr, OFF_STATE: tl.constexpr, OFF_ARRIVE: tl.constexpr,
                   OFF_META: tl.constexpr, OFF_GATES: tl.constexpr, OFF_RECV: tl.constexpr,
                   OFF_DGATE: tl.constexpr,
                   FROM_META: tl.constexpr, GATE_GRAD: tl.constexpr, ACC: tl.constexpr,
                   TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, KP: tl.constexpr,
                   pes_ptr=None, OFF_SDGATE: tl.constexpr = 0, USE_NVSHMEM: tl.constexpr = False,
                   gate_n_ptr=None, COPY: tl.constexpr = True, GATE_N: tl.constexpr = False,
                   DGATE_GIVEN: tl.constexpr = False, WAIT_ROWS: tl.constexpr = True, END: tl.constexpr = False,
                   WP3: tl.constexpr = 4, OFF_FLAGS: tl.constexpr = 0, RECV_COPY: tl.constexpr = False,
                   src_row_ptr=None, SRC_ROW: tl.constexpr = False,
                   x_ptr=None, stride_x=0, LOCAL_X: tl.constexpr = False, LAYOUT: tl.constexpr = False,
                   lay_ptr=None, offs_ptr=None, starts_ptr=None, E: tl.constexpr = 1, EP: tl.constexpr = 1,
                   E_LOCAL: tl.constexpr = 1, NC: tl.constexpr = 1, OFF_COUNTS: tl.constexpr = 0,
                   OFFS_CAP: tl.constexpr = -1, BLK: tl.constexpr = False,
                   OFF_RBLK: tl.constexpr = 0, RB: tl.constexpr = 64, NRB: tl.constexpr = 1):
    """Waits for ``rows_from[s]`` token rows from every source s, then for each received row n
    and slot k with ``0 <= pos[n, k] < N_EXP``: ``out[pos] = recv[n]`` (GATE_GRAD: ``gate[n, k] *
    recv[n]``, the product in the activation dtype as autograd of ``gate * y`` gives it, and the
    slot's gate gradient ``<recv[n], y[pos]>`` (fp32) stored into the source's DGATE at (token,
    k)) and ``src_map[pos] = n*K + k``. FROM_META: (pos, token) come from META and the gates from
    GATES, and are copied out to ``pos/gate/tok`` (invalid rows get pos -1). USE_NVSHMEM (with
    GATE_GRAD): gate gradients of off-node sources are staged in SDGATE and put
    (``_nvshmem_put_gate_grads``).

    Fused-EP modes (the receive rows stay where they are; ``tlx_dist.fused`` reads them by index):
    ``COPY=False`` skips the row copy (``out`` is not written); ``GATE_N`` also stores each
    expanded row's gate into ``gate_n[pos]`` (in ``gate_n``'s dtype); ``DGATE_GIVEN`` (with
    GATE_GRAD, COPY=False) sends the gate gradients ``y[pos]`` computed elsewhere (``y`` is then
    the ``[N]`` fp32 gradient of those gates) instead of ``<recv[n], y[pos]>``; ``WAIT_ROWS=False``
    skips the wait for token rows (an op that sent none this epoch); ``RECV_COPY`` copies every
    received row n of the other sources to ``out[n]`` (``out`` is then ``[W*T_MAX, D]``; source
    RANK's rows are already there, stored by the send kernel's LOCAL_ROWS) -- inside the op, before
    END lets a peer's next op overwrite the region; ``SRC_ROW`` (dispatch) also stores ``src_row[pos] =
    n``, the row form's gather index (no torch op divides ``src_map`` by K afterwards); LOCAL_X (COPY, the expanded form and combine's backward):
    this rank's own rows are read from its ``x`` (row = the token), which the send kernel's LOCAL_X
    did not copy into RECV. LAYOUT (FROM_META, after a RAW_META send): first the counts barrier
    and layout of ``_await`` (``lay``, ``offs`` capped at OFFS_CAP, and the per-source ``starts``
    table; ``rows_from`` must point at ``lay[E+e:]``), then each slot's raw META code ``q * e + j``
    becomes the expanded row ``starts[s, j] + q``. BLK (with RECV_COPY): that copy goes block by block as RBLK counts the
    rows landed (``_copy_arrived``; the emulated world's form of the send kernel's RECV_ROLE)."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my = tl.load(peers_ptr + RANK)
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    if LAYOUT:
        _await(peers_ptr, lay_ptr, offs_ptr, RANK, W, WP, E, EP, E_LOCAL, NC, OFF_STATE, OFF_FLAGS, OFF_COUNTS,
               True, TIMEOUT_NS, CLOCK, OFFS_CAP, starts_ptr, True)
    if WAIT_ROWS:
        for src in range(W):
            _wait_geq((my + OFF_ARRIVE + src * 8).to(tl.pointer_type(tl.int64)), tl.load(rows_from_ptr + src),
                      err_ptr, OP_TOKENS, src, TIMEOUT_NS, CLOCK)
        tl.debug_barrier()
    recv = tl.multiple_of((my + OFF_RECV).to(tl.pointer_type(DT)), 16)
    meta = (my + OFF_META).to(tl.pointer_type(tl.int32))
    wr = tl.arange(0, WP)
    hist = tl.zeros([WP], tl.int64)
    over = tl.zeros([BLOCK_R], tl.int32)
    for b in range(pid, tl.cdiv(W * T_MAX, BLOCK_R), nprog):
        n = b * BLOCK_R + tl.arange(0, BLOCK_R)
        inr = n < W * T_MAX
        s = n // T_MAX
        valid = inr & ((n % T_MAX) < tl.load(rows_from_ptr + s, mask=inr, other=0))
        if FROM_META:
            tok = tl.load(meta + n.to(tl.int64) * META_W + K, mask=valid, other=-1)
            tl.store(tok_ptr + n, tok, mask=inr)
        else:
            tok = tl.load(tok_ptr + n, mask=valid, other=-1)
        if RECV_COPY and not BLK:  # the other sources' receive rows, out of the shared region before the op ends
            cv = valid & (s != RANK)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                cm = cv[:, None] & (cols < D)[None, :]
                rows = n.to(tl.int64)[:, None] * D + cols[None, :]
                tl.store(out_ptr + rows, tl.load(recv + rows, mask=cm, other=0.0), mask=cm)
        if GATE_GRAD:
            hist += tl.sum(((s[:, None] == wr[None, :]) & valid[:, None]).to(tl.int64), axis=0)
            sbase = tl.load(peers_ptr + s, mask=valid, other=0)
            near = valid
            if USE_NVSHMEM:
                far = valid & (sbase == 0)
                near = valid & (sbase != 0)
        if GATE_GRAD:  # combine's backward (and the row form's given gate gradients): slot by slot
            for k in range(K):
                pk = tl.load(pos_ptr + n * K + k, mask=valid, other=-1)
                gk = tl.load(gate_ptr + n * K + k, mask=valid, other=0.0)
                ok = valid & (pk >= 0) & (pk < N_EXP)
                over = tl.maximum(over, (valid & (pk >= N_EXP)).to(tl.int32))
                tl.store(src_map_ptr + pk, n * K + k, mask=ok)
                if GATE_N:
                    tl.store(gate_n_ptr + pk, gk.to(gate_n_ptr.dtype.element_ty), mask=ok)
                p64 = pk.to(tl.int64)
                if DGATE_GIVEN:
                    dg = tl.load(y_ptr + p64, mask=ok, other=0.0).to(ACC)
                else:
                    dg = tl.zeros([BLOCK_R], ACC)
                if COPY:  # gate-scaled rows and the slot's gate gradient <recv[n], y[pos]>
                    for c0 in range(0, D, BLOCK_D):
                        cols = c0 + tl.arange(0, BLOCK_D)
                        cm = ok[:, None] & (cols < D)[None, :]
                        v = _recv_chunk(recv, n, ok, cols, (cols < D)[None, :], x_ptr, stride_x, tok, s, RANK, D, LOCAL_X)
                        yv = tl.load(y_ptr + p64[:, None] * D + cols[None, :], mask=cm, other=0.0).to(ACC)
                        dg += tl.sum(v.to(ACC) * yv, axis=1)
                        tl.store(out_ptr + p64[:, None] * D + cols[None, :],
                                 (v.to(ACC) * gk.to(ACC)[:, None]).to(DT), mask=cm)
                # every slot of this rank answers (0 for an overflowed one)
                has = near & (pk >= 0)
                dst = (sbase + OFF_DGATE).to(tl.pointer_type(ACC)) + tok.to(tl.int64) * K + k
                tl.store(dst, dg, mask=has)
                if USE_NVSHMEM:
                    sdg = (my + OFF_SDGATE).to(tl.pointer_type(ACC)) + n.to(tl.int64) * K + k
                    tl.store(sdg, dg, mask=far & (pk >= 0))
        else:
            # Dispatch: the block's K slots as [BLOCK_R, KP] tiles (expanded row and gate of each).
            kk = tl.arange(0, KP)
            mk = valid[:, None] & (kk < K)[None, :]
            rk = n[:, None] * K + kk[None, :]
            if FROM_META:
                pos_t = tl.load(meta + n.to(tl.int64)[:, None] * META_W + kk[None, :], mask=mk, other=-1)
                if LAYOUT:  # raw code q * e + j -> starts[s, j] + q
                    coded = pos_t >= 0
                    jl = tl.where(coded, pos_t % E_LOCAL, 0)
                    pos_t = tl.where(coded, (tl.load(starts_ptr + s[:, None] * E_LOCAL + jl, mask=coded, other=0)
                                             + pos_t // E_LOCAL).to(tl.int32), -1)
                gate_t = tl.load((my + OFF_GATES).to(tl.pointer_type(DT)) + rk, mask=mk, other=0.0)
                mo = inr[:, None] & (kk < K)[None, :]  # copied out; rows not received: pos -1, gate 0
                tl.store(pos_ptr + rk, pos_t, mask=mo)
                tl.store(gate_ptr + rk, gate_t, mask=mo)
            else:
                pos_t = tl.load(pos_ptr + rk, mask=mk, other=-1)
                gate_t = tl.load(gate_ptr + rk, mask=mk, other=0.0)
            ok_t = mk & (pos_t >= 0) & (pos_t < N_EXP)
            over = tl.maximum(over, tl.max((mk & (pos_t >= N_EXP)).to(tl.int32), axis=1))
            tl.store(src_map_ptr + pos_t, rk, mask=ok_t)
            if SRC_ROW:  # the row form's gather index: the receive row itself
                tl.store(src_row_ptr + pos_t, tl.broadcast_to(n[:, None], [BLOCK_R, KP]), mask=ok_t)
            if GATE_N:
                tl.store(gate_n_ptr + pos_t, gate_t.to(gate_n_ptr.dtype.element_ty), mask=ok_t)
            if COPY:
                # Column chunk outside, slots inside: each receive-row chunk is loaded once and
                # stored to its expanded rows (it was re-loaded per slot), and the chain of dependent
                # loads of a row block is D / BLOCK_D long, not K * D / BLOCK_D.
                ok_i = ok_t.to(tl.int32)
                for c0 in range(0, D, BLOCK_D):
                    cols = c0 + tl.arange(0, BLOCK_D)
                    cm = (cols < D)[None, :]
                    v = _recv_chunk(recv, n, valid, cols, cm, x_ptr, stride_x, tok, s, RANK, D, LOCAL_X)
                    if K <= 8:  # unrolled: the K stores of a chunk go out back to back
                        for k in tl.static_range(K):
                            _store_slot_chunk(v, k, kk, pos_t, ok_i, cols, cm, out_ptr, D)
                    else:
                        for k in range(K):
                            _store_slot_chunk(v, k, kk, pos_t, ok_i, cols, cm, out_ptr, D)
        if GATE_GRAD:
            if USE_NVSHMEM:
                _nvshmem_put_gate_grads(b, rows_from_ptr, pos_ptr, tok_ptr, far, peers_ptr, pes_ptr, my, W, K, T_MAX,
                                        ACC.primitive_bitwidth // 8, OFF_DGATE, OFF_SDGATE, BLOCK_R)
    if RECV_COPY and BLK:
        _copy_arrived(out_ptr, rows_from_ptr, my, pid, nprog, RANK, err_ptr, DT, W, T_MAX, D, OFF_RECV, OFF_RBLK, RB,
                      NRB, BLOCK_R, BLOCK_D, TIMEOUT_NS, CLOCK)
    if tl.max(over) > 0:
        tl.atomic_max((my + OFF_STATE + 8).to(tl.pointer_type(tl.int64)), 1)
    if GATE_GRAD:
        _publish(hist, peers_ptr, OFF_ARRIVE + (2 * W + RANK) * 8, W, WP, pes_ptr, RANK, USE_NVSHMEM)
    if END:  # the op's last kernel: ready for the next op
        _end_op(peers_ptr, RANK, W, WP3, OFF_STATE, OFF_FLAGS, OFF_ARRIVE, pes_ptr, USE_NVSHMEM)


@triton.jit
def _reduce_slot(acc, k, kk, pos_t, gate_t, valid, cm, cols, y_ptr, N_EXP, D: tl.constexpr, GATED: tl.constexpr,
                 ACC: tl.constexpr, DT: tl.constexpr):
    """``acc + [gate *] y[pos]`` for slot ``k`` of a row block (one column chunk)."""
    pk = tl.sum(tl.where(kk[None, :] == k, pos_t, 0), axis=1)
    ok = valid & (pk >= 0) & (pk < N_EXP)
    yv = tl.load(y_ptr + pk.to(tl.int64)[:, None] * D + cols[None, :], mask=ok[:, None] & cm, other=0.0)
    if GATED:  # the product rounded to DT (exact in ACC before rounding)
        gk = tl.sum(tl.where(kk[None, :] == k, gate_t, 0.0), axis=1)
        yv = (yv.to(ACC) * gk[:, None]).to(DT)
    return acc + yv.to(ACC)


@triton.jit
def _reduce_send_kernel(y_ptr, pos_ptr, gate_ptr, tok_ptr, rows_from_ptr, peers_ptr, RANK, N_EXP,
                        W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, D: tl.constexpr,
                        T_MAX: tl.constexpr, OFF_ARRIVE: tl.constexpr, OFF_COMB: tl.constexpr,
                        GATED: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                        pes_ptr=None, OFF_SCOMB: tl.constexpr = 0, USE_NVSHMEM: tl.constexpr = False,
                        ROWS: tl.constexpr = False, BARRIER: tl.constexpr = False, OFF_STATE: tl.constexpr = 0,
                        OFF_FLAGS: tl.constexpr = 0, TIMEOUT_NS: tl.constexpr = 0, CLOCK: tl.constexpr = 0,
                        CBLK_SIGNAL: tl.constexpr = False, OFF_CBLK: tl.constexpr = 0,
                        CB: tl.constexpr = 32, NCB: tl.constexpr = 1, RECV_ROLE: tl.constexpr = False, N_RECV=0,
                        out_ptr=None, send_row_ptr=None, T=0, PART_ADDR=0, RR_T: tl.constexpr = 8,
                        RR_D: tl.constexpr = 512, END: tl.constexpr = False, WP3: tl.constexpr = 4,
                        DENSE: tl.constexpr = False):
    """BARRIER: first ``_await`` (the op's phase 2). ROWS (fused EP pipeline): row n of ``y``
    (``[W*T_MAX, D]``, one row per received row,
    already summed over this rank's slots) goes home as it is. Otherwise,
    for each received token row n (source s, token t): ``sum_k [gate[n, k] *] y[pos[n, k]]``
    over this rank's slots of t (products in the activation dtype, as the per-token reference
    computes them), accumulated in fp32 and rounded once, stored into row (t, RANK)
    of the source's COMB. Then one release add per source of the rows sent back. USE_NVSHMEM: rows
    of off-node sources are staged in SCOMB and put (``_nvshmem_put_partials``). ROWS: rows
    whose source is this rank stay in ``y`` (``_reduce_recv_kernel`` reads them there);
    they are still counted in the release add, as the receive kernel waits for them; a block of
    only own rows moves nothing.
    CBLK_SIGNAL (``symm._comb_mode`` "blocks" / "overlap"; peer pointers): instead of the one
    ARRIVE add per source at the end, each block's rows are counted into their source's CBLK[RANK,
    t // CB] (``_signal_comb_rows``) as soon as they are stored, so the source can sum a token
    block as soon as its partial rows are in. RECV_ROLE (with CBLK_SIGNAL; real ranks): programs
    0 .. N_RECV-1 of this launch are the source side of the op instead -- they sum this rank's token
    blocks into ``out`` as their partial rows land (``_reduce_comb_blocks``, the reduce-receive's
    work, overlapping the transfer), and END makes this the op's only kernel. The receiving programs
    come first (scheduled first, so they run beside the senders); they wait only for peers'
    senders, and senders never wait for them."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    if BARRIER:  # the op's phase 2 (no counts): wait for every peer's signal
        _await(peers_ptr, peers_ptr, peers_ptr, RANK, W, WP, 1, 1, 1, 1, OFF_STATE, OFF_FLAGS, 0, False,
               TIMEOUT_NS, CLOCK)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    b0 = pid
    nblocks = tl.cdiv(W * T_MAX, BLOCK_R)
    if RECV_ROLE:
        tl.static_assert(CBLK_SIGNAL and ROWS and not USE_NVSHMEM,
                         "RECV_ROLE: the row form, per-block signals over peer pointers (summing programs must "
                         "wait only for peers' senders, never for this rank's own)")
        nprog = nprog - N_RECV
        b0 = pid - N_RECV
        if pid < N_RECV:  # a receiving program: sums arrived token blocks, sends nothing
            my_r = tl.load(peers_ptr + RANK)
            _reduce_comb_blocks(out_ptr, send_row_ptr, T, pid, N_RECV, my_r, RANK, PART_ADDR,
                                (my_r + OFF_STATE + 16).to(tl.pointer_type(tl.int64)), W, WP, D, T_MAX, OFF_COMB,
                                OFF_CBLK, CB, NCB, ACC, DT, RR_T, RR_D, ROWS, TIMEOUT_NS, CLOCK, DENSE)
            b0 = nblocks
    wr = tl.arange(0, WP)
    hist = tl.zeros([WP], tl.int64)
    if USE_NVSHMEM:
        my = tl.load(peers_ptr + RANK)
    for b in range(b0, nblocks, nprog):
        n = b * BLOCK_R + tl.arange(0, BLOCK_R)
        inr = n < W * T_MAX
        s = n // T_MAX
        valid = inr & ((n % T_MAX) < tl.load(rows_from_ptr + s, mask=inr, other=0))
        near = valid
        if ROWS:  # this rank's own partial rows stay in y
            near = valid & (s != RANK)
        if not CBLK_SIGNAL:
            hist += tl.sum(((s[:, None] == wr[None, :]) & valid[:, None]).to(tl.int64), axis=0)
        if tl.sum(near.to(tl.int32)) > 0:
            moved = near  # the rows this block loads (near ones are stored to the peer, far ones staged)
            tok = tl.load(tok_ptr + n, mask=valid, other=0).to(tl.int64)
            sbase = tl.load(peers_ptr + s, mask=valid, other=0)
            dst = tl.multiple_of((sbase + OFF_COMB).to(tl.pointer_type(DT)), 16) + (RANK * T_MAX + tok) * D
            if USE_NVSHMEM:
                far = valid & (sbase == 0)
                near = near & (sbase != 0)
                stage = tl.multiple_of((my + OFF_SCOMB).to(tl.pointer_type(DT)), 16) + n.to(tl.int64) * D
            if not ROWS:  # the block's slots, loaded once (not once per column chunk)
                kk = tl.arange(0, KP)
                mk = valid[:, None] & (kk < K)[None, :]
                pos_t = tl.load(pos_ptr + n[:, None] * K + kk[None, :], mask=mk, other=-1)
                if GATED:
                    gate_t = tl.load(gate_ptr + n[:, None] * K + kk[None, :], mask=mk, other=0.0).to(ACC)
                else:  # unused
                    gate_t = tl.zeros([BLOCK_R, KP], ACC)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                cm = (cols < D)[None, :]
                if ROWS:  # (own rows are not loaded: they stay where they are)
                    acc = tl.load(y_ptr + n.to(tl.int64)[:, None] * D + cols[None, :], mask=moved[:, None] & cm,
                                  other=0.0).to(ACC)
                else:
                    acc = tl.zeros([BLOCK_R, BLOCK_D], ACC)
                    # unrolled up to K = 8: the K row loads of a chunk are in flight together (a loop
                    # waits for each before issuing the next); the sum keeps the order k = 0, 1, ...
                    if K <= 8:
                        for k in tl.static_range(K):
                            acc = _reduce_slot(acc, k, kk, pos_t, gate_t, valid, cm, cols, y_ptr, N_EXP, D, GATED,
                                               ACC, DT)
                    else:
                        for k in range(K):
                            acc = _reduce_slot(acc, k, kk, pos_t, gate_t, valid, cm, cols, y_ptr, N_EXP, D, GATED,
                                               ACC, DT)
                tl.store(dst[:, None] + cols[None, :], acc.to(DT), mask=near[:, None] & cm)
                if USE_NVSHMEM:
                    tl.store(stage[:, None] + cols[None, :], acc.to(DT), mask=far[:, None] & cm)
            if USE_NVSHMEM:
                _nvshmem_put_partials(b, rows_from_ptr, tok_ptr, far, peers_ptr, pes_ptr, my, RANK, W, D, T_MAX,
                                      DT.primitive_bitwidth // 8, OFF_COMB, OFF_SCOMB, BLOCK_R)
            if CBLK_SIGNAL:
                _signal_comb_rows(near, s, tok, peers_ptr, RANK, OFF_CBLK, CB, NCB, BLOCK_R)
    if CBLK_SIGNAL:
        tl.static_assert(not USE_NVSHMEM, "CBLK_SIGNAL: peer pointers only")
    else:
        _publish(hist, peers_ptr, OFF_ARRIVE + (W + RANK) * 8, W, WP, pes_ptr, RANK, USE_NVSHMEM)
    if END:  # (RECV_ROLE) the op's only kernel: ready for the next op once every program is done
        _end_op(peers_ptr, RANK, W, WP3, OFF_STATE, OFF_FLAGS, OFF_ARRIVE, pes_ptr, USE_NVSHMEM)


@triton.jit
def _signal_comb_rows(near, s, tok, peers_ptr, RANK, OFF_CBLK: tl.constexpr, CB: tl.constexpr, NCB: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """After a block's partial rows went out (CTA barrier first): one release add per (source s,
    token block t // CB) the block's rows fell in, of the rows that fell there, to CBLK[RANK, t // CB]
    of source s. Tiles of up to 16 rows aggregate the adds (the first row of each key adds the key's
    count); taller tiles add one per row."""
    tl.debug_barrier()
    if BLOCK_R <= 16:
        key = tl.where(near, s.to(tl.int64) * NCB + tok // CB, -1)
        i = tl.arange(0, BLOCK_R)
        same = (key[:, None] == key[None, :]) & near[:, None] & near[None, :]
        cnt = tl.sum(same.to(tl.int64), axis=1)
        lead = near & (tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1) == 0)
    else:  # tall tiles (narrow rows): one add per row, no BLOCK_R x BLOCK_R tile
        cnt = tl.full([BLOCK_R], 1, tl.int64)
        lead = near
    sbase = tl.load(peers_ptr + s, mask=lead, other=0)
    ctr = (sbase + OFF_CBLK + (RANK * NCB + tok // CB) * 8).to(tl.pointer_type(tl.int64))
    tl.atomic_add(ctr, cnt, mask=lead, sem="release", scope="sys")


@triton.jit
def _sum_token_block(out_ptr, t, tm, row_t, wr, comb_addr, RANK, PART_ADDR, W: tl.constexpr, D: tl.constexpr,
                     T_MAX: tl.constexpr, ACC: tl.constexpr, DT: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, LOCAL_ROWS: tl.constexpr, C_LO, C_HI):
    """``out[t] = sum_d COMB[t, d]`` for a block of tokens ``t`` (``row_t[:, d]``: the token's receive
    row on rank d, -1: not sent there), columns [C_LO, C_HI) in BLOCK_D chunks, fp32 (fp64)
    accumulation in rank order, one rounding."""
    t64 = t.to(tl.int64)
    for c0 in range(C_LO, C_HI, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cm = (cols < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], ACC)
        if W <= 8:  # unrolled: the W partial rows of a chunk load together (the sum keeps d's order)
            for dd in tl.static_range(W):
                acc = _add_rank_chunk(acc, dd, wr, row_t, comb_addr, t64, cols, cm, RANK, PART_ADDR, W, D, T_MAX,
                                      ACC, DT, LOCAL_ROWS)
        else:
            for dd in range(W):
                acc = _add_rank_chunk(acc, dd, wr, row_t, comb_addr, t64, cols, cm, RANK, PART_ADDR, W, D, T_MAX,
                                      ACC, DT, LOCAL_ROWS)
        tl.store(out_ptr + t64[:, None] * D + cols[None, :], acc.to(DT), mask=tm[:, None] & cm)


@triton.jit
def _reduce_comb_blocks(out_ptr, send_row_ptr, T, q, nq, my, RANK, PART_ADDR, err_ptr, W: tl.constexpr,
                        WP: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr, OFF_COMB: tl.constexpr,
                        OFF_CBLK: tl.constexpr, CB: tl.constexpr, NCB: tl.constexpr, ACC: tl.constexpr,
                        DT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, LOCAL_ROWS: tl.constexpr,
                        TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr, DENSE: tl.constexpr = False):
    """The combine's source side by work unit, program ``q`` of ``nq``. A unit is (token block j of
    CB tokens, column chunk c of BLOCK_D), units in block order, so that the last rows to land leave
    one chunk's sum behind them, not a whole block's. For each of its units a program waits until
    CBLK[d, j] holds the block's rows sent to d (the tokens t of the block with ``send_row[t, d] >=
    0``: every row d got comes back) for every rank d (LOCAL_ROWS: but this one, whose partial rows
    are read in place), and sums the unit (``_sum_token_block``). CBLK row W counts the block's
    finished units; the program that finishes the last one zeroes the block's counters: rank d adds
    to them again only in a later op, after this rank ended this one. DENSE (the dense layout: rank
    d's partial row of every token comes back, routed there or not): a block waits for all its tokens
    from every rank; the sum still adds only the ranks a token went to."""
    comb_addr = my + OFF_COMB
    ctr = (my + OFF_CBLK).to(tl.pointer_type(tl.int64))
    wr = tl.arange(0, WP)
    NCH: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    for u in range(q, tl.cdiv(T, CB) * NCH, nq):
        j = u // NCH
        c0 = (u % NCH) * BLOCK_D
        need = tl.zeros([WP], tl.int64)
        for t0 in range(j * CB, j * CB + CB, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = (t < T) & (t < j * CB + CB)
            sent = tl.load(send_row_ptr + t[:, None] * W + wr[None, :], mask=tm[:, None] & (wr < W)[None, :],
                           other=-1) >= 0
            if DENSE:
                sent = tm[:, None] & (wr < W)[None, :]
            need += tl.sum(sent.to(tl.int64), axis=0)
        if LOCAL_ROWS:
            need = tl.where(wr == RANK, 0, need)
        for d in range(W):
            nd = tl.sum(tl.where(wr == d, need, 0))
            if nd > 0:
                _wait_geq(ctr + d * NCB + j, nd, err_ptr, OP_COMBINE, d, TIMEOUT_NS, CLOCK)
        tl.debug_barrier()
        for t0 in range(j * CB, j * CB + CB, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = (t < T) & (t < j * CB + CB)
            row_t = tl.load(send_row_ptr + t[:, None] * W + wr[None, :], mask=tm[:, None] & (wr < W)[None, :],
                            other=-1)
            _sum_token_block(out_ptr, t, tm, row_t, wr, comb_addr, RANK, PART_ADDR, W, D, T_MAX, ACC, DT, BLOCK_T,
                             BLOCK_D, LOCAL_ROWS, c0, c0 + BLOCK_D)
        tl.debug_barrier()  # every thread of the CTA has read the block's counters and rows
        if tl.atomic_add(ctr + W * NCB + j, 1, sem="acq_rel", scope="gpu") == NCH - 1:
            for d in range(W):
                tl.atomic_xchg(ctr + d * NCB + j, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(ctr + W * NCB + j, 0, sem="relaxed", scope="gpu")


@triton.jit
def _add_rank_chunk(acc, dd, wr, row_t, comb_addr, t64, cols, cm, RANK, part_addr, W: tl.constexpr, D: tl.constexpr,
                    T_MAX: tl.constexpr, ACC: tl.constexpr, DT: tl.constexpr, LOCAL_ROWS: tl.constexpr):
    """``acc + COMB[t, dd]`` (one column chunk) for the tokens of the block that went to rank ``dd``
    (``row_t[:, dd] >= 0``); LOCAL_ROWS: rank ``RANK``'s own partial rows are read where its
    reduce-send left them, row ``RANK*T_MAX + row`` of ``y`` at ``part_addr``."""
    row = tl.sum(tl.where(wr[None, :] == dd, row_t, 0), axis=1)
    sent = row >= 0
    base = comb_addr
    ri = dd * T_MAX + t64
    if LOCAL_ROWS:
        base = tl.where(dd == RANK, part_addr, base)
        ri = tl.where(dd == RANK, RANK * T_MAX + row.to(tl.int64), ri)
    src = tl.multiple_of(base.to(tl.pointer_type(DT)), 16)
    return acc + tl.load(src + ri[:, None] * D + cols[None, :], mask=sent[:, None] & cm, other=0.0).to(ACC)


@triton.jit
def _reduce_recv_kernel(out_ptr, send_row_ptr, rows_to_ptr, peers_ptr, RANK, T,
                        W: tl.constexpr, WP: tl.constexpr, D: tl.constexpr, OFF_STATE: tl.constexpr, OFF_ARRIVE: tl.constexpr,
                        OFF_COMB: tl.constexpr, ACC: tl.constexpr, TIMEOUT_NS: tl.constexpr,
                        CLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        END: tl.constexpr = False, WP3: tl.constexpr = 4, OFF_FLAGS: tl.constexpr = 0,
                        pes_ptr=None, USE_NVSHMEM: tl.constexpr = False, PART_ADDR=0, T_MAX: tl.constexpr = 1,
                        LOCAL_ROWS: tl.constexpr = False, BLK: tl.constexpr = False, OFF_CBLK: tl.constexpr = 0,
                        CB: tl.constexpr = 32, NCB: tl.constexpr = 1, DENSE: tl.constexpr = False):
    """Waits for ``rows_to[d]`` rows back from every rank d, then ``out[t] = sum_d COMB[t, d]``
    over the ranks t was sent to (fp32, one rounding); a token sent nowhere (T = 0 experts) is 0.
    LOCAL_ROWS: the partial row of this rank itself is row ``RANK*T_MAX + send_row[t, RANK]`` of
    the reduce-send's ``y`` (``[W*T_MAX, D]`` at PART_ADDR), which did not copy it to COMB.
    BLK (the reduce-send signalled CBLK, ``symm._comb_mode`` "blocks"): no ARRIVE wait; token
    blocks of CB tokens are summed as their partial rows are in (``_reduce_comb_blocks``)."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my = tl.load(peers_ptr + RANK)
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    if BLK:
        _reduce_comb_blocks(out_ptr, send_row_ptr, T, pid, nprog, my, RANK, PART_ADDR, err_ptr, W, WP, D, T_MAX,
                            OFF_COMB, OFF_CBLK, CB, NCB, ACC, DT, BLOCK_T, BLOCK_D, LOCAL_ROWS, TIMEOUT_NS, CLOCK,
                            DENSE)
    else:
        for d in range(W):
            _wait_geq((my + OFF_ARRIVE + (W + d) * 8).to(tl.pointer_type(tl.int64)), tl.load(rows_to_ptr + d),
                      err_ptr, OP_COMBINE, d, TIMEOUT_NS, CLOCK)
        tl.debug_barrier()
        comb_addr = my + OFF_COMB
        wr = tl.arange(0, WP)
        for b in range(pid, tl.cdiv(T, BLOCK_T), nprog):
            t = b * BLOCK_T + tl.arange(0, BLOCK_T)
            tm = t < T
            # which ranks each token went to (its receive row there, -1: none), once per block
            row_t = tl.load(send_row_ptr + t[:, None] * W + wr[None, :], mask=tm[:, None] & (wr < W)[None, :],
                            other=-1)
            _sum_token_block(out_ptr, t, tm, row_t, wr, comb_addr, RANK, PART_ADDR, W, D, T_MAX, ACC, DT, BLOCK_T,
                             BLOCK_D, LOCAL_ROWS, 0, D)
    if END:  # the op's last kernel: ready for the next op
        _end_op(peers_ptr, RANK, W, WP3, OFF_STATE, OFF_FLAGS, OFF_ARRIVE, pes_ptr, USE_NVSHMEM)


@triton.jit
def _gate_grad_recv_kernel(out_ptr, rows_to_ptr, peers_ptr, RANK, S,
                           W: tl.constexpr, OFF_STATE: tl.constexpr, OFF_ARRIVE: tl.constexpr,
                           OFF_DGATE: tl.constexpr, TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr,
                           BLOCK: tl.constexpr, END: tl.constexpr = False, WP3: tl.constexpr = 4,
                           OFF_FLAGS: tl.constexpr = 0, pes_ptr=None, USE_NVSHMEM: tl.constexpr = False):
    """Waits until every rank d answered the ``rows_to[d]`` token rows it got, then copies
    DGATE[:S] (S = T*K gate gradients, in ``out``'s dtype ACC) out."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my = tl.load(peers_ptr + RANK)
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    for d in range(W):
        _wait_geq((my + OFF_ARRIVE + (2 * W + d) * 8).to(tl.pointer_type(tl.int64)), tl.load(rows_to_ptr + d),
                  err_ptr, OP_GATE_GRAD, d, TIMEOUT_NS, CLOCK)
    tl.debug_barrier()
    src = (my + OFF_DGATE).to(tl.pointer_type(out_ptr.dtype.element_ty))
    for b in range(pid, tl.cdiv(S, BLOCK), nprog):
        i = b * BLOCK + tl.arange(0, BLOCK)
        m = i < S
        tl.store(out_ptr + i, tl.load(src + i, mask=m, other=0.0), mask=m)
    if END:  # the op's last kernel: ready for the next op
        _end_op(peers_ptr, RANK, W, WP3, OFF_STATE, OFF_FLAGS, OFF_ARRIVE, pes_ptr, USE_NVSHMEM)


@triton.jit
def _rows_wait_kernel(want_ptr, peers_ptr, RANK, RCNT_OFF, W: tl.constexpr, OFF_STATE: tl.constexpr,
                      TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr):
    """The overlapped row form's arrival wait (one program, on the stream of the GEMMs that read
    the rows): for every source s != RANK, waits (bounded, OP_TOKENS) until this rank's region
    counter RCNT[s] at ``RCNT_OFF`` holds ``want[s]`` rows (``rows_from``: every row of s landed),
    then takes them off the counter, so it reads 0 again before the next dispatch into the region
    (whose senders start adding only after this rank ended a later op)."""
    my = tl.load(peers_ptr + RANK)
    ctr = (my + RCNT_OFF).to(tl.pointer_type(tl.int64))
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    for s in range(W):
        if s != RANK:
            want = tl.load(want_ptr + s)
            _wait_geq(ctr + s, want, err_ptr, OP_TOKENS, s, TIMEOUT_NS, CLOCK)
            got = tl.atomic_add(ctr + s, 0, sem="acquire", scope="sys")
            if got >= want:
                tl.atomic_add(ctr + s, -want, sem="relaxed", scope="sys")


@triton.jit
def _phase_offsets_kernel(starts_ptr, counts_ptr, offs_ptr, out_ptr, RANK, CAP, W: tl.constexpr,
                          E_LOCAL: tl.constexpr, EP: tl.constexpr):
    """The overlapped gate/up GEMM's virtual experts (one program): for local expert j, three runs
    of its expert-major rows -- sources before RANK, RANK's own, sources after -- as cumulative
    ends ``out[3j] = start(RANK, j)``, ``out[3j + 1] = start(RANK, j) + own rows``, ``out[3j + 2] =
    offs[j]``, each capped at CAP (the capacity; ``offs`` is capped already), int32. ``starts``:
    ``[W, E_LOCAL]`` first expanded row of (source, expert) (``_await`` STARTS), ``counts``:
    ``[E_LOCAL]`` rows per expert; the end of (s, j)'s run is the next source's start, or for
    the last source the expert's first row + its rows."""
    j = tl.arange(0, EP)
    jm = j < E_LOCAL
    lo = tl.load(starts_ptr + RANK * E_LOCAL + j, mask=jm, other=0).to(tl.int64)
    if RANK + 1 < W:
        hi = tl.load(starts_ptr + (RANK + 1) * E_LOCAL + j, mask=jm, other=0).to(tl.int64)
    else:
        hi = tl.load(starts_ptr + j, mask=jm, other=0).to(tl.int64) + tl.load(counts_ptr + j, mask=jm,
                                                                                other=0).to(tl.int64)
    end = tl.load(offs_ptr + j, mask=jm, other=0).to(tl.int64)
    if CAP >= 0:
        lo = tl.minimum(lo, CAP)
        hi = tl.minimum(hi, CAP)
    tl.store(out_ptr + 3 * j, lo.to(tl.int32), mask=jm)
    tl.store(out_ptr + 3 * j + 1, hi.to(tl.int32), mask=jm)
    tl.store(out_ptr + 3 * j + 2, end.to(tl.int32), mask=jm)
