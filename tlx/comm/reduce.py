"""The reducing kernels: the combine's reduce-send (per-token sums of this rank's experts, sent home
as one partial row per (token, rank)) and reduce-receive (the per-rank partial rows summed, as
they land with per-block counters, or after one count per rank), and the gate-gradient receive of
combine's backward (``exchange.py`` describes the op, the region and the legend)."""

from __future__ import annotations

import triton
import triton.language as tl

from .protocol import OP_COMBINE, OP_GATE_GRAD, _await, _end_op, _nvshmem_put_partials, _publish, _wait_geq


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
    CBLK_SIGNAL (``tlx_dist.comm.symm.policy.comb_mode`` "blocks" / "overlap"; peer pointers): instead of the one
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
    BLK (the reduce-send signalled CBLK, ``tlx_dist.comm.symm.policy.comb_mode`` "blocks"): no ARRIVE wait; token
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
