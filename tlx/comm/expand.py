"""The expand kernel: a dispatch's last phase (receive rows -> expert-major rows, or in the row form
only the index maps) and combine's backward's gate-scaled rows and gate gradients (``exchange.py``
describes the op, the region and the legend)."""

from __future__ import annotations

import triton
import triton.language as tl

from .protocol import OP_TOKENS, _await, _end_op, _nvshmem_put_gate_grads, _publish, _wait_geq
from .send import _copy_arrived


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
