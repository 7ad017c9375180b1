"""Symmetric-memory dispatch/combine: the phase kernels of one exchange.

Legend: W ranks, E global experts, S = T*K slots of this rank, S_MAX = T_max*K, N_CAP receive rows,
WORDS row length in machine words (rows move as raw bits: int16/32/64 words, any float dtype).

Symmetric region of every rank (byte offsets are constexprs from the host; ``peers[d]`` + offset):
    STATE  [2]   int64  epoch (ops started on this rank), sticky overflow flag
    FLAGS  [W]   int64  barrier: FLAGS[s] = last epoch rank s signalled to me
    ARRIVE [2W]  int64  rows arrived: [0:W) dispatch rows from src s, [W:2W) combine rows from rank d
    COUNTS [2,W,E] int64 count matrix (double-buffered by epoch parity); row s written by rank s
    SRC    [N_CAP] int64 for each received row: src_rank * S_MAX + src slot
    RECV   [N_CAP, ROW_BYTES]  dispatch receive rows (expert-major, source-minor: see layout.py)
    COMB   [S_MAX, ROW_BYTES]  combine receive rows, at their slot t*K + k

One exchange on rank r, kernels launched in this order (the emulated world launches each phase for
every virtual rank before the next phase, so no kernel waits on a signal a later launch raises):
    1. _barrier_signal_kernel: epoch += 1; zero my ARRIVE; [dispatch: write my counts row into every
       peer's COUNTS]; raise FLAGS[r] = epoch on every peer.
    2. _barrier_wait_kernel: wait FLAGS[s] >= epoch for all s; [dispatch: copy COUNTS -> counts_WE].
       After it every peer has zeroed its ARRIVE and finished reading its buffers for the previous
       op (stream order), so sends may start.
    3. _dispatch_send_kernel / _combine_send_kernel: peer stores of rows (+ SRC ids), then one
       release add per destination of the rows sent to it.
    4. _dispatch_recv_kernel / _combine_recv_kernel: wait until every source's rows arrived, copy
       the receive buffer out (zero padding / dropped slots) so it can be reused by the next op.
Rows past the capacity are not stored but still counted as arrived (so no rank hangs) and set the
overflow flag, which the host checks later: a dropped row is never silent.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .primitives import (NVSHMEM_SIGNAL_ADD, NVSHMEM_SIGNAL_SET, nvshmem_fence, nvshmem_int64_p,
                         nvshmem_putmem_block, nvshmem_signal_op)


@triton.jit
def _barrier_signal_kernel(peers_ptr, pes_ptr, counts_E_ptr, RANK,
                           W: tl.constexpr, WP2: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
                           OFF_STATE: tl.constexpr, OFF_FLAGS: tl.constexpr, OFF_ARRIVE: tl.constexpr,
                           OFF_COUNTS: tl.constexpr, HAS_COUNTS: tl.constexpr, USE_NVSHMEM: tl.constexpr):
    my = tl.load(peers_ptr + RANK)
    state = (my + OFF_STATE).to(tl.pointer_type(tl.int64))
    epoch = tl.load(state) + 1
    tl.store(state, epoch)
    wi = tl.arange(0, WP2)
    tl.store((my + OFF_ARRIVE).to(tl.pointer_type(tl.int64)) + wi, tl.zeros([WP2], tl.int64), mask=wi < 2 * W)
    if HAS_COUNTS:
        ei = tl.arange(0, BLOCK_E)
        em = ei < E
        c = tl.load(counts_E_ptr + ei, mask=em, other=0)
        row_off = OFF_COUNTS + ((epoch % 2) * W + RANK) * (E * 8)
        if USE_NVSHMEM:  # NVSHMEM puts need a symmetric source: stage my row in my own COUNTS first
            tl.store((my + row_off).to(tl.pointer_type(tl.int64)) + ei, c, mask=em)
            tl.debug_barrier()
        for d in range(W):
            base = tl.load(peers_ptr + d)
            if base != 0:
                tl.store((base + row_off).to(tl.pointer_type(tl.int64)) + ei, c, mask=em)
            elif USE_NVSHMEM:
                nvshmem_putmem_block(my + row_off, my + row_off, tl.full([], E * 8, tl.int64), tl.load(pes_ptr + d))
    tl.debug_barrier()
    for d in range(W):
        base = tl.load(peers_ptr + d)
        if base != 0:
            tl.atomic_max((base + OFF_FLAGS + RANK * 8).to(tl.pointer_type(tl.int64)), epoch, sem="release", scope="sys")
        elif USE_NVSHMEM:
            nvshmem_fence()
            nvshmem_signal_op(my + OFF_FLAGS + RANK * 8, epoch, NVSHMEM_SIGNAL_SET, tl.load(pes_ptr + d))


@triton.jit
def _barrier_wait_kernel(peers_ptr, counts_WE_ptr, RANK,
                         W: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
                         OFF_STATE: tl.constexpr, OFF_FLAGS: tl.constexpr, OFF_COUNTS: tl.constexpr,
                         HAS_COUNTS: tl.constexpr):
    my = tl.load(peers_ptr + RANK)
    epoch = tl.load((my + OFF_STATE).to(tl.pointer_type(tl.int64)))
    for s in range(W):
        while tl.atomic_add((my + OFF_FLAGS + s * 8).to(tl.pointer_type(tl.int64)), 0, sem="acquire", scope="sys") < epoch:
            pass
    tl.debug_barrier()
    if HAS_COUNTS:
        ei = tl.arange(0, BLOCK_E)
        em = ei < E
        for s in range(W):
            c = tl.load((my + OFF_COUNTS + ((epoch % 2) * W + s) * (E * 8)).to(tl.pointer_type(tl.int64)) + ei, mask=em)
            tl.store(counts_WE_ptr + s * E + ei, c, mask=em)


@triton.jit
def _copy_rows(src_ptrs, dst_ptrs, ok, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Copies rows: ``src_ptrs``/``dst_ptrs`` are [BLOCK_M] pointers to row starts (masked by ``ok``)."""
    for w0 in range(0, WORDS, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (cols < WORDS)[None, :]
        v = tl.load(src_ptrs[:, None] + cols[None, :], mask=m)
        tl.store(dst_ptrs[:, None] + cols[None, :], v, mask=m)


@triton.jit
def _copy_rows_or_zero(src_ptrs, dst_ptrs, ok, inb, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows with ``ok`` are copied; rows with ``inb & ~ok`` get zeros."""
    for w0 in range(0, WORDS, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        cm = (cols < WORDS)[None, :]
        v = tl.load(src_ptrs[:, None] + cols[None, :], mask=ok[:, None] & cm, other=0)
        tl.store(dst_ptrs[:, None] + cols[None, :], v, mask=inb[:, None] & cm)


@triton.jit
def _publish_counts(hist, peers_ptr, pes_ptr, my, slot_off, W: tl.constexpr, WP: tl.constexpr,
                    USE_NVSHMEM: tl.constexpr):
    """After this CTA's row stores: add ``hist[d]`` to the counter at ``peers[d] + slot_off``."""
    tl.debug_barrier()
    wr = tl.arange(0, WP)
    for d in range(W):
        n = tl.sum(tl.where(wr == d, hist, 0))
        if n > 0:
            base = tl.load(peers_ptr + d)
            if base != 0:
                tl.atomic_add((base + slot_off).to(tl.pointer_type(tl.int64)), n, sem="release", scope="sys")
            elif USE_NVSHMEM:
                nvshmem_fence()
                nvshmem_signal_op(my + slot_off, n, NVSHMEM_SIGNAL_ADD, tl.load(pes_ptr + d))


@triton.jit
def _dispatch_send_kernel(src_ptr, stride_src, order_ptr, dest_rank_ptr, dest_row_ptr, peers_ptr, pes_ptr,
                          RANK, S, K,
                          W: tl.constexpr, WP: tl.constexpr, N_CAP: tl.constexpr, S_MAX: tl.constexpr,
                          WORDS: tl.constexpr, ROW_BYTES: tl.constexpr,
                          OFF_STATE: tl.constexpr, OFF_ARRIVE: tl.constexpr, OFF_SRC: tl.constexpr,
                          OFF_RECV: tl.constexpr, SRC_IS_SLOT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, USE_NVSHMEM: tl.constexpr):
    """Sorted slot i (slot ``order[i]``) -> row ``dest_row[i]`` of rank ``dest_rank[i]``.
    Source row: ``src[slot // K]`` (token rows, forward) or ``src[slot]`` (slot rows, backward)."""
    WORD: tl.constexpr = src_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblocks = tl.cdiv(S, BLOCK_M)
    per = tl.cdiv(nblocks, nprog)  # contiguous blocks per program: few destinations each
    my = tl.load(peers_ptr + RANK)
    wr = tl.arange(0, WP)
    hist = tl.zeros([WP], tl.int64)
    overflow = tl.zeros([BLOCK_M], tl.int32)
    for b in range(pid * per, tl.minimum(pid * per + per, nblocks)):
        i = b * BLOCK_M + tl.arange(0, BLOCK_M)
        m = i < S
        slot = tl.load(order_ptr + i, mask=m, other=0)
        d = tl.load(dest_rank_ptr + i, mask=m, other=0)
        row = tl.load(dest_row_ptr + i, mask=m, other=0)
        fits = m & (row < N_CAP)
        overflow = tl.maximum(overflow, (m & (row >= N_CAP)).to(tl.int32))
        hist += tl.sum(((d[:, None] == wr[None, :]) & m[:, None]).to(tl.int64), axis=0)
        src_row = slot if SRC_IS_SLOT else slot // K
        base = tl.load(peers_ptr + d, mask=m, other=0)
        p2p = fits & (base != 0)
        _copy_rows(src_ptr + src_row.to(tl.int64) * stride_src,
                   (base + OFF_RECV + row * ROW_BYTES).to(tl.pointer_type(WORD)), p2p, WORDS, BLOCK_W)
        tl.store((base + OFF_SRC + row * 8).to(tl.pointer_type(tl.int64)), RANK * S_MAX + slot, mask=p2p)
        if USE_NVSHMEM:  # rows for ranks without a peer pointer: one block-collective put per row
            for j in range(BLOCK_M):
                ij = b * BLOCK_M + j
                if ij < S:
                    dj = tl.load(dest_rank_ptr + ij)
                    rj = tl.load(dest_row_ptr + ij)
                    if (tl.load(peers_ptr + dj) == 0) & (rj < N_CAP):
                        sj = tl.load(order_ptr + ij)
                        srj = sj if SRC_IS_SLOT else sj // K
                        pe = tl.load(pes_ptr + dj)
                        nvshmem_putmem_block(my + OFF_RECV + rj * ROW_BYTES,
                                             (src_ptr + srj.to(tl.int64) * stride_src).to(tl.int64),
                                             tl.full([], ROW_BYTES, tl.int64), pe)
                        nvshmem_int64_p(my + OFF_SRC + rj * 8, RANK * S_MAX + sj, pe)
    if tl.max(overflow) > 0:
        tl.atomic_max((my + OFF_STATE + 8).to(tl.pointer_type(tl.int64)), 1)
    # Dropped (overflowing) rows are counted too: the receiver waits for every row it was told of.
    _publish_counts(hist, peers_ptr, pes_ptr, my, OFF_ARRIVE + RANK * 8, W, WP, USE_NVSHMEM)


@triton.jit
def _dispatch_recv_kernel(out_ptr, src_out_ptr, expected_ptr, peers_ptr, RANK,
                          W: tl.constexpr, WP: tl.constexpr, N_CAP: tl.constexpr, WORDS: tl.constexpr,
                          OFF_STATE: tl.constexpr, OFF_ARRIVE: tl.constexpr, OFF_SRC: tl.constexpr,
                          OFF_RECV: tl.constexpr, COPY_ROWS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Waits for ``expected[s]`` rows from every source s, then copies RECV -> out (padding rows
    zeroed) and SRC -> src_out (-1 on padding). ``out`` is contiguous ``[N_CAP, WORDS]``."""
    WORD: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my = tl.load(peers_ptr + RANK)
    for s in range(W):
        while tl.atomic_add((my + OFF_ARRIVE + s * 8).to(tl.pointer_type(tl.int64)), 0, sem="acquire", scope="sys") < tl.load(expected_ptr + s):
            pass
    tl.debug_barrier()
    wr = tl.arange(0, WP)
    total = tl.sum(tl.load(expected_ptr + wr, mask=wr < W, other=0))
    if (pid == 0) & (total > N_CAP):
        tl.atomic_max((my + OFF_STATE + 8).to(tl.pointer_type(tl.int64)), 1)
    n_valid = tl.minimum(total, N_CAP)
    recv = (my + OFF_RECV).to(tl.pointer_type(WORD))
    src_ids = (my + OFF_SRC).to(tl.pointer_type(tl.int64))
    for b in range(pid, tl.cdiv(N_CAP, BLOCK_M), nprog):
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        inb = rows < N_CAP
        ok = rows < n_valid
        tl.store(src_out_ptr + rows, tl.load(src_ids + rows, mask=ok, other=-1), mask=inb)
        if COPY_ROWS:
            r64 = rows.to(tl.int64) * WORDS
            _copy_rows_or_zero(recv + r64, out_ptr + r64, ok, inb, WORDS, BLOCK_W)


@triton.jit
def _combine_send_kernel(y_ptr, stride_y, src_ids_ptr, expected_ptr, peers_ptr, pes_ptr, RANK,
                         W: tl.constexpr, WP: tl.constexpr, N_CAP: tl.constexpr, S_MAX: tl.constexpr,
                         WORDS: tl.constexpr, ROW_BYTES: tl.constexpr,
                         OFF_ARRIVE: tl.constexpr, OFF_COMB: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, USE_NVSHMEM: tl.constexpr):
    """Received row i (< min(sum expected, N_CAP)) goes back to slot ``src_ids[i] % S_MAX`` of rank
    ``src_ids[i] // S_MAX``."""
    WORD: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my = tl.load(peers_ptr + RANK)
    wr = tl.arange(0, WP)
    n_valid = tl.minimum(tl.sum(tl.load(expected_ptr + wr, mask=wr < W, other=0)), N_CAP)
    nblocks = tl.cdiv(n_valid, BLOCK_M)
    per = tl.cdiv(nblocks, nprog)
    hist = tl.zeros([WP], tl.int64)
    for b in range(pid * per, tl.minimum(pid * per + per, nblocks)):
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        m = rows < n_valid
        code = tl.load(src_ids_ptr + rows, mask=m, other=0)
        s = code // S_MAX
        slot = code % S_MAX
        hist += tl.sum(((s[:, None] == wr[None, :]) & m[:, None]).to(tl.int64), axis=0)
        base = tl.load(peers_ptr + s, mask=m, other=0)
        _copy_rows(y_ptr + rows.to(tl.int64) * stride_y, (base + OFF_COMB + slot * ROW_BYTES).to(tl.pointer_type(WORD)),
                   m & (base != 0), WORDS, BLOCK_W)
        if USE_NVSHMEM:
            for j in range(BLOCK_M):
                rj = b * BLOCK_M + j
                if rj < n_valid:
                    cj = tl.load(src_ids_ptr + rj)
                    sj = cj // S_MAX
                    if tl.load(peers_ptr + sj) == 0:
                        nvshmem_putmem_block(my + OFF_COMB + (cj % S_MAX) * ROW_BYTES,
                                             (y_ptr + rj.to(tl.int64) * stride_y).to(tl.int64),
                                             tl.full([], ROW_BYTES, tl.int64), tl.load(pes_ptr + sj))
    _publish_counts(hist, peers_ptr, pes_ptr, my, OFF_ARRIVE + (W + RANK) * 8, W, WP, USE_NVSHMEM)


@triton.jit
def _combine_recv_kernel(out_ptr, row_S_ptr, expected_ptr, peers_ptr, RANK, S,
                         W: tl.constexpr, N_CAP: tl.constexpr, WORDS: tl.constexpr,
                         OFF_ARRIVE: tl.constexpr, OFF_COMB: tl.constexpr, COPY_ROWS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Waits for ``expected[d]`` rows back from every rank d, then copies COMB[slot] -> out[slot]
    for slot < S; slots that overflowed the destination (``row_S[slot] >= N_CAP``) get zeros."""
    WORD: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my = tl.load(peers_ptr + RANK)
    for d in range(W):
        while tl.atomic_add((my + OFF_ARRIVE + (W + d) * 8).to(tl.pointer_type(tl.int64)), 0, sem="acquire", scope="sys") < tl.load(expected_ptr + d):
            pass
    tl.debug_barrier()
    if COPY_ROWS:
        comb = (my + OFF_COMB).to(tl.pointer_type(WORD))
        for b in range(pid, tl.cdiv(S, BLOCK_M), nprog):
            slots = b * BLOCK_M + tl.arange(0, BLOCK_M)
            inb = slots < S
            ok = inb & (tl.load(row_S_ptr + slots, mask=inb, other=N_CAP) < N_CAP)
            r64 = slots.to(tl.int64) * WORDS
            _copy_rows_or_zero(comb + r64, out_ptr + r64, ok, inb, WORDS, BLOCK_W)
