"""Phase 1 of a dispatch: the source-side routing layout in one launch (``_route_kernel``), whose
last block posts this rank's counts to every peer (``tlx/comm/exchange.py`` describes the op)."""

from __future__ import annotations

import triton
import triton.language as tl

from .protocol import OP_ROUTE, _post_counts, _wait_geq

# ---------------------------------------------------------------- routing layout (source side)
#
# Replaces the sort-based layout, in one launch (_route_kernel), per block of BLOCK_T tokens:
#   q[t, k] = rank of slot (t, k) among this rank's slots of its expert, in slot order;
#   send_row[t, d] = rank of token t among this rank's tokens sent to d (-1: none);
#   dest[t, k] = owning rank; the last block writes the count vector [counts_E | rows_to_W] and
#   publishes it (the signal). The prefix over blocks is a decoupled look-back (single-pass scan).
# Then _send_tokens (``_await``) turns every rank's count vector into this rank's start_E (first
# expanded row of (this source, expert g) on g's rank) and its offsets_e.


@triton.jit
def _route_tile(idx_ptr, b, T, K: tl.constexpr, KP: tl.constexpr, E: tl.constexpr, BLOCK_T: tl.constexpr):
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, KP)
    m = (t < T)[:, None] & (kk < K)[None, :]
    g = tl.load(idx_ptr + t[:, None] * K + kk[None, :], mask=m, other=E).to(tl.int32)  # E: no slot
    return t, kk, m, g


@triton.jit
def _route_kernel(idx_ptr, scratch_ptr, q_ptr, dest_ptr, send_row_ptr, counts_ptr, T, NB_MAX, peers_ptr, RANK,
                  K: tl.constexpr, KP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                  W: tl.constexpr, WP: tl.constexpr, E_LOCAL: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr,
                  BLOCK_T: tl.constexpr, OFF_STATE: tl.constexpr, OFF_FLAGS: tl.constexpr,
                  OFF_COUNTS: tl.constexpr, TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr,
                  pes_ptr=None, USE_NVSHMEM: tl.constexpr = False, AGG_ONLY: tl.constexpr = False,
                  DENSE: tl.constexpr = False):
    """The dispatch's source-side layout and its signal, one launch (see the section comment).
    Block b of BLOCK_T tokens: its histogram (slots per expert, token rows per destination rank),
    its exclusive prefix over blocks 0..b-1 by decoupled look-back, then q / dest / send_row; the
    last block writes the count vector and publishes it (``_post_counts``).

    Look-back (``scratch``, int64, owned by this rank's buffers, zeroed once): ``status[b]`` is
    ``tag + 1`` once block b's aggregate is in ``agg[b]``, ``tag + 2`` once its inclusive prefix is in
    ``incl[b]``; ``tag = 4 * this op's epoch``, so what earlier dispatches left there reads as "not
    ready" and nothing is reset. Block b adds predecessors' aggregates from b-1 down until one has
    its inclusive prefix. Progress needs blocks to start in index order (as every single-pass GPU
    scan assumes); the interpreter runs them in order. Every poll is bounded (``OP_ROUTE``).
    AGG_ONLY (tests): blocks after 0 never mark their inclusive prefix, so every look-back walks the
    aggregates down to block 0 -- the path concurrent blocks take on a GPU, which the in-order
    interpreter would otherwise never reach.
    DENSE (the copy-engine row form): token t's receive row is t on every rank (``send_row[t, d]`` =
    t where it has an expert on d, else -1) and the rows counted to each rank are all T tokens."""
    b = tl.program_id(0)
    nb = tl.cdiv(T, BLOCK_T)
    my = tl.load(peers_ptr + RANK)
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    epoch = tl.load((my + OFF_STATE).to(tl.pointer_type(tl.int64)))   # this op's (stable while it runs)
    tag = epoch * 4
    RW: tl.constexpr = EP + WP
    status_ptr = scratch_ptr                        # [NB_MAX]
    agg_ptr = scratch_ptr + NB_MAX                  # [NB_MAX, RW]: experts (EP), then ranks (WP)
    incl_ptr = scratch_ptr + NB_MAX + NB_MAX * RW   # [NB_MAX, RW]
    t, kk, m, g = _route_tile(idx_ptr, b, T, K, KP, E, BLOCK_T)
    ei = tl.arange(0, EP)
    wi = tl.arange(0, WP)
    S: tl.constexpr = BLOCK_T * KP
    flat = tl.reshape(g, [S])  # the block's slots in slot order; E = no slot
    h_E32 = tl.histogram(flat, EP, mask=flat < E)
    h_E = h_E32.to(tl.int64)
    dest = g // E_LOCAL
    h_W = tl.zeros([WP], tl.int64)
    for d in range(W):
        sent = tl.max((m & (dest == d)).to(tl.int32), axis=1)
        if DENSE:
            sent = (t < T).to(tl.int32)
        h_W = tl.where(wi == d, tl.sum(sent).to(tl.int64), h_W)
    x_E = tl.zeros([EP], tl.int64)
    x_W = tl.zeros([WP], tl.int64)
    if b > 0:
        tl.store(agg_ptr + b * RW + ei, h_E)
        tl.store(agg_ptr + b * RW + EP + wi, h_W)
        tl.debug_barrier()
        tl.atomic_xchg(status_ptr + b, tag + 1, sem="release", scope="gpu")
        j = b - 1
        done = 0
        while done == 0:
            _wait_geq(status_ptr + j, tag + 1, err_ptr, OP_ROUTE, j % 65536, TIMEOUT_NS, CLOCK)
            st = tl.atomic_add(status_ptr + j, 0, sem="acquire", scope="gpu")
            full = st >= tag + 2
            row = scratch_ptr + tl.where(full, NB_MAX + NB_MAX * RW, NB_MAX) + j * RW
            ready = st >= tag + 1
            x_E += tl.load(row + ei, mask=ready, other=0)
            x_W += tl.load(row + EP + wi, mask=ready, other=0)
            j -= 1
            done = (full | (j < 0) | (st < tag + 1)).to(tl.int32)   # (not ready: the wait gave up)
    i_E = x_E + h_E
    i_W = x_W + h_W
    tl.store(incl_ptr + b * RW + ei, i_E)
    tl.store(incl_ptr + b * RW + EP + wi, i_W)
    tl.debug_barrier()
    if AGG_ONLY:
        if b == 0:
            tl.atomic_xchg(status_ptr + b, tag + 2, sem="release", scope="gpu")
    else:
        tl.atomic_xchg(status_ptr + b, tag + 2, sem="release", scope="gpu")

    # Rank of each slot among the block's slots of its expert, in slot order: sort (expert, slot)
    # keys; a slot's rank is its sorted position minus its expert's first (the exclusive prefix of
    # the histogram). O(S log^2 S) and no [S, E] tile, so BLOCK_T need not shrink as E grows.
    key = tl.sort(flat * S + tl.arange(0, S))
    e_s = key // S
    p_s = key % S
    ok = e_s < E
    e_c = tl.minimum(e_s, EP - 1)
    first = tl.gather(tl.cumsum(h_E32, axis=0) - h_E32, e_c, 0)
    q = tl.arange(0, S) - first + tl.gather(x_E, e_c, 0).to(tl.int32)
    sl = (b * BLOCK_T + p_s // KP) * K + p_s % KP
    tl.store(q_ptr + sl, q, mask=ok)
    tl.store(dest_ptr + t[:, None] * K + kk[None, :], dest, mask=m)
    tm = t < T
    for d in range(W):
        sent = tl.max((m & (dest == d)).to(tl.int32), axis=1)
        base = tl.sum(tl.where(wi == d, x_W, 0))
        if DENSE:
            r = tl.where(sent > 0, t, -1)
        else:
            r = tl.where(sent > 0, base.to(tl.int32) + tl.cumsum(sent, axis=0) - 1, -1)
        tl.store(send_row_ptr + t * W + d, r, mask=tm)
    if b == tl.maximum(nb, 1) - 1:
        tl.store(counts_ptr + ei, i_E, mask=ei < E)
        tl.store(counts_ptr + E + wi, i_W, mask=wi < W)
        tl.debug_barrier()  # the counts this CTA just stored are what _post_counts loads
        _post_counts(peers_ptr, counts_ptr, RANK, epoch, W, NC, NCP, OFF_FLAGS, OFF_COUNTS, pes_ptr, USE_NVSHMEM)
