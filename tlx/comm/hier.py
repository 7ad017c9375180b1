"""Hierarchical (per-node) token exchange: the kernels of its inter-node leg and its relays.

Legend: W ranks in N nodes of L ranks (rank v is local rank ``v % L`` of node ``v // L``), E experts,
e = E/W, K top-k, T tokens of this rank (at most T_MAX), D hidden, R = W * T_MAX. The *relay* of
source s = (n, l) on node m != n is rank (m, l): the rank of node m with the source's local index.

The flat exchange (``exchange.py``) sends a token row once per destination *rank*. Here a row
crosses to each destination *node* once, to its relay, which forwards it over NVLink (peer
pointers) to the node's ranks that own its experts; the flat kernels still carry everything that
stays inside a node. The rows end where the flat exchange puts them -- row ``send_row[t, j]`` of
source s's block of rank j's RECV, with the same META and GATES -- so the flat expand, gate-gradient
and reduce-receive kernels run unchanged after these. Combine reverses it: owners send partial rows
of other nodes' tokens to the relay (HCOMB), the relay sums them (fp32, one rounding) and sends one
row per (token, node) home, into the source's COMB row of the relay's rank.

Ops (``tlx_dist.comm.hier``), kernels in launch order ("|": a phase boundary):
    dispatch:  _route (flat) + _node_route | _send_tokens (flat, the near columns of send_row) +
               _hier_send (one row per (token, remote node) to its relay, with HMETA and gates; its
               first program posts the node counts) | _relay_forward (waits for each remote source's
               count and rows, forwards rows, META and gates, ARRIVE adds) | _expand (flat; ends the op)
    combine:   _reduce_send (flat, near sources' rows) + _hier_reduce_send (other nodes' rows: partial
               rows to the relay's HCOMB) | _relay_combine (waits, sums per token, one row home) |
               _reduce_recv (flat, over the combine view of send_row; ends the op)
    combine's backward: _send_tokens (flat, near) + _hier_send (dy rows, no metadata) | _relay_forward
               (rows only, from the dispatch's saved HMETA) | _expand GATE_GRAD (flat) | _gate_grad_recv
    dispatch's backward: the combine, ungated.
    overlapped dispatch (the row form): _route + _node_route | _send_tokens + _hier_send SPLIT=1 (all
               but the token rows) | _relay_forward SPLIT=1 (META and gates) | _expand (NEAR_L: copies
               this node's rows; does not end the op) -- the op returns -- then on the side stream
               _hier_send SPLIT=2 (the token rows, HRROWS adds) | _relay_forward SPLIT=2 (rows to the
               owners, HFROWS adds; ends the op); the owner's _rows_wait_kernel waits on HFROWS.
  Gate gradients of combine's backward go from each owner to the source directly (K * 8 bytes a row,
  the flat route): only token and partial rows follow the hierarchy.

Symmetric region (after the flat regions; offsets from the host, ``tlx_dist.comm.hier.HierLayout``):
    HFLAG   [W]     int64  HFLAG[s] = the dispatch whose node count source s posted here (SET)
    HCNT    [W]     int64  inter-node rows source s sends this relay in that dispatch
    HARRIVE [W]     int64  inter-node rows of source s landed here (ADD); the forward zeroes it
    HCARR   [W]     int64  partial rows of source s's tokens landed here from this node's owners (ADD);
                           the relay's combine zeroes it
    HDONE   [3]     int64  programs of _relay_forward / _relay_combine / _relay_forward SPLIT=2 done
                           (the last one zeroes)
    HRROWS  [W]     int64  an overlapped dispatch's inter-node token rows of source s landed here (ADD);
                           its _relay_forward SPLIT=2 takes them off
    HFROWS  [W]     int64  its rows of source s on another node forwarded into this rank's RECV (ADD);
                           the owner's wait takes them off
    HMETA   [R, HM] int32  HM = 2K + L + 1 words per inter-node row (source s's block, row r):
                           [0, K)      slot k's code on this node (what the flat send puts in META:
                                       the expanded row, or the raw code q * e + j), -1: another node
                           [K, 2K)     the local rank of slot k's owner, -1 likewise
                           [2K, 2K+L)  the row's receive row on local rank i (the source's
                                       send_row[t, node * L + i]), -1: not sent there
                           2K + L      the source token
    HCOMB   [N, T_MAX, L, D]   partial rows for (source node, token, local owner)
  staging, with NVSHMEM (sources of puts must be symmetric):
    SHCNT   [N]     int64  this source's rows to each node
    SHMETA  [T_MAX, N, HM] int32  the HMETA row of (token, node)
    and the flat SROWS (token rows), SGATES (their gates), SCOMB (the relay's summed rows).

Inter-node rows of source s on its relay: block s of RECV / GATES / HMETA, row ``nrow[t, m]``: the
tokens the relay itself receives first, at their flat receive row ``send_row[t, relay]`` (so the
relay's own rows need no copy), then the node's other tokens in token order. A relay whose pointer
is known (an emulated world on one GPU, where every virtual rank has one) gets plain stores; one
without (``peers[d] == 0``, USE_NVSHMEM) NVSHMEM puts from the staging regions, then one thread's
signal, as in ``protocol.py``. Every wait is bounded (``_wait_geq``: OP_RELAY_ROWS, OP_RELAY_PARTIALS).

Per-leg counters (``ctr``, int64 [8], this rank's, accumulated): [0] inter-node rows sent by
dispatch-direction ops (dispatch, combine's backward), [1] their payload bytes, [2] rows stored into
another rank of the node by a relay's forward, [3] bytes; [4] inter-node rows of combine-direction
ops (combine, dispatch's backward) a relay sent home, [5] bytes, [6] partial rows an owner stored into
its node's relay, [7] bytes. (What the flat kernels move inside a node is added by the host from
the same index tensors.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from tlx.common.fp8_quant import round_to

from . import nvshmem as nv
from .reduce import _reduce_slot
from .protocol import _end_op, _nvshmem_signal, _publish, _release_to_peer, _wait_geq

OP_RELAY_ROWS = tl.constexpr(6)      # a relay waiting for a remote source's count or inter-node rows
OP_RELAY_PARTIALS = tl.constexpr(7)  # a relay waiting for its node's partial rows of a remote source


# ---------------------------------------------------------------- node route (phase 1 of a dispatch)


@triton.jit
def _node_route_kernel(idx_ptr, send_row_ptr, counts_ptr, nrow_ptr, near_ptr, comb_row_ptr, ncnt_ptr, comb_to_ptr,
                       T, RANK, K: tl.constexpr, KP: tl.constexpr, E: tl.constexpr, E_LOCAL: tl.constexpr,
                       W: tl.constexpr, WP: tl.constexpr, L: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """(One program, after the flat ``_route_kernel``, whose ``send_row`` [T, W] and count vector
    ``counts`` [E + W] it reads.) Walks token blocks in order, carrying per node the rows numbered
    so far, and writes:
        nrow[t, m]      int32 [T, N]: row of t in this rank's block of relay (m, l)'s RECV: its flat
                        receive row there if the relay gets t, else ``rows_to[relay]`` + its rank among
                        the node's other tokens; -1 for this node and nodes t does not reach
        near[t, d]      int32 [T, W]: send_row with the columns of other nodes' ranks -1 (the flat
                        send moves what stays inside the node)
        comb_row[t, d]  int32 [T, W]: where t's combine rows come from -- ranks of this node t went to
                        (send_row), the relay of each remote node t reached (nrow), else -1
        ncnt[m]         int64 [N]: rows to each node's relay (0 for this node)
        comb_to[d]      int64 [W]: combine rows expected from rank d (rows_to for this node's ranks,
                        ncnt for the relays)
    One program: the prefix is a short serial walk (a few [BLOCK_T, K] tiles per block) beside the
    flat route's single-pass scan."""
    node = RANK // L
    l = RANK % L
    ni = tl.arange(0, NP)
    wi = tl.arange(0, WP)
    kk = tl.arange(0, KP)
    rt_N = tl.load(counts_ptr + E + ni * L + l, mask=ni < N, other=0).to(tl.int32)  # rows to each relay
    carry = tl.zeros([NP], tl.int32)
    for b in range(0, tl.cdiv(T, BLOCK_T)):
        t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        mk = tm[:, None] & (kk < K)[None, :]
        g = tl.load(idx_ptr + t[:, None] * K + kk[None, :], mask=mk, other=0).to(tl.int32)
        gnode = tl.where(mk, g // (E_LOCAL * L), -1)
        for m in range(N):
            reach = tl.max((gnode == m).to(tl.int32), axis=1) > 0
            sr = tl.load(send_row_ptr + t * W + m * L + l, mask=tm, other=-1)
            other = reach & (sr < 0) & (m != node)
            oi = other.to(tl.int32)
            first = tl.sum(tl.where(ni == m, rt_N + carry, 0))
            nr = tl.where(sr >= 0, sr, tl.where(other, first + tl.cumsum(oi, 0) - oi, -1))
            nr = tl.where(m == node, -1, nr)
            tl.store(nrow_ptr + t * N + m, nr, mask=tm)
            carry = tl.where(ni == m, carry + tl.sum(oi), carry)
        tl.debug_barrier()  # the nrow this program just stored are read back below
        for d in range(W):
            sr = tl.load(send_row_ptr + t * W + d, mask=tm, other=-1)
            same = (d // L) == node
            tl.store(near_ptr + t * W + d, tl.where(same, sr, -1), mask=tm)
            relay = ((d % L) == l) & ((d // L) != node)
            nr = tl.load(nrow_ptr + t * N + d // L, mask=tm & relay, other=-1)
            tl.store(comb_row_ptr + t * W + d, tl.where(same, sr, tl.where(relay, nr, -1)), mask=tm)
    ncnt = tl.where((ni != node) & (ni < N), rt_N + carry, 0).to(tl.int64)
    tl.store(ncnt_ptr + ni, ncnt, mask=ni < N)
    rows_to = tl.load(counts_ptr + E + wi, mask=wi < W, other=0)
    wnode = wi // L
    relay_w = ((wi % L) == l) & (wnode != node)
    via = tl.sum(tl.where(wnode[:, None] == ni[None, :], ncnt[None, :], 0), axis=1)
    tl.store(comb_to_ptr + wi, tl.where(wnode == node, rows_to, tl.where(relay_w, via, 0)), mask=wi < W)


# ---------------------------------------------------------------- inter-node send (phase 2)


@triton.jit
def _hmeta_pieces(hm, t, rows_m, g, q, start_ptr, m, L: tl.constexpr, LP: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, E_LOCAL: tl.constexpr, RAW_META: tl.constexpr, send_row_ptr, W: tl.constexpr):
    """Stores the HMETA rows of tokens ``t`` for node m at ``hm`` (int32 row pointers, ``rows_m``:
    which rows to write): slot codes and owners on node m, the receive row on each of its ranks, t."""
    kk = tl.arange(0, KP)
    mk = rows_m[:, None] & (kk < K)[None, :]
    owner = g // E_LOCAL
    here = mk & ((owner // L) == m)
    if RAW_META:
        code = q * E_LOCAL + g - owner * E_LOCAL
    else:
        code = (tl.load(start_ptr + g, mask=here, other=0) + q).to(tl.int32)
    tl.store(hm[:, None] + kk[None, :], tl.where(here, code, -1), mask=mk)
    tl.store(hm[:, None] + K + kk[None, :], tl.where(here, owner % L, -1), mask=mk)
    li = tl.arange(0, LP)
    ml = rows_m[:, None] & (li < L)[None, :]
    dr = tl.load(send_row_ptr + t[:, None] * W + m * L + li[None, :], mask=ml, other=-1)
    tl.store(hm[:, None] + 2 * K + li[None, :], dr, mask=ml)
    tl.store(hm + 2 * K + L, t, mask=rows_m)


@triton.jit
def _hier_send_kernel(x_ptr, stride_x, T, nrow_ptr, send_row_ptr, idx_ptr, q_ptr, start_ptr, gate_ptr, ncnt_ptr,
                      ctr_ptr, peers_ptr, RANK,
                      W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      E_LOCAL: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, N: tl.constexpr,
                      D: tl.constexpr, T_MAX: tl.constexpr, HM: tl.constexpr,
                      OFF_STATE: tl.constexpr, OFF_RECV: tl.constexpr, OFF_GATES: tl.constexpr,
                      OFF_HMETA: tl.constexpr, OFF_HFLAG: tl.constexpr, OFF_HCNT: tl.constexpr,
                      OFF_HARRIVE: tl.constexpr, WITH_META: tl.constexpr, RAW_META: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, pes_ptr=None, OFF_SROWS: tl.constexpr = 0,
                      OFF_SGATES: tl.constexpr = 0, OFF_SHMETA: tl.constexpr = 0, OFF_SHCNT: tl.constexpr = 0,
                      USE_NVSHMEM: tl.constexpr = False, SPLIT: tl.constexpr = 0, OFF_HRROWS: tl.constexpr = 0):
    """The inter-node leg of a dispatch-direction op (after the flat send, which passed the op's
    barrier and, without RAW_META, computed ``start``): token t goes to row ``RANK*T_MAX + nrow[t, m]``
    of relay (m, l)'s RECV for every node m with ``nrow[t, m] >= 0``; WITH_META also its HMETA row
    (slot codes as the flat send computes them: ``start[g] + q``, RAW_META ``q * e + j``) and its K
    gates. Then one release add per relay of the rows sent (HARRIVE[RANK]). WITH_META: program 0
    first posts ``ncnt[m]`` into relay (m, l)'s HCNT[RANK] and raises its HFLAG[RANK] to this op's
    epoch (so a relay expecting nothing still hears from every source). USE_NVSHMEM: relays
    without a pointer get the rows, HMETA rows and gates staged (SROWS once per token, SHMETA per
    (token, node), SGATES) and put, the count put from SHCNT, and the adds and the flag as NVSHMEM
    signals. Counters: ctr[0] += rows sent, ctr[1] += their payload bytes.
    SPLIT (the overlapped dispatch, its two halves): 1 -- WITH_META, everything but the token rows
    (the count, the flag, HMETA rows and gates; the HARRIVE add then counts the rows whose metadata
    landed; no counters); 2 -- the token rows alone, outside the op (the relays' HRROWS add instead
    of HARRIVE; the counters)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    node = RANK // L
    l = RANK % L
    wr = tl.arange(0, WP)
    my = tl.load(peers_ptr + RANK)
    if WITH_META:
        if pid == 0:  # the node counts, then the flag (release: the count is visible before it)
            epoch = tl.load((my + OFF_STATE).to(tl.pointer_type(tl.int64)))
            for m in range(N):
                rr = m * L + l
                c = tl.load(ncnt_ptr + m)
                base = tl.load(peers_ptr + rr)
                if m != node:
                    if base != 0:
                        tl.store((base + OFF_HCNT + RANK * 8).to(tl.pointer_type(tl.int64)), c)
                    if USE_NVSHMEM:
                        tl.store((my + OFF_SHCNT + m * 8).to(tl.pointer_type(tl.int64)), c)
            if USE_NVSHMEM:
                tl.debug_barrier()
                nv.fence_sys()
                for m in range(N):
                    rr = m * L + l
                    base = tl.load(peers_ptr + rr)
                    if (m != node) & (base == 0):
                        nv.putmem_block(my + OFF_HCNT + RANK * 8, my + OFF_SHCNT + m * 8, tl.full([], 8, tl.int64),
                                        tl.load(pes_ptr + rr))
            tl.debug_barrier()
            hflag_off = tl.full([], OFF_HFLAG, tl.int64) + RANK * 8  # (int64: the regions lie past 2**31 bytes)
            for m in range(N):
                if m != node:
                    _release_to_peer(tl.load(peers_ptr + m * L + l), hflag_off, epoch, True, USE_NVSHMEM)
            if USE_NVSHMEM:
                relay_w = ((wr % L) == l) & ((wr // L) != node) & (wr < W)
                _nvshmem_signal(tl.where(relay_w, epoch, 0), peers_ptr, pes_ptr, my + OFF_HFLAG + RANK * 8, W, WP,
                                nv.SIGNAL_SET)
    hist = tl.zeros([WP], tl.int64)
    kk = tl.arange(0, KP)
    for b in range(pid, tl.cdiv(T, BLOCK_T), nprog):
        t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        t64 = t.to(tl.int64)
        mk = tm[:, None] & (kk < K)[None, :]
        if WITH_META:
            g = tl.load(idx_ptr + t[:, None] * K + kk[None, :], mask=mk, other=0).to(tl.int32)
            q = tl.load(q_ptr + t[:, None] * K + kk[None, :], mask=mk, other=0).to(tl.int32)
            gk = tl.load(gate_ptr + t[:, None] * K + kk[None, :], mask=mk, other=0.0)
        far_any = tl.zeros([BLOCK_T], tl.int32)
        for m in range(N):
            r = tl.load(nrow_ptr + t * N + m, mask=tm, other=-1)
            sent = r >= 0
            rr = m * L + l
            base = tl.load(peers_ptr + rr)
            hist += tl.where(wr == rr, tl.sum(sent.to(tl.int64)), 0)
            near = sent & (base != 0)
            dst = (RANK * T_MAX + r).to(tl.int64)
            recv = tl.multiple_of((base + OFF_RECV).to(tl.pointer_type(DT)), 16) + dst * D
            if SPLIT != 1:
                for c0 in range(0, D, BLOCK_D):
                    cols = c0 + tl.arange(0, BLOCK_D)
                    cm = near[:, None] & (cols < D)[None, :]
                    v = tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=cm)
                    tl.store(recv[:, None] + cols[None, :], v, mask=cm)
            if WITH_META:
                hm = (base + OFF_HMETA).to(tl.pointer_type(tl.int32)) + dst * HM
                _hmeta_pieces(hm, t, near, g, q, start_ptr, m, L, LP, K, KP, E_LOCAL, RAW_META, send_row_ptr, W)
                gt = tl.multiple_of((base + OFF_GATES).to(tl.pointer_type(DT)), 16) + dst * K
                tl.store(gt[:, None] + kk[None, :], gk, mask=near[:, None] & (kk < K)[None, :])
            if USE_NVSHMEM:
                far = sent & (base == 0)
                far_any = far_any | far.to(tl.int32)
                if WITH_META:
                    shm = (my + OFF_SHMETA).to(tl.pointer_type(tl.int32)) + (t64 * N + m) * HM
                    _hmeta_pieces(shm, t, far, g, q, start_ptr, m, L, LP, K, KP, E_LOCAL, RAW_META, send_row_ptr, W)
        if USE_NVSHMEM:
            rem = far_any > 0
            if SPLIT != 1:
                srows = tl.multiple_of((my + OFF_SROWS).to(tl.pointer_type(DT)), 16) + t64 * D
                for c0 in range(0, D, BLOCK_D):
                    cols = c0 + tl.arange(0, BLOCK_D)
                    cm = rem[:, None] & (cols < D)[None, :]
                    tl.store(srows[:, None] + cols[None, :],
                             tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=cm), mask=cm)
            if WITH_META:
                sg = (my + OFF_SGATES).to(tl.pointer_type(DT)) + t64 * K
                tl.store(sg[:, None] + kk[None, :], gk, mask=rem[:, None] & (kk < K)[None, :])
            tl.debug_barrier()
            nv.fence_sys()  # the staged copies are visible to the NIC before the puts read them
            if tl.max(far_any) > 0:
                for j in range(BLOCK_T):
                    tj = b * BLOCK_T + j
                    if tj < T:
                        tj64 = tj.to(tl.int64)
                        for m in range(N):
                            rr = m * L + l
                            base = tl.load(peers_ptr + rr)
                            rj = tl.load(nrow_ptr + tj * N + m)
                            pe = tl.load(pes_ptr + rr)
                            if (base == 0) & (rj >= 0):
                                dst = (RANK * T_MAX + rj).to(tl.int64)
                                if SPLIT != 1:
                                    nv.putmem_block(my + OFF_RECV + dst * (D * ES),
                                                    my + OFF_SROWS + tj64 * (D * ES), tl.full([], D * ES, tl.int64),
                                                    pe)
                                if WITH_META:
                                    nv.putmem_block(my + OFF_HMETA + dst * (HM * 4),
                                                    my + OFF_SHMETA + (tj64 * N + m) * (HM * 4),
                                                    tl.full([], HM * 4, tl.int64), pe)
                                    nv.putmem_block(my + OFF_GATES + dst * (K * ES),
                                                    my + OFF_SGATES + tj64 * (K * ES),
                                                    tl.full([], K * ES, tl.int64), pe)
    if SPLIT == 2:
        _publish(hist, peers_ptr, tl.full([], OFF_HRROWS, tl.int64) + RANK * 8, W, WP, pes_ptr, RANK, USE_NVSHMEM)
    else:
        _publish(hist, peers_ptr, tl.full([], OFF_HARRIVE, tl.int64) + RANK * 8, W, WP, pes_ptr, RANK,
                 USE_NVSHMEM)
    rows = tl.sum(hist)
    if SPLIT != 1:
        if rows > 0:
            tl.atomic_add(ctr_ptr, rows, sem="relaxed")
            tl.atomic_add(ctr_ptr + 1, rows * D * ES, sem="relaxed")


# ---------------------------------------------------------------- the relay's forward (phase 3)


@triton.jit
def _relay_forward_kernel(hmeta_ptr, hcnt_ptr, hexp_ptr, ctr_ptr, peers_ptr, RANK,
                          W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          L: tl.constexpr, LP: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr,
                          HM: tl.constexpr, META_W: tl.constexpr, DT: tl.constexpr,
                          OFF_STATE: tl.constexpr, OFF_RECV: tl.constexpr, OFF_META: tl.constexpr,
                          OFF_GATES: tl.constexpr, OFF_ARRIVE: tl.constexpr, OFF_HMETA: tl.constexpr,
                          OFF_HFLAG: tl.constexpr, OFF_HCNT: tl.constexpr, OFF_HARRIVE: tl.constexpr,
                          OFF_HDONE: tl.constexpr, FROM_REGION: tl.constexpr, TIMEOUT_NS: tl.constexpr,
                          CLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                          SPLIT: tl.constexpr = 0, OFF_HRROWS: tl.constexpr = 0, OFF_HFROWS: tl.constexpr = 0,
                          END: tl.constexpr = False, WP3: tl.constexpr = 4, OFF_FLAGS: tl.constexpr = 0,
                          pes_ptr=None, USE_NVSHMEM: tl.constexpr = False):
    """The relay's side of a dispatch-direction op. For every source s = (n, l) of another node
    (this rank's local index l): FROM_REGION (a dispatch) waits until HFLAG[s] reaches this op's
    epoch, takes the row count from HCNT[s] into ``hcnt[s]``, and copies each HMETA row out to
    ``hmeta`` (what combine and the backward read; the region is the next dispatch's); otherwise
    (combine's backward) the count and rows are the dispatch's ``hcnt`` / ``hmeta``. Then it waits
    until HARRIVE[s] holds that many rows and, for each row and each local rank i with a receive
    row ``dr = hmeta[2K + i] >= 0``, stores the row into rank (node, i)'s RECV at ``s*T_MAX + dr``
    (for i = this rank the row is already there: ``dr`` is its row) -- with FROM_REGION also its
    META row (the codes of the slots whose owner is i, -1 for the others, then the token) and its
    gates (already in place for this rank) -- then one release add per local rank of the rows it
    got to ARRIVE[s] there: the flat expand kernel's wait. FROM_REGION also adds, per source, the
    rows times their owners to ``hexp[s]`` (zeroed by the host): the partial rows its combine
    waits for. The last program zeroes HARRIVE. Counters: ctr[2] += rows stored into other ranks,
    ctr[3] += their payload bytes.
    SPLIT (the overlapped dispatch, the halves of ``_hier_send_kernel``'s SPLIT): 1 -- FROM_REGION,
    everything but the token rows (HARRIVE counts the rows whose HMETA landed; the ARRIVE adds then
    say their META and gates are in place; no counters); 2 -- not FROM_REGION, the token rows alone
    (the dispatch's ``hcnt`` / ``hmeta``), after HRROWS[s] holds them, added to HFROWS[s] of each
    local rank instead of ARRIVE (``_rows_wait_kernel`` waits there); the last program takes the rows
    off HRROWS (the sources add the next dispatch's only once this rank ended this op). END: the
    op's last kernel (``_end_op``; USE_NVSHMEM: its readiness signals to other nodes)."""
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    node = RANK // L
    l = RANK % L
    my = tl.load(peers_ptr + RANK)
    state = (my + OFF_STATE).to(tl.pointer_type(tl.int64))
    epoch = tl.load(state)
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    wr = tl.arange(0, WP)
    kk = tl.arange(0, KP)
    li = tl.arange(0, LP)
    fwd = tl.zeros([], tl.int64)
    for s in range(W):
        if ((s % L) == l) & ((s // L) != node):
            if FROM_REGION:
                _wait_geq((my + OFF_HFLAG + s * 8).to(tl.pointer_type(tl.int64)), epoch, err_ptr, OP_RELAY_ROWS, s,
                          TIMEOUT_NS, CLOCK)
                cnt = tl.atomic_add((my + OFF_HCNT + s * 8).to(tl.pointer_type(tl.int64)), 0, sem="acquire",
                                    scope="sys")
                if pid == 0:
                    tl.store(hcnt_ptr + s, cnt)
            else:
                cnt = tl.load(hcnt_ptr + s)
            arrive = OFF_HRROWS if SPLIT == 2 else OFF_HARRIVE
            _wait_geq((my + arrive + s * 8).to(tl.pointer_type(tl.int64)), cnt, err_ptr, OP_RELAY_ROWS, s,
                      TIMEOUT_NS, CLOCK)
            tl.debug_barrier()
            hist = tl.zeros([WP], tl.int64)
            owners = tl.zeros([], tl.int64)
            for b in range(pid, tl.cdiv(cnt, BLOCK_R), nprog):
                r = b * BLOCK_R + tl.arange(0, BLOCK_R)
                rm = r < cnt
                n64 = (s * T_MAX + r).to(tl.int64)
                if FROM_REGION:  # copy the rows' HMETA out (the handle keeps it)
                    hi = tl.arange(0, 64)
                    for h0 in range(0, HM, 64):
                        hc = h0 + hi
                        hmm = rm[:, None] & (hc < HM)[None, :]
                        v = tl.load((my + OFF_HMETA).to(tl.pointer_type(tl.int32)) + n64[:, None] * HM + hc[None, :],
                                    mask=hmm, other=-1)
                        tl.store(hmeta_ptr + n64[:, None] * HM + hc[None, :], v, mask=hmm)
                    src_hm = (my + OFF_HMETA).to(tl.pointer_type(tl.int32))
                else:
                    src_hm = hmeta_ptr
                mk = rm[:, None] & (kk < K)[None, :]
                code = tl.load(src_hm + n64[:, None] * HM + kk[None, :], mask=mk, other=-1)
                own = tl.load(src_hm + n64[:, None] * HM + K + kk[None, :], mask=mk, other=-1)
                tok = tl.load(src_hm + n64 * HM + 2 * K + L, mask=rm, other=0)
                ml = rm[:, None] & (li < L)[None, :]
                dr_t = tl.load(src_hm + n64[:, None] * HM + 2 * K + li[None, :], mask=ml, other=-1)
                owners += tl.sum((dr_t >= 0).to(tl.int64))
                recv = tl.multiple_of((my + OFF_RECV).to(tl.pointer_type(DT)), 16)
                gsrc = tl.multiple_of((my + OFF_GATES).to(tl.pointer_type(DT)), 16) + n64 * K
                for i in range(L):
                    dr = tl.sum(tl.where(li[None, :] == i, dr_t, 0), axis=1)
                    go = rm & (dr >= 0)
                    j = node * L + i
                    base = tl.load(peers_ptr + j)
                    dst = (s * T_MAX + dr).to(tl.int64)
                    hist += tl.where(wr == j, tl.sum(go.to(tl.int64)), 0)
                    other = go & (i != l)
                    if SPLIT != 1:
                        if i != l:
                            out = tl.multiple_of((base + OFF_RECV).to(tl.pointer_type(DT)), 16)
                            for c0 in range(0, D, BLOCK_D):
                                cols = c0 + tl.arange(0, BLOCK_D)
                                cm = other[:, None] & (cols < D)[None, :]
                                v = tl.load(recv + n64[:, None] * D + cols[None, :], mask=cm)
                                tl.store(out + dst[:, None] * D + cols[None, :], v, mask=cm)
                            fwd += tl.sum(other.to(tl.int64))
                    if FROM_REGION:
                        meta = (base + OFF_META).to(tl.pointer_type(tl.int32)) + dst * META_W
                        mg = go[:, None] & (kk < K)[None, :]
                        tl.store(meta[:, None] + kk[None, :], tl.where(own == i, code, -1), mask=mg)
                        tl.store(meta + K, tok, mask=go)
                        if i != l:
                            gdst = tl.multiple_of((base + OFF_GATES).to(tl.pointer_type(DT)), 16) + dst * K
                            mo = other[:, None] & (kk < K)[None, :]
                            tl.store(gdst[:, None] + kk[None, :], tl.load(gsrc[:, None] + kk[None, :], mask=mo),
                                     mask=mo)
            if SPLIT == 2:
                _publish(hist, peers_ptr, tl.full([], OFF_HFROWS, tl.int64) + s * 8, W, WP, peers_ptr, RANK, False)
            else:
                _publish(hist, peers_ptr, OFF_ARRIVE + s * 8, W, WP, peers_ptr, RANK, False)
            if FROM_REGION:
                if owners > 0:
                    tl.atomic_add(hexp_ptr + s, owners, sem="relaxed")
    if fwd > 0:
        tl.atomic_add(ctr_ptr + 2, fwd, sem="relaxed")
        tl.atomic_add(ctr_ptr + 3, fwd * D * ES, sem="relaxed")
    # the last program zeroes the arrival counters: no source adds to them before this rank has
    # ended the op (their next send waits for that); SPLIT 2 takes its rows off (its own done slot)
    tl.debug_barrier()
    done = (my + OFF_HDONE + (16 if SPLIT == 2 else 0)).to(tl.pointer_type(tl.int64))
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
        if SPLIT == 2:
            for s in range(W):
                if ((s % L) == l) & ((s // L) != node):
                    tl.atomic_add((my + OFF_HRROWS + s * 8).to(tl.pointer_type(tl.int64)), -tl.load(hcnt_ptr + s),
                                  sem="relaxed", scope="sys")
        else:
            tl.store((my + OFF_HARRIVE).to(tl.pointer_type(tl.int64)) + wr, tl.zeros([WP], tl.int64), mask=wr < W)
    if END:  # the overlapped dispatch's last kernel: ready for the next op
        _end_op(peers_ptr, RANK, W, WP3, OFF_STATE, OFF_FLAGS, OFF_ARRIVE, pes_ptr, USE_NVSHMEM)


# ---------------------------------------------------------------- combine: owners -> relay (phase 1)


@triton.jit
def _hier_reduce_send_kernel(y_ptr, part_ptr, pos_ptr, gate_ptr, tok_ptr, rows_from_ptr, ctr_ptr, peers_ptr, RANK,
                             N_EXP, W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                             L: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr,
                             OFF_HCOMB: tl.constexpr, OFF_HCARR: tl.constexpr, GATED: tl.constexpr,
                             ROWS: tl.constexpr, PART: tl.constexpr, EMULATE: tl.constexpr, ACC: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The owners' side of a combine-direction op, for the rows of sources on other nodes (after the
    flat reduce-send, which passed the op's barrier and sent the near sources' rows): received row n
    of source s = (n_s, l_s) (``n // T_MAX``; rows below ``rows_from[s]``) gets its partial row --
    ``sum_k [gate *] y[pos[n, k]]`` over this rank's slots (products in the activation dtype, fp32
    accumulation in slot order, one rounding), or with ROWS ``y[n]`` as it is -- stored into row
    ``(n_s, token, this rank's local index)`` of HCOMB on the relay (this node, l_s) (a local store
    when that is this rank). Then one release add per source of its rows to HCARR[s] on its relay.
    Counters: ctr[6] += rows stored into another rank, ctr[7] += their payload bytes.
    PART (with ROWS; the overlapped forward's early send): ``y`` holds the fp32 accumulator rows and
    ``part`` (``[W * T_MAX, D]``, the exchange dtype) receives every other-node row of them rounded
    once (zeros past a source's count), the same values the relay gets: the cast and the send in
    one pass over the rows. EMULATE (the interpreter, whose bf16 cast does not round to nearest
    even): that rounding in integer arithmetic, as torch's cast rounds."""
    DT: tl.constexpr = part_ptr.dtype.element_ty if PART else y_ptr.dtype.element_ty
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    node = RANK // L
    l = RANK % L
    wr = tl.arange(0, WP)
    kk = tl.arange(0, KP)
    hist = tl.zeros([WP], tl.int64)
    for b in range(pid, tl.cdiv(W * T_MAX, BLOCK_R), nprog):
        n = b * BLOCK_R + tl.arange(0, BLOCK_R)
        inr = n < W * T_MAX
        s = n // T_MAX
        far = inr & ((s // L) != node)
        valid = far & ((n % T_MAX) < tl.load(rows_from_ptr + s, mask=inr, other=0))
        if tl.sum((far if PART else valid).to(tl.int32)) > 0:
            hist += tl.sum(((s[:, None] == wr[None, :]) & valid[:, None]).to(tl.int64), axis=0)
            tok = tl.load(tok_ptr + n, mask=valid, other=0).to(tl.int64)
            rbase = tl.load(peers_ptr + node * L + s % L, mask=valid, other=0)
            dst = tl.multiple_of((rbase + OFF_HCOMB).to(tl.pointer_type(DT)), 16) + \
                (((s // L).to(tl.int64) * T_MAX + tok) * L + l) * D
            if not ROWS:
                mk = valid[:, None] & (kk < K)[None, :]
                pos_t = tl.load(pos_ptr + n[:, None] * K + kk[None, :], mask=mk, other=-1)
                if GATED:
                    gate_t = tl.load(gate_ptr + n[:, None] * K + kk[None, :], mask=mk, other=0.0).to(ACC)
                else:
                    gate_t = tl.zeros([BLOCK_R, KP], ACC)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                cm = (cols < D)[None, :]
                if ROWS:
                    acc = tl.load(y_ptr + n.to(tl.int64)[:, None] * D + cols[None, :], mask=valid[:, None] & cm,
                                  other=0.0).to(ACC)
                else:
                    acc = tl.zeros([BLOCK_R, BLOCK_D], ACC)
                    for k in range(K):
                        acc = _reduce_slot(acc, k, kk, pos_t, gate_t, valid, cm, cols, y_ptr, N_EXP, D, GATED, ACC, DT)
                if PART:
                    v, _ = round_to(acc, DT, EMULATE)
                    tl.store(dst[:, None] + cols[None, :], v, mask=valid[:, None] & cm)
                    tl.store(part_ptr + n.to(tl.int64)[:, None] * D + cols[None, :], v, mask=far[:, None] & cm)
                else:
                    tl.store(dst[:, None] + cols[None, :], acc.to(DT), mask=valid[:, None] & cm)
    tl.debug_barrier()
    away = tl.zeros([], tl.int64)
    for d in range(W):
        c = tl.sum(tl.where(wr == d, hist, 0))
        if c > 0:
            rr = node * L + d % L
            tl.atomic_add((tl.load(peers_ptr + rr) + OFF_HCARR + d * 8).to(tl.pointer_type(tl.int64)), c,
                          sem="release", scope="sys")
            if rr != RANK:
                away += c
    if away > 0:
        tl.atomic_add(ctr_ptr + 6, away, sem="relaxed")
        tl.atomic_add(ctr_ptr + 7, away * D * ES, sem="relaxed")


# ---------------------------------------------------------------- combine: relay -> source (phase 2)


@triton.jit
def _relay_combine_kernel(hmeta_ptr, hcnt_ptr, hexp_ptr, ctr_ptr, peers_ptr, RANK,
                          W: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
                          D: tl.constexpr, T_MAX: tl.constexpr, HM: tl.constexpr, DT: tl.constexpr,
                          ACC: tl.constexpr, OFF_STATE: tl.constexpr, OFF_ARRIVE: tl.constexpr,
                          OFF_COMB: tl.constexpr, OFF_HCOMB: tl.constexpr, OFF_HCARR: tl.constexpr,
                          OFF_HDONE: tl.constexpr, TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, pes_ptr=None, OFF_SCOMB: tl.constexpr = 0,
                          USE_NVSHMEM: tl.constexpr = False):
    """The relay's side of a combine-direction op. For every source s = (n, l) of another node: waits
    until HCARR[s] holds the ``hexp[s]`` partial rows its dispatch forwarded, then for each of its
    ``hcnt[s]`` inter-node rows (token t = the HMETA row's last word) sums HCOMB[n, t, i] over the
    local ranks i that got the row (fp32 -- fp64 for fp64 rows -- in local rank order, one rounding)
    and stores the sum into row ``(RANK, t)`` of the source's COMB: one row per (token, node) back
    over the inter-node leg. Then one release add per source of the rows to its ARRIVE[W + RANK]
    (the flat reduce-receive's wait). USE_NVSHMEM: sources without a pointer get the rows staged in
    SCOMB (row ``s*T_MAX + r``) and put, and the add as a signal. The last program zeroes HCARR.
    Counters: ctr[4] += rows sent home, ctr[5] += their payload bytes."""
    ES: tl.constexpr = DT.primitive_bitwidth // 8
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    node = RANK // L
    l = RANK % L
    my = tl.load(peers_ptr + RANK)
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    wr = tl.arange(0, WP)
    li = tl.arange(0, LP)
    hist = tl.zeros([WP], tl.int64)
    hcomb = tl.multiple_of((my + OFF_HCOMB).to(tl.pointer_type(DT)), 16)
    for s in range(W):
        if ((s % L) == l) & ((s // L) != node):
            _wait_geq((my + OFF_HCARR + s * 8).to(tl.pointer_type(tl.int64)), tl.load(hexp_ptr + s), err_ptr,
                      OP_RELAY_PARTIALS, s, TIMEOUT_NS, CLOCK)
            tl.debug_barrier()
            cnt = tl.load(hcnt_ptr + s)
            sbase = tl.load(peers_ptr + s)
            nsrc = tl.full([], 0, tl.int64) + s // L
            for b in range(pid, tl.cdiv(cnt, BLOCK_R), nprog):
                r = b * BLOCK_R + tl.arange(0, BLOCK_R)
                rm = r < cnt
                n64 = (s * T_MAX + r).to(tl.int64)
                hist += tl.where(wr == s, tl.sum(rm.to(tl.int64)), 0)
                tok = tl.load(hmeta_ptr + n64 * HM + 2 * K + L, mask=rm, other=0).to(tl.int64)
                ml = rm[:, None] & (li < L)[None, :]
                dr_t = tl.load(hmeta_ptr + n64[:, None] * HM + 2 * K + li[None, :], mask=ml, other=-1)
                dst = tl.multiple_of((sbase + OFF_COMB).to(tl.pointer_type(DT)), 16) + (RANK * T_MAX + tok) * D
                stage = tl.multiple_of((my + OFF_SCOMB).to(tl.pointer_type(DT)), 16) + n64 * D
                for c0 in range(0, D, BLOCK_D):
                    cols = c0 + tl.arange(0, BLOCK_D)
                    cm = (cols < D)[None, :]
                    acc = tl.zeros([BLOCK_R, BLOCK_D], ACC)
                    for i in range(L):
                        has = rm & (tl.sum(tl.where(li[None, :] == i, dr_t, 0), axis=1) >= 0)
                        row = ((nsrc * T_MAX + tok) * L + i) * D
                        acc += tl.load(hcomb + row[:, None] + cols[None, :], mask=has[:, None] & cm,
                                       other=0.0).to(ACC)
                    if sbase != 0:
                        tl.store(dst[:, None] + cols[None, :], acc.to(DT), mask=rm[:, None] & cm)
                    if USE_NVSHMEM:
                        if sbase == 0:
                            tl.store(stage[:, None] + cols[None, :], acc.to(DT), mask=rm[:, None] & cm)
                if USE_NVSHMEM:
                    if sbase == 0:
                        tl.debug_barrier()
                        nv.fence_sys()
                        for j in range(BLOCK_R):
                            rj = b * BLOCK_R + j
                            if rj < cnt:
                                nj = (s * T_MAX + rj).to(tl.int64)
                                tj = tl.load(hmeta_ptr + nj * HM + 2 * K + L).to(tl.int64)
                                nv.putmem_block(my + OFF_COMB + (RANK * T_MAX + tj) * (D * ES),
                                                my + OFF_SCOMB + nj * (D * ES), tl.full([], D * ES, tl.int64),
                                                tl.load(pes_ptr + s))
    _publish(hist, peers_ptr, OFF_ARRIVE + (W + RANK) * 8, W, WP, pes_ptr, RANK, USE_NVSHMEM)
    rows = tl.sum(hist)
    if rows > 0:
        tl.atomic_add(ctr_ptr + 4, rows, sem="relaxed")
        tl.atomic_add(ctr_ptr + 5, rows * D * ES, sem="relaxed")
    tl.debug_barrier()
    done = (my + OFF_HDONE + 8).to(tl.pointer_type(tl.int64))
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
        tl.store((my + OFF_HCARR).to(tl.pointer_type(tl.int64)) + wr, tl.zeros([WP], tl.int64), mask=wr < W)
