"""The exchange's protocol, shared by every phase kernel (``tlx/comm/exchange.py`` describes the
symmetric region, the ops and their kernels): bounded waits (``_wait_geq``), the count post of a
dispatch (``_post_counts``), the barrier that opens an op's first data kernel (``_await``, with the
dispatch's layout pass), the per-destination arrival adds (``_publish``), the readiness an op's
last kernel raises (``_end_op``), and the NVSHMEM route's staged puts and one-thread signals."""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvshmem as nv

try:  # device clocks for bounded waits; the interpreter counts polls instead
    from triton.language.extra.cuda import globaltimer as _globaltimer
    from triton.language.extra.hip import memrealtime as _memrealtime
except ImportError:  # pragma: no cover - builds without the CUDA/HIP extras
    _globaltimer = _memrealtime = None

# CLOCK constexpr of the waiting kernels: what "time" a bounded wait reads.
CLOCK_POLLS = 0       # Triton interpreter: a poll counts as a microsecond
CLOCK_GLOBALTIMER = 1  # NVIDIA %globaltimer, ns
CLOCK_MEMREALTIME = 2  # AMD s_memrealtime, a 100 MHz constant clock: 10 ns a tick

OP_BARRIER = tl.constexpr(1)
OP_TOKENS = tl.constexpr(2)
OP_COMBINE = tl.constexpr(3)
OP_GATE_GRAD = tl.constexpr(4)
OP_ROUTE = tl.constexpr(5)  # a route block waiting for an earlier block of its own launch (look-back)


@triton.jit
def _now_ns(CLOCK: tl.constexpr):
    if CLOCK == 1:
        return _globaltimer()
    else:
        return _memrealtime() * 10


@triton.jit
def _wait_geq(flag_ptr, target, err_ptr, OP: tl.constexpr, peer, TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr):
    """Polls ``*flag_ptr >= target`` (acquire, system scope). Gives up after TIMEOUT_NS, or at once
    when an earlier wait of this rank already failed, recording ``OP << 16 | peer`` in ``*err_ptr``."""
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    err = tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys")
    waited = tl.zeros([], tl.int64)
    if CLOCK == 0:
        t0 = tl.zeros([], tl.int64)
    else:
        t0 = _now_ns(CLOCK).to(tl.int64)
    while (v < target) & (err == 0) & (waited < TIMEOUT_NS):
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        err = tl.atomic_add(err_ptr, 0, sem="relaxed", scope="sys")
        if CLOCK == 0:
            waited += 1000  # a poll counts as a microsecond
        else:
            waited = _now_ns(CLOCK).to(tl.int64) - t0
    if v < target:  # one failed wait is reported (the largest code if several fail at once)
        tl.atomic_max(err_ptr, tl.full([], OP * 65536, tl.int64) + peer, sem="relaxed", scope="sys")


@triton.jit
def _release_to_peer(base, off, v, MAX: tl.constexpr, USE_NVSHMEM: tl.constexpr):
    """A scalar release op (system scope, one thread) on the int64 at ``base + off`` of a peer
    reached by pointer: ``max`` with ``v`` (MAX: a flag raised to an epoch) or ``add v`` (a
    counter). USE_NVSHMEM: a peer without a pointer (``base == 0``) is skipped; its signal goes by
    ``_nvshmem_signal``."""
    p = (base + off).to(tl.pointer_type(tl.int64))
    if USE_NVSHMEM:
        if base != 0:
            _release_op(p, v, MAX)
    else:
        _release_op(p, v, MAX)


@triton.jit
def _release_op(p, v, MAX: tl.constexpr):
    if MAX:
        tl.atomic_max(p, v, sem="release", scope="sys")
    else:
        tl.atomic_add(p, v, sem="release", scope="sys")


@triton.jit
def _post_counts(peers_ptr, counts_ptr, RANK, epoch,
                 W: tl.constexpr, NC: tl.constexpr, BLOCK_C: tl.constexpr,
                 OFF_FLAGS: tl.constexpr, OFF_COUNTS: tl.constexpr, pes_ptr, USE_NVSHMEM: tl.constexpr):
    """(One CTA; the dispatch's phase 1.) Writes my count vector into every peer's COUNTS (row
    RANK of the buffer ``epoch % 2``), then raises CFLAGS[RANK] = epoch on every peer (release).
    USE_NVSHMEM: off-node peers get my COUNTS row (written to my own region as d == RANK) by a
    block put, then one thread's signal SET after ``nvshmem_quiet``. A peer writes my COUNTS only
    once it is in this op, so it has finished the op that last read this buffer (two ops ago)."""
    my = tl.load(peers_ptr + RANK)
    ci = tl.arange(0, BLOCK_C)
    cm = ci < NC
    c = tl.load(counts_ptr + ci, mask=cm, other=0)
    row_off = OFF_COUNTS + ((epoch % 2) * W + RANK) * (NC * 8)
    for d in range(W):
        base = tl.load(peers_ptr + d)
        if USE_NVSHMEM:
            if base != 0:
                tl.store((base + row_off).to(tl.pointer_type(tl.int64)) + ci, c, mask=cm)
        else:
            tl.store((base + row_off).to(tl.pointer_type(tl.int64)) + ci, c, mask=cm)
    if USE_NVSHMEM:  # my own row (d == RANK above) is the symmetric source of the puts
        tl.debug_barrier()
        nv.fence_sys()
        for d in range(W):
            base = tl.load(peers_ptr + d)
            pe = tl.load(pes_ptr + d)
            if base == 0:
                nv.putmem_block(my + row_off, my + row_off, tl.full([], NC * 8, tl.int64), pe)
    tl.debug_barrier()
    cflag = OFF_FLAGS + (W + RANK) * 8
    for d in range(W):
        _release_to_peer(tl.load(peers_ptr + d), cflag, epoch, True, USE_NVSHMEM)
    if USE_NVSHMEM:
        _nvshmem_signal(tl.zeros([BLOCK_C], tl.int64) + epoch, peers_ptr, pes_ptr, my + cflag, W, BLOCK_C,
                        nv.SIGNAL_SET)


@triton.jit
def _end_op(peers_ptr, RANK, W: tl.constexpr, WP3: tl.constexpr, OFF_STATE: tl.constexpr,
            OFF_FLAGS: tl.constexpr, OFF_ARRIVE: tl.constexpr, pes_ptr, USE_NVSHMEM: tl.constexpr):
    """At the end of an op's last kernel, every CTA: the last CTA to finish (a done counter in
    STATE[3]) moves this rank to the next op -- epoch += 1, ARRIVE zeroed -- and raises
    FLAGS[RANK] = the new epoch on every peer (release): "ready for my next op", the barrier that
    the next op's first kernel waits for. So no op launches a signal of its own, and the signal is
    raised by an earlier launch than the wait, as the emulated world needs."""
    my = tl.load(peers_ptr + RANK)
    state = (my + OFF_STATE).to(tl.pointer_type(tl.int64))
    tl.debug_barrier()  # this CTA's reads of ARRIVE and its stores are done
    old = tl.atomic_add(state + 3, 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(0) - 1:
        tl.atomic_xchg(state + 3, 0, sem="relaxed", scope="gpu")
        epoch = tl.load(state) + 1
        tl.store(state, epoch)
        wi = tl.arange(0, WP3)
        tl.store((my + OFF_ARRIVE).to(tl.pointer_type(tl.int64)) + wi, tl.zeros([WP3], tl.int64), mask=wi < 3 * W)
        tl.debug_barrier()
        for d in range(W):
            _release_to_peer(tl.load(peers_ptr + d), OFF_FLAGS + RANK * 8, epoch, True, USE_NVSHMEM)
        if USE_NVSHMEM:  # epoch >= 2: every off-node peer gets FLAGS[RANK] = epoch
            _nvshmem_signal(tl.zeros([WP3], tl.int64) + epoch, peers_ptr, pes_ptr, my + OFF_FLAGS + RANK * 8, W,
                            WP3, nv.SIGNAL_SET)


@triton.jit
def _await(peers_ptr, lay_ptr, offs_ptr, RANK,
           W: tl.constexpr, WP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
           E_LOCAL: tl.constexpr, NC: tl.constexpr,
           OFF_STATE: tl.constexpr, OFF_FLAGS: tl.constexpr, OFF_COUNTS: tl.constexpr,
           HAS_COUNTS: tl.constexpr, TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr, OFFS_CAP: tl.constexpr = -1,
           starts_ptr=None, STARTS: tl.constexpr = False):
    """At the top of every op's first data kernel (every CTA): waits FLAGS[s] >= epoch for every
    s (peer s finished its previous op: ``_end_op``) -- or, with counts (dispatch), CFLAGS[s] >=
    epoch (peer s posted this op's counts, ``_post_counts``, which it does only once in this op).
    ``epoch`` = STATE[0], this rank's current op, stable while the op runs. With counts
    (dispatch), turns the published count matrix C[s, g] (slots of source s for expert g) into
    this rank's layout -- every CTA computes and stores the same values, then reads ``start``
    back (a benign race of identical stores):
        lay[0:E]          start[g] = first expanded row of (this source, expert g) on g's rank
                          = sum_{g' < g, same rank} sum_s C[s, g'] + sum_{s < RANK} C[s, g]
        lay[E:E+e]        rows per local expert;  offs[0:e] (int32) their cumulative ends, capped
                          at OFFS_CAP (>= 0: the expanded rows the op has; the grouped GEMMs'
                          offsets, so no torch op clamps them afterwards)
        lay[E+e:E+e+W]    token rows this rank receives from each source.
    STARTS (the receiving side of a dispatch whose META carries raw slot codes): also
        starts[s, j]      first expanded row of (source s, local expert j) on this rank
                          = sum_{g' < g, same rank} sum_s' C[s', g'] + sum_{s' < s} C[s', g]."""
    my = tl.load(peers_ptr + RANK)
    epoch = tl.load((my + OFF_STATE).to(tl.pointer_type(tl.int64)))
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    flags = OFF_FLAGS + W * 8 if HAS_COUNTS else OFF_FLAGS   # CFLAGS (counts posted) or FLAGS (ready)
    for s in range(W):
        _wait_geq((my + flags + s * 8).to(tl.pointer_type(tl.int64)), epoch, err_ptr,
                  OP_BARRIER, s, TIMEOUT_NS, CLOCK)
    tl.debug_barrier()
    if HAS_COUNTS:
        si = tl.arange(0, WP)
        ei = tl.arange(0, EP)
        cm = (si < W)[:, None] & (ei < E)[None, :]
        rows = (my + OFF_COUNTS + ((epoch % 2) * W + si) * (NC * 8)).to(tl.pointer_type(tl.int64))
        C = tl.load(rows[:, None] + ei[None, :], mask=cm, other=0)
        tot = tl.sum(C, axis=0)
        src_prefix = tl.sum(tl.where((si < RANK)[:, None], C, 0), axis=0)
        seg = ei // E_LOCAL
        # exclusive prefix of tot within each rank's segment of experts: the global exclusive
        # prefix minus the segment's start, from [W, E] tiles (an [E, E] "earlier in my segment"
        # tile is 64K int64 elements at E = 256: spilled registers in this one-CTA kernel)
        excl = tl.cumsum(tot, axis=0) - tot
        seg_start = tl.sum(tl.where(seg[None, :] < si[:, None], tot[None, :], 0), axis=1)
        seg_excl = excl - tl.sum(tl.where(si[:, None] == seg[None, :], seg_start[:, None], 0), axis=0)
        tl.store(lay_ptr + ei, seg_excl + src_prefix, mask=ei < E)
        mine = (seg == RANK) & (ei < E)
        tl.store(lay_ptr + E + ei - RANK * E_LOCAL, tot, mask=mine)
        ends = seg_excl + tot
        if OFFS_CAP >= 0:
            ends = tl.minimum(ends, OFFS_CAP)
        tl.store(offs_ptr + ei - RANK * E_LOCAL, ends.to(tl.int32), mask=mine)
        tl.store(lay_ptr + E + E_LOCAL + si, tl.load(rows + E + RANK, mask=si < W, other=0), mask=si < W)
        if STARTS:
            src_excl = tl.cumsum(C, axis=0) - C  # [W, E]: slots of expert g from sources before s
            tl.store(starts_ptr + si[:, None] * E_LOCAL + (ei - RANK * E_LOCAL)[None, :],
                     seg_excl[None, :] + src_excl, mask=(si < W)[:, None] & mine[None, :])
    tl.debug_barrier()


@triton.jit
def _publish(hist, peers_ptr, slot_off, W: tl.constexpr, WP: tl.constexpr, pes_ptr, RANK,
             USE_NVSHMEM: tl.constexpr):
    """After this CTA's stores: add ``hist[d]`` to the counter at ``peers[d] + slot_off`` (one
    scalar release add per destination, issued by one thread, after a CTA barrier). USE_NVSHMEM:
    off-node destinations get the add as an NVSHMEM signal (after this CTA's puts completed)."""
    tl.debug_barrier()
    wr = tl.arange(0, WP)
    for d in range(W):
        n = tl.sum(tl.where(wr == d, hist, 0))
        if n > 0:
            _release_to_peer(tl.load(peers_ptr + d), slot_off, n, False, USE_NVSHMEM)
    if USE_NVSHMEM:
        _nvshmem_signal(hist, peers_ptr, pes_ptr, tl.load(peers_ptr + RANK) + slot_off, W, WP, nv.SIGNAL_ADD)


# ---------------------------------------------------------------- the NVSHMEM route (USE_NVSHMEM)


@triton.jit
def _nvshmem_signal(vals, peers_ptr, pes_ptr, sig_addr, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr):
    """After a CTA barrier: one thread makes the CTA's stores visible system-wide and completes
    this PE's puts (``nvshmem_quiet``), then applies ``OP vals[d]`` to the counter at symmetric
    ``sig_addr`` of every off-node peer d with ``vals[d] > 0``. What a thread-0-only region must
    not hold (reductions, barriers, the loads) runs on every thread outside it."""
    wr = tl.arange(0, WP)
    if nv.one_thread():
        nv.fence_sys()
        nv.quiet()
    for d in range(W):
        n = tl.sum(tl.where(wr == d, vals, 0))
        base = tl.load(peers_ptr + d)
        pe = tl.load(pes_ptr + d)
        if (n > 0) & (base == 0):
            if nv.one_thread():
                nv.signal_op(sig_addr, n.to(tl.uint64), OP, pe)


@triton.jit
def _nvshmem_put_tokens(x_ptr, stride_x, b, T, far_any, send_row_ptr, gate_ptr, peers_ptr, pes_ptr, my, RANK,
                        W: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, D: tl.constexpr,
                        T_MAX: tl.constexpr, META_W: tl.constexpr, OFF_META: tl.constexpr,
                        OFF_GATES: tl.constexpr, OFF_RECV: tl.constexpr, OFF_SROWS: tl.constexpr,
                        OFF_SMETA: tl.constexpr, OFF_SGATES: tl.constexpr, WITH_META: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tokens of block b bound for another node (``far_any[t] > 0``): stage row t (and its gates)
    once in SROWS[t] (SGATES[t]); their META rows are already in SMETA[t, d]. Then every thread
    walks the block's (token, off-node destination) pairs and puts row, META and gates from the
    staged copies to the receiver's slots, one block-collective put each."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    t64 = t.to(tl.int64)
    rem = far_any > 0
    srows = tl.multiple_of((my + OFF_SROWS).to(tl.pointer_type(DT)), 16) + t64 * D
    for c0 in range(0, D, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cm = rem[:, None] & (cols < D)[None, :]
        tl.store(srows[:, None] + cols[None, :], tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=cm),
                 mask=cm)
    if WITH_META:
        kk = tl.arange(0, KP)
        mk = rem[:, None] & (kk < K)[None, :]
        sg = (my + OFF_SGATES).to(tl.pointer_type(DT)) + t64 * K
        tl.store(sg[:, None] + kk[None, :], tl.load(gate_ptr + t[:, None] * K + kk[None, :], mask=mk), mask=mk)
    tl.debug_barrier()
    nv.fence_sys()  # every thread: its staged stores are visible to the NIC before the puts read them
    if tl.max(far_any) > 0:
        for j in range(BLOCK_T):
            tj = b * BLOCK_T + j
            if tj < T:
                tj64 = tj.to(tl.int64)
                for d in range(W):
                    base = tl.load(peers_ptr + d)
                    rj = tl.load(send_row_ptr + tj * W + d)
                    pe = tl.load(pes_ptr + d)
                    if (base == 0) & (rj >= 0):
                        dst = (RANK * T_MAX + rj).to(tl.int64)
                        nv.putmem_block(my + OFF_RECV + dst * (D * ES), my + OFF_SROWS + tj64 * (D * ES),
                                        tl.full([], D * ES, tl.int64), pe)
                        if WITH_META:
                            nv.putmem_block(my + OFF_META + dst * (META_W * 4),
                                            my + OFF_SMETA + (tj64 * W + d) * (META_W * 4),
                                            tl.full([], META_W * 4, tl.int64), pe)
                            nv.putmem_block(my + OFF_GATES + dst * (K * ES), my + OFF_SGATES + tj64 * (K * ES),
                                            tl.full([], K * ES, tl.int64), pe)


@triton.jit
def _far_row(b, j, rows_from_ptr, peers_ptr, W: tl.constexpr, T_MAX: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row j of receive-row block b: ``(n, its source s, whether n is a received row of an off-node
    source)`` -- scalars, so the puts that follow stay under control flow uniform over the CTA."""
    nj = b * BLOCK_R + j
    sj = nj // T_MAX
    inr = nj < W * T_MAX
    base = tl.load(peers_ptr + sj, mask=inr, other=1)
    ok = inr & ((nj % T_MAX) < tl.load(rows_from_ptr + sj, mask=inr, other=0))
    return nj, sj, ok & (base == 0)


@triton.jit
def _nvshmem_put_partials(b, rows_from_ptr, tok_ptr, far, peers_ptr, pes_ptr, my, RANK,
                          W: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr, ES: tl.constexpr,
                          OFF_COMB: tl.constexpr, OFF_SCOMB: tl.constexpr, BLOCK_R: tl.constexpr):
    """Received rows of block b whose source is off-node (their partial sums staged in SCOMB[n]):
    one block-collective put each into row (token, RANK) of the source's COMB."""
    tl.debug_barrier()
    nv.fence_sys()
    if tl.max(far.to(tl.int32)) > 0:
        for j in range(BLOCK_R):
            nj, sj, off_node = _far_row(b, j, rows_from_ptr, peers_ptr, W, T_MAX, BLOCK_R)
            if off_node:
                tok = tl.load(tok_ptr + nj).to(tl.int64)
                nv.putmem_block(my + OFF_COMB + (RANK * T_MAX + tok) * (D * ES),
                                my + OFF_SCOMB + nj.to(tl.int64) * (D * ES),
                                tl.full([], D * ES, tl.int64), tl.load(pes_ptr + sj))


@triton.jit
def _nvshmem_put_gate_grads(b, rows_from_ptr, pos_ptr, tok_ptr, far, peers_ptr, pes_ptr, my,
                            W: tl.constexpr, K: tl.constexpr, T_MAX: tl.constexpr, AB: tl.constexpr,
                            OFF_DGATE: tl.constexpr, OFF_SDGATE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Received rows of block b whose source is off-node (gate gradients staged in SDGATE[n, k]):
    each run of consecutive slots k that live on this rank (``pos[n, k] >= 0``) is one
    block-collective put into the source's DGATE[token, k...] (the other slots belong to other ranks)."""
    tl.debug_barrier()
    nv.fence_sys()
    if tl.max(far.to(tl.int32)) > 0:
        for j in range(BLOCK_R):
            nj, sj, off_node = _far_row(b, j, rows_from_ptr, peers_ptr, W, T_MAX, BLOCK_R)
            if off_node:
                pe = tl.load(pes_ptr + sj)
                tok = tl.load(tok_ptr + nj).to(tl.int64)
                start = tl.full([], -1, tl.int32)  # first slot of the current run, -1: none
                for k in tl.static_range(K + 1):
                    if k < K:
                        here = (tl.load(pos_ptr + nj * K + k) >= 0).to(tl.int32)
                    else:
                        here = tl.full([], 0, tl.int32)
                    if (here == 0) & (start >= 0):
                        s64 = start.to(tl.int64)
                        nv.putmem_block(my + OFF_DGATE + (tok * K + s64) * AB,
                                        my + OFF_SDGATE + (nj.to(tl.int64) * K + s64) * AB,
                                        (k - s64) * AB, pe)
                    start = tl.where(here != 0, tl.where(start < 0, k, start), -1)
