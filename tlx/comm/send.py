"""Phase 2 of a dispatch (and of combine's backward): the send kernel, which moves each token row
once per destination rank with its metadata, and the row form's receive side -- per-block arrival
signals and the receiving programs that copy rows out as they land (``exchange.py`` describes the
op, the region and the legend)."""

from __future__ import annotations

import triton
import triton.language as tl

from .protocol import OP_TOKENS, _await, _nvshmem_put_tokens, _publish, _wait_geq


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
    SPLIT (the overlapped row form, ROWS_REGION on peer pointers; ``tlx_dist.comm.symm.RowsOverlap``): the send in
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
