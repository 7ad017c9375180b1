"""Fused MoE expert GEMMs for Hopper (sm_90) in TLX: gather-on-load and SwiGLU / gate-scatter /
dSwiGLU epilogues on the persistent warp-specialized pipeline of tlx/hopper/grouped_gemm.py.

Legend and index arrays as in tlx/portable/fused_moe.py (R source rows, N expert-major rows, D, F,
E; ``src_N`` / ``dst_N`` row indices, int32 or int64; ``offsets_E``; padding rows past the end).
BM x BN output tile split row-wise between two consumer warp groups (BMS = BM / 2 rows each).

Gather-on-load. Hopper has no TMA gather, so a gathered operand is read by the producer warp group
itself: each of its 128 threads issues 16-byte ``cp.async`` copies of the tile's rows (row index
from ``src_N``; rows past the expert zero-filled) into the same NVMMA-swizzled stage buffer the
consumers' wgmma reads, commits one group per stage, and -- because ``cp.async`` completion is per
thread -- signals the stage through a per-thread warp barrier ``afull[s]`` (128 arrivals) after
``cp.async.wait_group`` + ``fence.proxy.async``. That signal lags the issue by LAG stages so that
LAG + 1 stages of loads are in flight; LAG <= NUM_STAGES - 2, because consumers release stage j - 1
only after starting stage j (one wgmma in flight), and the producer must not wait for a slot whose
release needs a signal it has not sent. At the end of each tile the producer drains (waits for all
its copies and signals the rest), so tile changes and zero-step tiles cannot deadlock. Operands read
in place (weights; A of the scatter forms; the non-gathered dW operand) still go by TMA on
``full[s]``; the consumers wait on both barriers. The gather helpers are shared with the Blackwell
kernels (tlx/common/gather.py).

``_fused_mm_hopper_kernel`` (ragged M; static persistent tile walk, optional GROUP_M raster):
  EPILOGUE == SWIGLU : A = x[src] (gathered) @ w13[e]; two B tiles per stage (gate columns n_off and
                       up columns F + n_off), two accumulators; stores h (both halves, rounded) and
                       a = silu(hg) * hu from the rounded h; padding tiles store zeros.
  EPILOGUE == SCATTER: A = a or dh (TMA) @ w (w2, or w13^T read K-major); out_f32[dst[n]] +=
                       scale[n] * acc with relaxed fp32 atomics (no [T, K, D] tensor, no k-sum pass).
  EPILOGUE == DSWIGLU: A = dout[dst] (gathered) @ w2^T (K-major); with h and the gate: stores dh,
                       ag = gate * a and the gate-gradient partial dot of this F-tile. h is read
                       from global memory in the epilogue; with EARLY_H each consumer first
                       prefetches its half of h into L2 (``prefetch.global.L2``, one per 128-byte
                       line) before the tile's main loop, so the epilogue's loads hit L2 (no shared
                       memory, no registers held across the loop).
``_fused_wgrad_hopper_kernel`` (ragged K): dw[e] = A[ia]^T @ B[ib] over the expert's rows, either
  operand gathered by ``cp.async`` (A_GATHER: x[src] for dW13; B_GATHER: dout[dst] for dW2), the other
  by ragged TMA; tiles longest expert first with atomic claims (DYNAMIC), as the landed dW kernel.
  VIRT > 1 (SWIGLU; the EP overlap's split gate/up GEMM): E counts VIRT runs per expert, each
  run a "virtual expert" of the tile walk, whose weights are those of expert e // VIRT.
  The gathered rows are the reduction, so their indices change every k-step: the producer loads
  step k + 1's indices while issuing step k's copies (an index load in line stalls every stage).
Epilogue stores are plain (masked) global stores from the wgmma accumulator layout; the dW output
goes through shared memory and TMA like the landed kernel.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.gather import drain_gathered as _drain_gathered
from tlx.common.gather import gather_ptrs
from tlx.common.gather import signal_gathered as _signal_gathered
from tlx.common.moe_epilogues import split_halves, swiglu_bwd, swiglu_fwd
from tlx.common.scheduler import mm_num_tiles, mm_tile, mm_tile_grouped, ragged_coords, wgrad_tile, wgrad_tile_lpt

SWIGLU = tl.constexpr(1)
SCATTER = tl.constexpr(2)
DSWIGLU = tl.constexpr(3)


@triton.jit
def _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr):
    if GROUP_M == 1:
        e, lo, cnt, mt, nt = mm_tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS)
    else:
        e, lo, cnt, mt, nt = mm_tile_grouped(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS, GROUP_M)
    return e, lo, cnt, mt, nt


# --- ragged-M forms --------------------------------------------------------------------------------


@triton.jit
def _mm_produce(t, it, a_desc, a_ptr, src_ptr, b_desc, a_buf, b_buf, full, afull, empty, tile_cum_ptr, offsets_ptr,
                E, N_ROWS, K_DIM, tiles_n, F_OFF, stride_an,
                EPILOGUE: tl.constexpr, A_GATHER: tl.constexpr, B_KMAJOR: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                GROUP_M: tl.constexpr, LAG: tl.constexpr, VIRT: tl.constexpr = 1):
    BMS: tl.constexpr = BM // 2
    A_BYTES: tl.constexpr = 0 if A_GATHER else BM * BK * 2
    B_BYTES: tl.constexpr = (2 if EPILOGUE == SWIGLU else 1) * BK * BN * 2
    e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS, GROUP_M)
    n_off = nt * BN
    steps = tl.where(e < E, tl.cdiv(K_DIM, BK), 0)
    ew = e // VIRT  # the weights' expert (VIRT > 1: runs of one expert's rows as virtual experts)
    if A_GATHER:
        # Row pointers of the two BMS-row halves, once per tile; rows past the expert load zeros.
        p0, m0 = gather_ptrs(a_ptr, src_ptr, lo, mt * BM, cnt, stride_an, 0, BK, BMS, BK)
        p1, m1 = gather_ptrs(a_ptr, src_ptr, lo, mt * BM + BMS, cnt, stride_an, 0, BK, BMS, BK)
    for k in range(0, steps):
        s = it % NUM_STAGES
        tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
        k_off = k * BK
        if A_GATHER:
            tlx.async_load(p0 + k_off, a_buf[s * 2], mask=m0)
            tlx.async_load(p1 + k_off, a_buf[s * 2 + 1], mask=m1)
            tlx.async_load_commit_group()
        tlx.barrier_expect_bytes(full[s], A_BYTES + B_BYTES)
        if not A_GATHER:
            row = lo + mt * BM
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [row, k_off], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [row + BMS, k_off], full[s])
        if EPILOGUE == SWIGLU:
            tlx.async_descriptor_load(b_desc, b_buf[s * 2], [ew, k_off, n_off], full[s])
            tlx.async_descriptor_load(b_desc, b_buf[s * 2 + 1], [ew, k_off, n_off + F_OFF], full[s])
        elif B_KMAJOR:
            tlx.async_descriptor_load(b_desc, b_buf[s], [ew, n_off, k_off], full[s])
        else:
            tlx.async_descriptor_load(b_desc, b_buf[s], [ew, k_off, n_off], full[s])
        if A_GATHER:
            _signal_gathered(it, k, LAG, NUM_STAGES, afull)
        it += 1
    if A_GATHER:
        _drain_gathered(it, steps, LAG, NUM_STAGES, afull)
    return it


@triton.jit
def _mm_epilogue(acc, acc_u, e, lo, cnt, mt, nt, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
                 E, NN, F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn, CID: tl.constexpr,
                 EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    rows = mt * BM + CID * BMS + tl.arange(0, BMS)
    cols = nt * BN + tl.arange(0, BN)
    row_ok = rows < cnt
    ok = row_ok[:, None] & (cols < NN)[None, :]
    n_idx = (lo + rows).to(tl.int64)
    if EPILOGUE == SWIGLU:
        out_ty: tl.constexpr = c_ptr.dtype.element_ty
        hg = acc.to(out_ty)
        hu = acc_u.to(out_ty)
        h_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
        tl.store(h_ptrs, hg, mask=ok)
        tl.store(h_ptrs + F_OFF, hu, mask=ok)
        a_val = swiglu_fwd(hg.to(tl.float32), hu.to(tl.float32))
        tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], a_val.to(out_ty), mask=ok)
    elif EPILOGUE == SCATTER:
        if e < E:
            d_row = tl.load(dst_ptr + n_idx, mask=row_ok, other=0).to(tl.int64)
            val = acc
            if HAS_SCALE:
                val = val * tl.load(scale_ptr + n_idx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.atomic_add(c_ptr + d_row[:, None] * stride_cn + cols[None, :], val, mask=ok, sem="relaxed")
    else:
        out_ty: tl.constexpr = c_ptr.dtype.element_ty
        h_ptrs = h_ptr + n_idx[:, None] * stride_hn + cols[None, :]
        hg = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
        hu = tl.load(h_ptrs + F_OFF, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(scale_ptr + n_idx, mask=row_ok & (e < E), other=0.0).to(tl.float32)
        a_val, dhg, dhu = swiglu_bwd(hg, hu, acc, gate[:, None])
        tl.store(part_ptr + n_idx * stride_pn + nt, tl.sum(a_val * acc, axis=1), mask=row_ok)
        dh_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
        tl.store(dh_ptrs, dhg.to(out_ty), mask=ok)
        tl.store(dh_ptrs + F_OFF, dhu.to(out_ty), mask=ok)
        tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], (a_val * gate[:, None]).to(out_ty), mask=ok)


@triton.jit
def _prefetch_h_lines(h_ptr, lo, mt, cnt, nt, NN, F_OFF, stride_hn, R0: tl.constexpr, ROWS: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr):
    """dSwiGLU's EARLY_H: ``prefetch.global.L2`` of the h lines (gate and up columns of column tile
    ``nt``) of rows ``R0 .. R0 + ROWS`` of tile row ``mt`` of the expert at ``lo``, one per 128-byte line."""
    LINES: tl.constexpr = BN // 64  # 128-byte lines of 16-bit elements per row and half
    rows = mt * BM + R0 + tl.arange(0, ROWS)
    h_line = h_ptr + (lo + rows).to(tl.int64)[:, None] * stride_hn + (nt * BN + tl.arange(0, LINES) * 64)[None, :]
    h_ok = (rows < cnt)[:, None] & ((nt * BN + tl.arange(0, LINES) * 64) < NN)[None, :]
    tlx.prefetch(h_line, level="L2", mask=h_ok)
    tlx.prefetch(h_line + F_OFF, level="L2", mask=h_ok)


@triton.jit
def _mm_consume(t, it, tc, a_buf, b_buf, full, afull, empty, tile_cum_ptr, offsets_ptr,
                c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
                E, N_ROWS, K_DIM, NN, F_OFF, tiles_n, stride_cn, stride_c2n, stride_hn, stride_pn, CID: tl.constexpr,
                EPILOGUE: tl.constexpr, A_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, B_KMAJOR: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
                SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr,
                EARLY_H: tl.constexpr, accb, epi_full, epi_empty, EPI_WG: tl.constexpr, NCH: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS, GROUP_M)
    steps = tl.where(e < E, tl.cdiv(K_DIM, BK), 0)
    acc = tl.zeros((BMS, BN), dtype=tl.float32)
    acc_u = tl.zeros((BMS, BN), dtype=tl.float32)  # SwiGLU's up half; unused otherwise
    if EARLY_H:  # dSwiGLU: L2 prefetch of this half's h lines (gate and up) before the main loop
        _prefetch_h_lines(h_ptr, lo, mt, cnt, nt, NN, F_OFF, stride_hn, CID * BMS, BMS, BM, BN)
    prev = 0
    for k in range(0, steps):
        s = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        tlx.barrier_wait(full[s], phase)
        if A_GATHER:
            tlx.barrier_wait(afull[s], phase)
        a = a_buf[s * 2 + CID]
        if EPILOGUE == SWIGLU:
            acc = tlx.async_dot(a, tlx.local_reshape(b_buf[s * 2], [BK, BN]), acc)
            acc_u = tlx.async_dot(a, tlx.local_reshape(b_buf[s * 2 + 1], [BK, BN]), acc_u)
            # Two wgmma groups per step: keep this step's in flight, the previous step's are done.
            acc = tlx.async_dot_wait(2, acc)
            acc_u = tlx.async_dot_wait(2, acc_u)
        else:
            if B_KMAJOR:
                b = tlx.local_trans(tlx.local_reshape(b_buf[s], [BN, BK]))
            else:
                b = tlx.local_reshape(b_buf[s], [BK, BN])
            acc = tlx.async_dot(a, b, acc)
            acc = tlx.async_dot_wait(1, acc)
        if k > 0:
            tlx.barrier_arrive(empty[prev])
        prev = s
        it += 1
    acc = tlx.async_dot_wait(0, acc)
    if EPILOGUE == SWIGLU:
        acc_u = tlx.async_dot_wait(0, acc_u)
    if steps > 0:
        tlx.barrier_arrive(empty[prev])
    if EPI_WG:  # hand the accumulator to the epilogue warp group and go on to the next tile
        tlx.barrier_wait(epi_empty[CID], (tc & 1) ^ 1)
        _stash_chunks(acc, accb, CID * NCH, BMS, BN, NCH)
        tlx.barrier_arrive(epi_full[CID])
    else:
        _mm_epilogue(acc, acc_u, e, lo, cnt, mt, nt, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr,
                     part_ptr, E, NN, F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn, CID, EPILOGUE, HAS_SCALE, BM,
                     BN)
    return it


@triton.jit
def _mm_consume_pingpong(t, it, tc, a_buf, b_buf, full, empty, mma_bar, tile_cum_ptr, offsets_ptr, c_ptr, c2_ptr,
                         scale_ptr, h_ptr, part_ptr, E, N_ROWS, K_DIM, NN, F_OFF, tiles_n, stride_cn, stride_c2n,
                         stride_hn, stride_pn, CID: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr,
                         EARLY_H: tl.constexpr, EPI_COLS: tl.constexpr):
    """PINGPONG consumer ``CID`` at tile ``t``, this program's ``tc``-th: every consumer walks every
    tile (``it`` counts all the stages the producer fills); consumer ``tc % 2`` computes the whole
    BM x BN tile (both 64-row halves of each stage, two accumulators) and releases its stages. The
    consumers alternate on ``mma_bar`` (constant parity per consumer: strict turns) so that one
    issues its main loop while the other runs its epilogue; the token passes on as soon as the last
    k-step is issued. Then the dSwiGLU epilogue, half by half, in EPI_COLS-column chunks."""
    BMS: tl.constexpr = BM // 2
    e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS, GROUP_M)
    steps = tl.where(e < E, tl.cdiv(K_DIM, BK), 0)
    if tc % 2 == CID:
        if EARLY_H:  # L2 prefetch of the tile's h lines (gate and up, all BM rows) before the main loop
            _prefetch_h_lines(h_ptr, lo, mt, cnt, nt, NN, F_OFF, stride_hn, 0, BM, BM, BN)
        tlx.barrier_wait(mma_bar[0], 1 - CID)  # consumer 0 goes first
        acc0 = tl.zeros((BMS, BN), dtype=tl.float32)
        acc1 = tl.zeros((BMS, BN), dtype=tl.float32)
        prev = 0
        for k in range(0, steps):
            j = it + k
            s = j % NUM_STAGES
            tlx.barrier_wait(full[s], (j // NUM_STAGES) & 1)
            b = tlx.local_trans(tlx.local_reshape(b_buf[s], [BN, BK]))  # w2^T, K-major
            acc0 = tlx.async_dot(a_buf[s * 2], b, acc0)
            acc1 = tlx.async_dot(a_buf[s * 2 + 1], b, acc1)
            acc0 = tlx.async_dot_wait(2, acc0)  # this step's two in flight, the previous step's done
            acc1 = tlx.async_dot_wait(2, acc1)
            if k > 0:
                tlx.barrier_arrive(empty[prev])
            prev = s
        tlx.barrier_arrive(mma_bar[0])  # the other consumer may issue its main loop now
        acc0 = tlx.async_dot_wait(0, acc0)
        acc1 = tlx.async_dot_wait(0, acc1)
        if steps > 0:
            tlx.barrier_arrive(empty[prev])
        _pingpong_epilogue(acc0, 0, e, lo, cnt, mt, nt, c_ptr, c2_ptr, scale_ptr, h_ptr, part_ptr, E, NN, F_OFF,
                           stride_cn, stride_c2n, stride_hn, stride_pn, BM, BN, EPI_COLS)
        _pingpong_epilogue(acc1, 1, e, lo, cnt, mt, nt, c_ptr, c2_ptr, scale_ptr, h_ptr, part_ptr, E, NN, F_OFF,
                           stride_cn, stride_c2n, stride_hn, stride_pn, BM, BN, EPI_COLS)
    return it + steps


@triton.jit
def _pingpong_epilogue(acc, half: tl.constexpr, e, lo, cnt, mt, nt, c_ptr, c2_ptr, scale_ptr, h_ptr, part_ptr, E, NN,
                       F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn, BM: tl.constexpr, BN: tl.constexpr,
                       EPI_COLS: tl.constexpr):
    """dSwiGLU epilogue of one 64-row half of a PINGPONG tile, in column chunks cut from the
    accumulator in registers (``split_halves``: the cut itself moves no data; each chunk is then
    converted, as in the inline epilogue, to the layout of the 16-byte h loads and stores): one
    chunk's h live at a time."""
    BMS: tl.constexpr = BM // 2
    NCH: tl.constexpr = BN // EPI_COLS
    left, right = split_halves(acc, BMS, BN)
    if NCH == 2:
        dot = _epi_chunk(left, e, lo, cnt, mt, nt * BN, c_ptr, c2_ptr, c_ptr, scale_ptr, h_ptr, E, NN, F_OFF,
                         stride_cn, stride_c2n, stride_hn, half, DSWIGLU, True, BM, EPI_COLS)
        dot += _epi_chunk(right, e, lo, cnt, mt, nt * BN + EPI_COLS, c_ptr, c2_ptr, c_ptr, scale_ptr, h_ptr, E, NN,
                          F_OFF, stride_cn, stride_c2n, stride_hn, half, DSWIGLU, True, BM, EPI_COLS)
    else:
        tl.static_assert(NCH == 4)
        q0, q1 = split_halves(left, BMS, BN // 2)
        q2, q3 = split_halves(right, BMS, BN // 2)
        dot = _epi_chunk(q0, e, lo, cnt, mt, nt * BN, c_ptr, c2_ptr, c_ptr, scale_ptr, h_ptr, E, NN, F_OFF,
                         stride_cn, stride_c2n, stride_hn, half, DSWIGLU, True, BM, EPI_COLS)
        dot += _epi_chunk(q1, e, lo, cnt, mt, nt * BN + EPI_COLS, c_ptr, c2_ptr, c_ptr, scale_ptr, h_ptr, E, NN,
                          F_OFF, stride_cn, stride_c2n, stride_hn, half, DSWIGLU, True, BM, EPI_COLS)
        dot += _epi_chunk(q2, e, lo, cnt, mt, nt * BN + 2 * EPI_COLS, c_ptr, c2_ptr, c_ptr, scale_ptr, h_ptr, E, NN,
                          F_OFF, stride_cn, stride_c2n, stride_hn, half, DSWIGLU, True, BM, EPI_COLS)
        dot += _epi_chunk(q3, e, lo, cnt, mt, nt * BN + 3 * EPI_COLS, c_ptr, c2_ptr, c_ptr, scale_ptr, h_ptr, E, NN,
                          F_OFF, stride_cn, stride_c2n, stride_hn, half, DSWIGLU, True, BM, EPI_COLS)
    rows = mt * BM + half * BMS + tl.arange(0, BMS)
    tl.store(part_ptr + (lo + rows).to(tl.int64) * stride_pn + nt, dot, mask=rows < cnt)


@triton.jit
def _stash_chunks(acc, accb, base, ROWS: tl.constexpr, COLS: tl.constexpr, NCH: tl.constexpr):
    """``acc`` [ROWS, COLS] into ``accb[base + j]`` as NCH column chunks (2, 4 or 8; no data moves
    between threads to cut them)."""
    left, right = split_halves(acc, ROWS, COLS)
    if NCH == 2:
        tlx.local_store(accb[base], left)
        tlx.local_store(accb[base + 1], right)
    elif NCH == 4:
        _stash_halves(left, accb, base, ROWS, COLS // 2)
        _stash_halves(right, accb, base + 2, ROWS, COLS // 2)
    else:
        q0, q1 = split_halves(left, ROWS, COLS // 2)
        q2, q3 = split_halves(right, ROWS, COLS // 2)
        _stash_halves(q0, accb, base, ROWS, COLS // 4)
        _stash_halves(q1, accb, base + 2, ROWS, COLS // 4)
        _stash_halves(q2, accb, base + 4, ROWS, COLS // 4)
        _stash_halves(q3, accb, base + 6, ROWS, COLS // 4)


@triton.jit
def _stash_halves(x, accb, base, ROWS: tl.constexpr, COLS: tl.constexpr):
    left, right = split_halves(x, ROWS, COLS)
    tlx.local_store(accb[base], left)
    tlx.local_store(accb[base + 1], right)


@triton.jit
def _epi_tile(e, lo, cnt, mt, nt, tc, c: tl.constexpr, accb, epi_full, epi_empty, c_ptr, c2_ptr, dst_ptr, scale_ptr,
              h_ptr, part_ptr, E, NN, F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn, EPILOGUE: tl.constexpr,
              HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EPI_COLS: tl.constexpr):
    """An epilogue warp group's work on consumer ``c``'s half of its ``tc``-th tile (``e, lo, cnt,
    mt, nt`` from ``_mm_tile_at``): wait for the stashed accumulator, read it chunk by chunk (handing
    the buffer back after the last read), apply the form's epilogue; dSwiGLU then stores the rows'
    gate-gradient partials."""
    BMS: tl.constexpr = BM // 2
    NCH: tl.constexpr = BN // EPI_COLS
    tlx.barrier_wait(epi_full[c], tc & 1)
    dot = tl.zeros([BMS], tl.float32)
    for j in tl.static_range(NCH):
        g = tlx.local_load(accb[c * NCH + j])
        if j == NCH - 1:  # the consumer may stash its next tile now
            tlx.barrier_arrive(epi_empty[c])
        dot += _epi_chunk(g, e, lo, cnt, mt, nt * BN + j * EPI_COLS, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, E, NN,
                          F_OFF, stride_cn, stride_c2n, stride_hn, c, EPILOGUE, HAS_SCALE, BM, EPI_COLS)
    if EPILOGUE == DSWIGLU:
        rows = mt * BM + c * BMS + tl.arange(0, BMS)
        tl.store(part_ptr + (lo + rows).to(tl.int64) * stride_pn + nt, dot, mask=rows < cnt)


@triton.jit
def _epi_chunk(g, e, lo, cnt, mt, c0, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, E, NN, F_OFF, stride_cn, stride_c2n,
               stride_hn, CID, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, BM: tl.constexpr,
               COLS: tl.constexpr):
    """The epilogue warp group's work on one ``[BM / 2, COLS]`` accumulator chunk of consumer ``CID``
    (columns from ``c0``): the scatter form's atomics, or dSwiGLU's stores; returns the rows'
    gate-gradient partial dot over these columns (dSwiGLU; zeros otherwise)."""
    BMS: tl.constexpr = BM // 2
    rows = mt * BM + CID * BMS + tl.arange(0, BMS)
    cols = c0 + tl.arange(0, COLS)
    row_ok = rows < cnt
    ok = row_ok[:, None] & (cols < NN)[None, :]
    n_idx = (lo + rows).to(tl.int64)
    dot = tl.zeros([BMS], tl.float32)
    if EPILOGUE == SCATTER:
        if e < E:
            d_row = tl.load(dst_ptr + n_idx, mask=row_ok, other=0).to(tl.int64)
            val = g
            if HAS_SCALE:
                val = val * tl.load(scale_ptr + n_idx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.atomic_add(c_ptr + d_row[:, None] * stride_cn + cols[None, :], val, mask=ok, sem="relaxed")
    else:
        out_ty: tl.constexpr = c_ptr.dtype.element_ty
        h_ptrs = h_ptr + n_idx[:, None] * stride_hn + cols[None, :]
        hg = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
        hu = tl.load(h_ptrs + F_OFF, mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(scale_ptr + n_idx, mask=row_ok & (e < E), other=0.0).to(tl.float32)
        a_val, dhg, dhu = swiglu_bwd(hg, hu, g, gate[:, None])
        dot = tl.sum(a_val * g, axis=1)
        dh_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
        tl.store(dh_ptrs, dhg.to(out_ty), mask=ok)
        tl.store(dh_ptrs + F_OFF, dhu.to(out_ty), mask=ok)
        tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], (a_val * gate[:, None]).to(out_ty), mask=ok)
    return dot


# Row and expert counts vary from call to call: no recompiles for their divisibility.
@triton.jit(do_not_specialize=["N_ROWS", "E", "stride_pn"])
def _fused_mm_hopper_kernel(
    a_desc, a_ptr, src_ptr, b_desc, offsets_ptr, tile_cum_ptr,
    c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
    N_ROWS, E, K_DIM, NN, F_OFF, stride_an, stride_cn, stride_c2n, stride_hn, stride_pn,
    EPILOGUE: tl.constexpr, A_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, B_KMAJOR: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_SMS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr, LAG: tl.constexpr, CONSUMER_REGS: tl.constexpr,
    EARLY_H: tl.constexpr, VIRT: tl.constexpr, EPI_WG: tl.constexpr,
    EPI_REGS: tl.constexpr, EPI_COLS: tl.constexpr, PINGPONG: tl.constexpr,
):
    BMS: tl.constexpr = BM // 2
    dtype: tl.constexpr = tlx.dtype_of(b_desc)
    a_buf = tlx.local_alloc((BMS, BK), dtype, NUM_STAGES * 2)
    if EPILOGUE == SWIGLU:
        b_buf = tlx.local_alloc((1, BK, BN), dtype, NUM_STAGES * 2)  # [gate, up] per stage
    elif B_KMAJOR:
        b_buf = tlx.local_alloc((1, BN, BK), dtype, NUM_STAGES)
    else:
        b_buf = tlx.local_alloc((1, BK, BN), dtype, NUM_STAGES)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    # PINGPONG: one consumer reads (and releases) each stage; else both read their half of it
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1 if PINGPONG else 2)
    # PINGPONG (dSwiGLU reading its A in place): each consumer takes every other tile whole, and the
    # two take turns issuing their main loops (mma_bar), so one's epilogue runs beside the other's MMAs
    tl.static_assert(PINGPONG == 0 or (EPILOGUE == DSWIGLU and not A_GATHER and EPI_WG == 0 and B_KMAJOR
                                       and HAS_SCALE))
    mma_bar = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    if A_GATHER:
        afull = tlx.alloc_warp_barrier(num_barriers=NUM_STAGES, num_warps=4)
    else:
        afull = full  # never waited on
    NCH: tl.constexpr = BN // EPI_COLS
    # the handed-off epilogue has the scatter and dSwiGLU forms only (one accumulator, h from global)
    tl.static_assert(EPI_WG == 0 or EPILOGUE != SWIGLU)
    if EPI_WG:  # each consumer's accumulator, in NCH column chunks, for the epilogue warp group
        accb = tlx.local_alloc((BMS, EPI_COLS), tl.float32, 2 * NCH)
        epi_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
        epi_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    else:
        accb = a_buf  # never used
        epi_full = full
        epi_empty = empty

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: cp.async row gathers and TMA loads
            tiles_n = tl.cdiv(NN, BN)
            total = mm_num_tiles(tile_cum_ptr, E, tiles_n)
            it = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                it = _mm_produce(t, it, a_desc, a_ptr, src_ptr, b_desc, a_buf, b_buf, full, afull, empty, tile_cum_ptr,
                                 offsets_ptr, E, N_ROWS, K_DIM, tiles_n, F_OFF, stride_an, EPILOGUE, A_GATHER,
                                 B_KMAJOR, BM, BN, BK, NUM_STAGES, SEARCH_STEPS, GROUP_M, LAG, VIRT)
        with tlx.async_task(num_warps=4, replicate=2, registers=CONSUMER_REGS):  # wgmma + fused epilogue
            cid: tl.constexpr = tlx.async_task_replica_id()
            tiles_n = tl.cdiv(NN, BN)
            total = mm_num_tiles(tile_cum_ptr, E, tiles_n)
            it = 0
            tc = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                if PINGPONG:
                    it = _mm_consume_pingpong(t, it, tc, a_buf, b_buf, full, empty, mma_bar, tile_cum_ptr, offsets_ptr,
                                              c_ptr, c2_ptr, scale_ptr, h_ptr, part_ptr, E, N_ROWS, K_DIM, NN, F_OFF,
                                              tiles_n, stride_cn, stride_c2n, stride_hn, stride_pn, cid, BM, BN, BK,
                                              NUM_STAGES, SEARCH_STEPS, GROUP_M, EARLY_H, EPI_COLS)
                else:
                    it = _mm_consume(t, it, tc, a_buf, b_buf, full, afull, empty, tile_cum_ptr,
                                     offsets_ptr, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr, E, N_ROWS, K_DIM,
                                     NN, F_OFF, tiles_n, stride_cn, stride_c2n, stride_hn, stride_pn, cid, EPILOGUE,
                                     A_GATHER, HAS_SCALE, B_KMAJOR, BM, BN, BK, NUM_STAGES, SEARCH_STEPS, GROUP_M,
                                     EARLY_H, accb, epi_full, epi_empty, EPI_WG, NCH)
                tc += 1
        if EPI_WG == 1:
            with tlx.async_task(num_warps=4, registers=EPI_REGS):  # epilogue of both consumers' tiles
                tiles_n = tl.cdiv(NN, BN)
                total = mm_num_tiles(tile_cum_ptr, E, tiles_n)
                tc = 0
                for t in range(tl.program_id(0), total, NUM_SMS):
                    e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS,
                                                     GROUP_M)
                    for c in tl.static_range(2):  # the tile found once for both consumers' halves
                        _epi_tile(e, lo, cnt, mt, nt, tc, c, accb, epi_full, epi_empty, c_ptr, c2_ptr, dst_ptr,
                                  scale_ptr, h_ptr, part_ptr, E, NN, F_OFF, stride_cn, stride_c2n, stride_hn,
                                  stride_pn, EPILOGUE, HAS_SCALE, BM, BN, EPI_COLS)
                    tc += 1
        if EPI_WG == 2:
            with tlx.async_task(num_warps=4, replicate=2, registers=EPI_REGS):  # one per consumer
                ce: tl.constexpr = tlx.async_task_replica_id()
                tiles_n = tl.cdiv(NN, BN)
                total = mm_num_tiles(tile_cum_ptr, E, tiles_n)
                tc = 0
                for t in range(tl.program_id(0), total, NUM_SMS):
                    e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS,
                                                     GROUP_M)
                    _epi_tile(e, lo, cnt, mt, nt, tc, ce, accb, epi_full, epi_empty, c_ptr, c2_ptr, dst_ptr,
                              scale_ptr, h_ptr, part_ptr, E, NN, F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn,
                              EPILOGUE, HAS_SCALE, BM, BN, EPI_COLS)
                    tc += 1


# --- ragged-K weight gradient ----------------------------------------------------------------------


@triton.jit
def _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, tiles_m, tiles_n, DYNAMIC: tl.constexpr,
                   GROUP_M: tl.constexpr):
    if DYNAMIC:
        e, lo, cnt, mt, nt = wgrad_tile_lpt(t, order_ptr, offsets_ptr, E, N_ROWS, tiles_m, tiles_n, GROUP_M)
    else:
        e, lo, cnt, mt, nt = wgrad_tile(t, offsets_ptr, E, N_ROWS, tiles_m, tiles_n)
    return e, lo, cnt, mt, nt


@triton.jit
def _wgrad_produce(t, it, a_desc, a_ptr, ia_ptr, b_desc, b_ptr, ib_ptr, a_buf, b_buf, full, afull, empty,
                   offsets_ptr, order_ptr, E, N_ROWS, M_DIM, NN, stride_an, stride_bn,
                   A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, DYNAMIC: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr,
                   LAG: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    TMA_BYTES: tl.constexpr = (0 if A_GATHER else BM * BK * 2) + (0 if B_GATHER else BK * BN * 2)
    GATHER: tl.constexpr = A_GATHER or B_GATHER
    e, lo, cnt, mt, nt = _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, tl.cdiv(M_DIM, BM), tl.cdiv(NN, BN),
                                        DYNAMIC, GROUP_M)
    m_off = mt * BM
    n_off = nt * BN
    steps = tl.cdiv(cnt, BK)
    ks = tl.arange(0, BK)
    # The gathered operand's row indices change every k-step (the rows are the reduction): load
    # step k + 1's while step k's copies are issued, so the index load's latency never stalls the
    # copies (a global load per step in the producer's critical path takes longer than a stage's MMAs).
    if A_GATHER:
        ia_next = tl.load(ia_ptr + lo + ks, mask=ks < cnt, other=0)
    if B_GATHER:
        ib_next = tl.load(ib_ptr + lo + ks, mask=ks < cnt, other=0)
    for k in range(0, steps):
        s = it % NUM_STAGES
        k_off = k * BK
        r_ok = (k_off + ks) < cnt
        n_ok = (k_off + BK + ks) < cnt
        if A_GATHER:
            ia = ia_next.to(tl.int64)
            ia_next = tl.load(ia_ptr + lo + k_off + BK + ks, mask=n_ok, other=0)
        if B_GATHER:
            ib = ib_next.to(tl.int64)
            ib_next = tl.load(ib_ptr + lo + k_off + BK + ks, mask=n_ok, other=0)
        tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
        if A_GATHER:
            # x^T tile: BK gathered rows (the reduction) x BMS columns per consumer half.
            cols = m_off + tl.arange(0, BMS)
            pa = a_ptr + ia[:, None] * stride_an + cols[None, :]
            tlx.async_load(pa, a_buf[s * 2], mask=r_ok[:, None] & (cols < M_DIM)[None, :])
            tlx.async_load(pa + BMS, a_buf[s * 2 + 1], mask=r_ok[:, None] & ((cols + BMS) < M_DIM)[None, :])
        if B_GATHER:
            cols_b = n_off + tl.arange(0, BN)
            tlx.async_load(b_ptr + ib[:, None] * stride_bn + cols_b[None, :], b_buf[s],
                           mask=r_ok[:, None] & (cols_b < NN)[None, :])
        if GATHER:
            tlx.async_load_commit_group()
        if TMA_BYTES > 0:
            tlx.barrier_expect_bytes(full[s], TMA_BYTES)
            c0, c1, c2 = ragged_coords(lo, cnt, k_off)
            if not A_GATHER:
                tlx.async_descriptor_load(a_desc, a_buf[s * 2], [c0, c1, c2, m_off], full[s])
                tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [c0, c1, c2, m_off + BMS], full[s])
            if not B_GATHER:
                tlx.async_descriptor_load(b_desc, b_buf[s], [c0, c1, c2, n_off], full[s])
        if GATHER:
            _signal_gathered(it, k, LAG, NUM_STAGES, afull)
        it += 1
    if GATHER:
        _drain_gathered(it, steps, LAG, NUM_STAGES, afull)
    return it


@triton.jit
def _wgrad_consume(t, it, c_desc, a_buf, b_buf, c_buf, full, afull, empty, offsets_ptr, order_ptr,
                   E, N_ROWS, M_DIM, NN, CID: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr,
                   DYNAMIC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    TMA: tl.constexpr = not (A_GATHER and B_GATHER)
    GATHER: tl.constexpr = A_GATHER or B_GATHER
    dtype: tl.constexpr = tlx.dtype_of(c_desc)
    e, lo, cnt, mt, nt = _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, tl.cdiv(M_DIM, BM), tl.cdiv(NN, BN),
                                        DYNAMIC, GROUP_M)
    steps = tl.cdiv(cnt, BK)
    acc = tl.zeros((BMS, BN), dtype=tl.float32)
    prev = 0
    for k in range(0, steps):
        s = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        if TMA:
            tlx.barrier_wait(full[s], phase)
        if GATHER:
            tlx.barrier_wait(afull[s], phase)
        a = tlx.local_trans(tlx.local_reshape(a_buf[s * 2 + CID], [BK, BMS]))
        b = tlx.local_reshape(b_buf[s], [BK, BN])
        acc = tlx.async_dot(a, b, acc)
        acc = tlx.async_dot_wait(1, acc)
        if k > 0:
            tlx.barrier_arrive(empty[prev])
        prev = s
        it += 1
    acc = tlx.async_dot_wait(0, acc)
    if steps > 0:
        tlx.barrier_arrive(empty[prev])
    # The previous tile's TMA store must have read c_buf before we overwrite it.
    tlx.async_descriptor_store_wait(0)
    tlx.local_store(tlx.local_reshape(c_buf[CID], [BMS, BN]), acc.to(dtype))
    tlx.fence_async_shared()
    tlx.async_descriptor_store(c_desc, c_buf[CID], [e, mt * BM + CID * BMS, nt * BN])
    return it


@triton.jit(do_not_specialize=["N_ROWS", "E"])
def _fused_wgrad_hopper_kernel(
    a_desc, a_ptr, ia_ptr, b_desc, b_ptr, ib_ptr, c_desc, offsets_ptr, order_ptr, sched_ptr,
    N_ROWS, E, M_DIM, NN, stride_an, stride_bn,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, DYNAMIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_SMS: tl.constexpr,
    GROUP_M: tl.constexpr, LAG: tl.constexpr, CONSUMER_REGS: tl.constexpr,
):
    BMS: tl.constexpr = BM // 2
    dtype: tl.constexpr = tlx.dtype_of(c_desc)
    if A_GATHER:
        a_buf = tlx.local_alloc((BK, BMS), dtype, NUM_STAGES * 2)
    else:
        a_buf = tlx.local_alloc((1, 1, BK, BMS), dtype, NUM_STAGES * 2)
    if B_GATHER:
        b_buf = tlx.local_alloc((BK, BN), dtype, NUM_STAGES)
    else:
        b_buf = tlx.local_alloc((1, 1, BK, BN), dtype, NUM_STAGES)
    c_buf = tlx.local_alloc((1, BMS, BN), dtype, 2)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=2)
    afull = tlx.alloc_warp_barrier(num_barriers=NUM_STAGES, num_warps=4)
    if DYNAMIC:
        tile_ids = tlx.local_alloc((1,), tl.int32, 2)
        tid_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
        tid_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: gathers, TMA loads and (DYNAMIC) tile claims
            total = E * tl.cdiv(M_DIM, BM) * tl.cdiv(NN, BN)
            it = 0
            if DYNAMIC:
                t = tl.program_id(0)
                n = 0
                while t < total:
                    slot = n % 2
                    tlx.barrier_wait(tid_empty[slot], ((n // 2) & 1) ^ 1)
                    tlx.local_store(tile_ids[slot], tl.full((1,), t, tl.int32))
                    tlx.barrier_arrive(tid_full[slot])
                    it = _wgrad_produce(t, it, a_desc, a_ptr, ia_ptr, b_desc, b_ptr, ib_ptr, a_buf, b_buf, full, afull,
                                        empty, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, NN, stride_an, stride_bn,
                                        A_GATHER, B_GATHER, DYNAMIC, BM, BN, BK, NUM_STAGES, GROUP_M, LAG)
                    # Relaxed: the counter only hands out ids; no data is published through it.
                    t = tl.atomic_add(sched_ptr, 1, sem="relaxed") + NUM_SMS
                    n += 1
                slot = n % 2  # the end marker
                tlx.barrier_wait(tid_empty[slot], ((n // 2) & 1) ^ 1)
                tlx.local_store(tile_ids[slot], tl.full((1,), total, tl.int32))
                tlx.barrier_arrive(tid_full[slot])
            else:
                for t in range(tl.program_id(0), total, NUM_SMS):
                    it = _wgrad_produce(t, it, a_desc, a_ptr, ia_ptr, b_desc, b_ptr, ib_ptr, a_buf, b_buf, full, afull,
                                        empty, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, NN, stride_an, stride_bn,
                                        A_GATHER, B_GATHER, DYNAMIC, BM, BN, BK, NUM_STAGES, GROUP_M, LAG)

        with tlx.async_task(num_warps=4, replicate=2, registers=CONSUMER_REGS):  # wgmma + TMA-store epilogue
            cid: tl.constexpr = tlx.async_task_replica_id()
            total = E * tl.cdiv(M_DIM, BM) * tl.cdiv(NN, BN)
            it = 0
            if DYNAMIC:
                n = 0
                tlx.barrier_wait(tid_full[0], 0)
                t = tl.sum(tlx.local_load(tile_ids[0]), axis=0)
                tlx.barrier_arrive(tid_empty[0])
                while t < total:
                    it = _wgrad_consume(t, it, c_desc, a_buf, b_buf, c_buf, full, afull, empty, offsets_ptr, order_ptr,
                                        E, N_ROWS, M_DIM, NN, cid, A_GATHER, B_GATHER, DYNAMIC, BM, BN, BK,
                                        NUM_STAGES, GROUP_M)
                    n += 1
                    slot = n % 2
                    tlx.barrier_wait(tid_full[slot], (n // 2) & 1)
                    t = tl.sum(tlx.local_load(tile_ids[slot]), axis=0)
                    tlx.barrier_arrive(tid_empty[slot])
            else:
                for t in range(tl.program_id(0), total, NUM_SMS):
                    it = _wgrad_consume(t, it, c_desc, a_buf, b_buf, c_buf, full, afull, empty, offsets_ptr, order_ptr,
                                        E, N_ROWS, M_DIM, NN, cid, A_GATHER, B_GATHER, DYNAMIC, BM, BN, BK,
                                        NUM_STAGES, GROUP_M)
            tlx.async_descriptor_store_wait(0)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_fused_mm_hopper_kernel)
_c_launch(_fused_wgrad_hopper_kernel)
