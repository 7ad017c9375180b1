"""Fused MoE expert GEMMs for Blackwell (sm_100) in TLX: gather-on-load and SwiGLU / gate-scatter /
dSwiGLU epilogues on the tcgen05 pipeline of tlx/blackwell/grouped_gemm.py.

Legend and index arrays as in tlx/portable/fused_moe.py (R source rows, N expert-major rows, D, F,
E; ``src_N`` / ``dst_N`` row indices, int32 or int64; ``offsets_E``; padding rows past the end) and
tlx/hopper/fused_moe.py (the same forms, the same launch arguments). BM x BN output tile, BK step.

Pipeline (three partitions per CTA, persistent over the tiles of tlx/common/scheduler.py):
  producer (LOAD_WARPS warps): TMA loads of the operands read in place into a NUM_STAGES ring
    (``full`` / ``empty``) and, where an operand is read by index, 16-byte ``cp.async`` row gathers
    into the same NVMMA-swizzled stage buffer, signalled through the per-thread warp barrier
    ``afull[s]`` (tlx/common/gather.py). A gathered BM x BK (or BK x BM) bf16 block is 16 KB or
    8 KB per stage: one warp would issue 32 copies per thread per stage and hold 256 row pointers,
    so a gathering producer is a full warp group (LOAD_WARPS = 4: 8 copies per thread per stage,
    the same per-thread load as Hopper's producer warp group); TMA-only forms use one warp.
  MMA (1 warp): tcgen05.mma from shared memory into a TMEM accumulator; each step's last MMA
    releases its stage through ``empty[s]`` when it completes; ``tcgen05_commit`` signals
    ``acc_full[b]``. Two TMEM buffers (b = tile parity), so the next tile's MMAs overlap this
    tile's epilogue; ``acc_empty[b]`` hands a buffer back.
  epilogue (default warp group, 4 warps = the 128 TMEM lanes, one row per thread): reads the
    accumulator from TMEM in column slices of EPI_BN and applies the form's epilogue.
LAG <= NUM_STAGES - 1: the MMA warp never waits for stage j + 1 before stage j is released (an MMA
releases its own stage on completion), so the producer, waiting for stage ``it - NUM_STAGES`` to be
released, needs only the stages it has already signalled (up to ``it - 1 - LAG``). Hopper's
consumers release stage j - 1 only after starting stage j, hence its LAG <= NUM_STAGES - 2.
Tiles without k-steps (the padding pseudo-expert; experts without rows in dW) skip the MMA warp and
TMEM; their epilogue runs on zeros (SwiGLU / dSwiGLU padding rows store zeros, dW stores a zero
tile, the scatter form adds nothing).

``_fused_mm_blackwell_kernel`` (ragged M; static persistent tile walk, optional GROUP_M raster):
  EPILOGUE == SWIGLU : A = x[src] (gathered) @ w13[e]; two B tiles per stage (gate columns n_off, up
                       columns F + n_off) into two TMEM accumulators (4 x BN columns with double
                       buffering); stores h (both halves, rounded) and a = silu(hg) * hu.
  EPILOGUE == SCATTER: A = a or dh (TMA) @ w (w2, or w13^T read K-major); out_f32[dst[n]] +=
                       scale[n] * acc with relaxed fp32 atomics.
  EPILOGUE == DSWIGLU: A = dout[dst] (gathered) @ w2^T (K-major); with h and the gate: stores dh,
                       ag = gate * a and the gate-gradient partial dot of this F-tile.
``_fused_wgrad_blackwell_kernel`` (ragged K): dw[e] = A[ia]^T @ B[ib] over the expert's rows, either
  operand gathered (A_GATHER: x[src] for dW13; B_GATHER: dout[dst] for dW2), the other by ragged
  TMA; tiles walk the experts longest first (``order_E``, static round-robin over that order); the
  output goes TMEM -> registers -> shared memory -> TMA store in EPI_BN-column slices.
Epilogue math: tlx/common/moe_epilogues.py. Compile-checked for sm_100 on the CPU
(tests/test_fused_compile.py); not yet run on a B200.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.gather import drain_gathered, gather_ptrs, row_ptrs, signal_gathered
from tlx.common.moe_epilogues import swiglu_bwd, swiglu_fwd
from tlx.common.scheduler import _tile_any, mm_num_tiles, ragged_coords

SWIGLU = tl.constexpr(1)
SCATTER = tl.constexpr(2)
DSWIGLU = tl.constexpr(3)


@triton.jit
def _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr):
    # ragged-M tile t -> (expert, first row, rows, m-tile, n-tile); steps = 0 for the padding tiles
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, offsets_ptr, E, N_ROWS, N_ROWS, tiles_n, 128,
                                   False, False, SEARCH_STEPS, GROUP_M)
    return e, lo, cnt, mt, nt


# --- ragged-M forms --------------------------------------------------------------------------------


@triton.jit
def _mm_epilogue(acc_tm, b, has_k, e, lo, cnt, mt, nt, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
                 E, NN, F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn, EPILOGUE: tl.constexpr,
                 HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EPI_BN: tl.constexpr):
    rows = mt * BM + tl.arange(0, BM)
    row_ok = rows < cnt
    n_idx = (lo + rows).to(tl.int64)
    NACC: tl.constexpr = 2 if EPILOGUE == SWIGLU else 1
    if EPILOGUE == SCATTER:
        if has_k:
            d_row = tl.load(dst_ptr + n_idx, mask=row_ok, other=0).to(tl.int64)
            if HAS_SCALE:
                sc = tl.load(scale_ptr + n_idx, mask=row_ok, other=0.0).to(tl.float32)
            for j in tl.static_range(BN // EPI_BN):
                cols = nt * BN + j * EPI_BN + tl.arange(0, EPI_BN)
                val = tlx.local_load(tlx.local_slice(acc_tm[b], [0, j * EPI_BN], [BM, EPI_BN]))
                if HAS_SCALE:
                    val = val * sc[:, None]
                ok = row_ok[:, None] & (cols < NN)[None, :]
                tl.atomic_add(c_ptr + d_row[:, None] * stride_cn + cols[None, :], val, mask=ok, sem="relaxed")
    elif EPILOGUE == SWIGLU:
        out_ty: tl.constexpr = c_ptr.dtype.element_ty
        for j in tl.static_range(BN // EPI_BN):
            cols = nt * BN + j * EPI_BN + tl.arange(0, EPI_BN)
            if has_k:
                hg = tlx.local_load(tlx.local_slice(acc_tm[b * NACC], [0, j * EPI_BN], [BM, EPI_BN])).to(out_ty)
                hu = tlx.local_load(tlx.local_slice(acc_tm[b * NACC + 1], [0, j * EPI_BN], [BM, EPI_BN])).to(out_ty)
            else:
                hg = tl.zeros((BM, EPI_BN), dtype=out_ty)
                hu = tl.zeros((BM, EPI_BN), dtype=out_ty)
            ok = row_ok[:, None] & (cols < NN)[None, :]
            h_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
            tl.store(h_ptrs, hg, mask=ok)
            tl.store(h_ptrs + F_OFF, hu, mask=ok)
            a_val = swiglu_fwd(hg.to(tl.float32), hu.to(tl.float32))  # from the rounded h, as backward reads it
            tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], a_val.to(out_ty), mask=ok)
    else:
        out_ty: tl.constexpr = c_ptr.dtype.element_ty
        gate = tl.load(scale_ptr + n_idx, mask=row_ok & (e < E), other=0.0).to(tl.float32)
        dgate = tl.zeros((BM,), dtype=tl.float32)
        for j in tl.static_range(BN // EPI_BN):
            cols = nt * BN + j * EPI_BN + tl.arange(0, EPI_BN)
            if has_k:
                g = tlx.local_load(tlx.local_slice(acc_tm[b], [0, j * EPI_BN], [BM, EPI_BN]))
            else:
                g = tl.zeros((BM, EPI_BN), dtype=tl.float32)
            ok = row_ok[:, None] & (cols < NN)[None, :]
            h_ptrs = h_ptr + n_idx[:, None] * stride_hn + cols[None, :]
            hg = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
            hu = tl.load(h_ptrs + F_OFF, mask=ok, other=0.0).to(tl.float32)
            a_val, dhg, dhu = swiglu_bwd(hg, hu, g, gate[:, None])
            dgate += tl.sum(a_val * g, axis=1)
            dh_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
            tl.store(dh_ptrs, dhg.to(out_ty), mask=ok)
            tl.store(dh_ptrs + F_OFF, dhu.to(out_ty), mask=ok)
            tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], (a_val * gate[:, None]).to(out_ty), mask=ok)
        tl.store(part_ptr + n_idx * stride_pn + nt, dgate, mask=row_ok)


# Row and expert counts vary from call to call: no recompiles for their divisibility.
@triton.jit(do_not_specialize=["N_ROWS", "E", "stride_pn"])
def _fused_mm_blackwell_kernel(
    a_desc, a_ptr, src_ptr, b_desc, offsets_ptr, tile_cum_ptr,
    c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
    N_ROWS, E, K_DIM, NN, F_OFF, stride_an, stride_cn, stride_c2n, stride_hn, stride_pn,
    EPILOGUE: tl.constexpr, A_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, B_KMAJOR: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_SMS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr, LAG: tl.constexpr, EPI_BN: tl.constexpr,
    LOAD_WARPS: tl.constexpr, LOAD_REGS: tl.constexpr, VIRT: tl.constexpr,
):
    NACC: tl.constexpr = 2 if EPILOGUE == SWIGLU else 1  # SwiGLU: gate and up accumulators
    dtype: tl.constexpr = tlx.dtype_of(b_desc)
    a_buf = tlx.local_alloc((BM, BK), dtype, NUM_STAGES)
    if EPILOGUE == SWIGLU:
        b_buf = tlx.local_alloc((1, BK, BN), dtype, NUM_STAGES * 2)  # [gate, up] per stage
    elif B_KMAJOR:
        b_buf = tlx.local_alloc((1, BN, BK), dtype, NUM_STAGES)
    else:
        b_buf = tlx.local_alloc((1, BK, BN), dtype, NUM_STAGES)
    acc_tm = tlx.local_alloc((BM, BN), tl.float32, 2 * NACC, tlx.storage_kind.tmem)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    if A_GATHER:
        afull = tlx.alloc_warp_barrier(num_barriers=NUM_STAGES, num_warps=LOAD_WARPS)
    else:
        afull = full  # never waited on
    acc_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    acc_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    A_BYTES: tl.constexpr = 0 if A_GATHER else BM * BK * 2
    B_BYTES: tl.constexpr = NACC * BK * BN * 2

    with tlx.async_tasks():
        with tlx.async_task("default"):  # epilogue: TMEM -> registers in EPI_BN-column slices
            tiles_n = tl.cdiv(NN, BN)
            tc = 0
            for t in range(tl.program_id(0), mm_num_tiles(tile_cum_ptr, E, tiles_n), NUM_SMS):
                e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS,
                                                 GROUP_M)
                has_k = e < E
                b = tc % 2
                if has_k:
                    tlx.barrier_wait(acc_full[b], (tc // 2) & 1)
                _mm_epilogue(acc_tm, b, has_k, e, lo, cnt, mt, nt, c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
                             E, NN, F_OFF, stride_cn, stride_c2n, stride_hn, stride_pn, EPILOGUE, HAS_SCALE, BM, BN,
                             EPI_BN)
                if has_k:
                    tlx.barrier_arrive(acc_empty[b], 1)
                    tc += 1

        with tlx.async_task(num_warps=1, num_regs=48):  # tcgen05 MMA issuer
            tiles_n = tl.cdiv(NN, BN)
            it = 0
            tc = 0
            for t in range(tl.program_id(0), mm_num_tiles(tile_cum_ptr, E, tiles_n), NUM_SMS):
                e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS,
                                                 GROUP_M)
                if e < E:
                    b = tc % 2
                    tlx.barrier_wait(acc_empty[b], ((tc // 2) & 1) ^ 1)
                    for k in range(0, tl.cdiv(K_DIM, BK)):
                        s = it % NUM_STAGES
                        phase = (it // NUM_STAGES) & 1
                        tlx.barrier_wait(full[s], phase)
                        if A_GATHER:
                            tlx.barrier_wait(afull[s], phase)
                        if EPILOGUE == SWIGLU:
                            # tcgen05 ops of one thread complete in order: the up MMA's barrier
                            # releases the stage once both have read it.
                            tlx.async_dot(a_buf[s], tlx.local_reshape(b_buf[s * 2], [BK, BN]), acc_tm[b * 2],
                                          use_acc=k > 0, force_async=True, out_dtype=tl.float32)
                            tlx.async_dot(a_buf[s], tlx.local_reshape(b_buf[s * 2 + 1], [BK, BN]), acc_tm[b * 2 + 1],
                                          use_acc=k > 0, mBarriers=[empty[s]], out_dtype=tl.float32)
                        else:
                            if B_KMAJOR:
                                bb = tlx.local_trans(tlx.local_reshape(b_buf[s], [BN, BK]))
                            else:
                                bb = tlx.local_reshape(b_buf[s], [BK, BN])
                            tlx.async_dot(a_buf[s], bb, acc_tm[b], use_acc=k > 0, mBarriers=[empty[s]],
                                          out_dtype=tl.float32)
                        it += 1
                    tlx.tcgen05_commit(acc_full[b])
                    tc += 1

        with tlx.async_task(num_warps=LOAD_WARPS, num_regs=LOAD_REGS):  # producer: row gathers and TMA
            tiles_n = tl.cdiv(NN, BN)
            it = 0
            for t in range(tl.program_id(0), mm_num_tiles(tile_cum_ptr, E, tiles_n), NUM_SMS):
                e, lo, cnt, mt, nt = _mm_tile_at(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS,
                                                 GROUP_M)
                n_off = nt * BN
                steps = tl.where(e < E, tl.cdiv(K_DIM, BK), 0)
                ew = e // VIRT  # the weights' expert (VIRT > 1: runs of one expert's rows as virtual experts)
                if A_GATHER:  # row pointers once per tile; rows past the expert load zeros
                    pa, ma = gather_ptrs(a_ptr, src_ptr, lo, mt * BM, cnt, stride_an, 0, BK, BM, BK)
                for k in range(0, steps):
                    s = it % NUM_STAGES
                    tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
                    k_off = k * BK
                    if A_GATHER:
                        tlx.async_load(pa + k_off, a_buf[s], mask=ma)
                        tlx.async_load_commit_group()
                    tlx.barrier_expect_bytes(full[s], A_BYTES + B_BYTES)
                    if not A_GATHER:
                        tlx.async_descriptor_load(a_desc, a_buf[s], [lo + mt * BM, k_off], full[s])
                    if EPILOGUE == SWIGLU:
                        tlx.async_descriptor_load(b_desc, b_buf[s * 2], [ew, k_off, n_off], full[s])
                        tlx.async_descriptor_load(b_desc, b_buf[s * 2 + 1], [ew, k_off, n_off + F_OFF], full[s])
                    elif B_KMAJOR:
                        tlx.async_descriptor_load(b_desc, b_buf[s], [ew, n_off, k_off], full[s])
                    else:
                        tlx.async_descriptor_load(b_desc, b_buf[s], [ew, k_off, n_off], full[s])
                    if A_GATHER:
                        signal_gathered(it, k, LAG, NUM_STAGES, afull)
                    it += 1
                if A_GATHER:
                    drain_gathered(it, steps, LAG, NUM_STAGES, afull)


# --- ragged-K weight gradient ----------------------------------------------------------------------


@triton.jit
def _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM: tl.constexpr, GROUP_M: tl.constexpr):
    # dW tile t -> (expert, first row, rows, m-tile, n-tile), experts longest first (order_E)
    e, lo, cnt, mt, nt = _tile_any(t, order_ptr, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, tiles_n, BM, True, True,
                                   1, GROUP_M)
    return e, lo, cnt, mt, nt


@triton.jit(do_not_specialize=["N_ROWS", "E"])
def _fused_wgrad_blackwell_kernel(
    a_desc, a_ptr, ia_ptr, b_desc, b_ptr, ib_ptr, c_desc, offsets_ptr, order_ptr,
    N_ROWS, E, M_DIM, NN, stride_an, stride_bn,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_SMS: tl.constexpr,
    GROUP_M: tl.constexpr, LAG: tl.constexpr, EPI_BN: tl.constexpr, LOAD_WARPS: tl.constexpr,
    LOAD_REGS: tl.constexpr,
):
    dtype: tl.constexpr = tlx.dtype_of(c_desc)
    GATHER: tl.constexpr = A_GATHER or B_GATHER
    TMA_BYTES: tl.constexpr = (0 if A_GATHER else BM * BK * 2) + (0 if B_GATHER else BK * BN * 2)
    if A_GATHER:
        a_buf = tlx.local_alloc((BK, BM), dtype, NUM_STAGES)
    else:
        a_buf = tlx.local_alloc((1, 1, BK, BM), dtype, NUM_STAGES)
    if B_GATHER:
        b_buf = tlx.local_alloc((BK, BN), dtype, NUM_STAGES)
    else:
        b_buf = tlx.local_alloc((1, 1, BK, BN), dtype, NUM_STAGES)
    c_buf = tlx.local_alloc((1, BM, EPI_BN), dtype, 2)
    acc_tm = tlx.local_alloc((BM, BN), tl.float32, 2, tlx.storage_kind.tmem)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    afull = tlx.alloc_warp_barrier(num_barriers=NUM_STAGES, num_warps=LOAD_WARPS)
    acc_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    acc_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=1)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # epilogue: TMEM -> registers -> shared -> TMA store
            tiles_n = tl.cdiv(NN, BN)
            tc = 0
            sc = 0
            for t in range(tl.program_id(0), E * tl.cdiv(M_DIM, BM) * tiles_n, NUM_SMS):
                e, lo, cnt, mt, nt = _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM,
                                                    GROUP_M)
                has_k = cnt > 0
                b = tc % 2
                if has_k:
                    tlx.barrier_wait(acc_full[b], (tc // 2) & 1)
                for j in tl.static_range(BN // EPI_BN):
                    if has_k:
                        vals = tlx.local_load(tlx.local_slice(acc_tm[b], [0, j * EPI_BN], [BM, EPI_BN]))
                    else:
                        vals = tl.zeros((BM, EPI_BN), dtype=tl.float32)  # an expert without rows: dw[e] = 0
                    eb = sc % 2
                    tlx.async_descriptor_store_wait(1)  # the store that last read c_buf[eb] is done
                    tlx.local_store(tlx.local_reshape(c_buf[eb], [BM, EPI_BN]), vals.to(dtype))
                    tlx.fence_async_shared()
                    tlx.async_descriptor_store(c_desc, c_buf[eb], [e, mt * BM, nt * BN + j * EPI_BN])
                    sc += 1
                if has_k:
                    tlx.barrier_arrive(acc_empty[b], 1)
                    tc += 1
            tlx.async_descriptor_store_wait(0)

        with tlx.async_task(num_warps=1, num_regs=48):  # tcgen05 MMA issuer
            tiles_n = tl.cdiv(NN, BN)
            it = 0
            tc = 0
            for t in range(tl.program_id(0), E * tl.cdiv(M_DIM, BM) * tiles_n, NUM_SMS):
                e, lo, cnt, mt, nt = _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM,
                                                    GROUP_M)
                steps = tl.cdiv(cnt, BK)
                if steps > 0:
                    b = tc % 2
                    tlx.barrier_wait(acc_empty[b], ((tc // 2) & 1) ^ 1)
                    for k in range(0, steps):
                        s = it % NUM_STAGES
                        phase = (it // NUM_STAGES) & 1
                        if TMA_BYTES > 0:
                            tlx.barrier_wait(full[s], phase)
                        if GATHER:
                            tlx.barrier_wait(afull[s], phase)
                        a = tlx.local_trans(tlx.local_reshape(a_buf[s], [BK, BM]))  # MN-major A = x^T
                        bb = tlx.local_reshape(b_buf[s], [BK, BN])
                        tlx.async_dot(a, bb, acc_tm[b], use_acc=k > 0, mBarriers=[empty[s]], out_dtype=tl.float32)
                        it += 1
                    tlx.tcgen05_commit(acc_full[b])
                    tc += 1

        with tlx.async_task(num_warps=LOAD_WARPS, num_regs=LOAD_REGS):  # producer: row gathers and ragged TMA
            tiles_n = tl.cdiv(NN, BN)
            it = 0
            for t in range(tl.program_id(0), E * tl.cdiv(M_DIM, BM) * tiles_n, NUM_SMS):
                e, lo, cnt, mt, nt = _wgrad_tile_at(t, order_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM,
                                                    GROUP_M)
                m_off = mt * BM
                n_off = nt * BN
                steps = tl.cdiv(cnt, BK)
                ks = tl.arange(0, BK)
                # Next step's row indices loaded one step ahead (as on Hopper): the index load's
                # latency stays out of the copy issue.
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
                        ia = ia_next
                        ia_next = tl.load(ia_ptr + lo + k_off + BK + ks, mask=n_ok, other=0)
                    if B_GATHER:
                        ib = ib_next
                        ib_next = tl.load(ib_ptr + lo + k_off + BK + ks, mask=n_ok, other=0)
                    tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
                    if A_GATHER:  # x^T block: BK gathered rows (the reduction) x BM columns
                        pa, ma = row_ptrs(a_ptr, ia, r_ok, stride_an, m_off, M_DIM, BM)
                        tlx.async_load(pa, a_buf[s], mask=ma)
                    if B_GATHER:
                        pb, mb = row_ptrs(b_ptr, ib, r_ok, stride_bn, n_off, NN, BN)
                        tlx.async_load(pb, b_buf[s], mask=mb)
                    if GATHER:
                        tlx.async_load_commit_group()
                    if TMA_BYTES > 0:
                        tlx.barrier_expect_bytes(full[s], TMA_BYTES)
                        c0, c1, c2 = ragged_coords(lo, cnt, k_off)
                        if not A_GATHER:
                            tlx.async_descriptor_load(a_desc, a_buf[s], [c0, c1, c2, m_off], full[s])
                        if not B_GATHER:
                            tlx.async_descriptor_load(b_desc, b_buf[s], [c0, c1, c2, n_off], full[s])
                    if GATHER:
                        signal_gathered(it, k, LAG, NUM_STAGES, afull)
                    it += 1
                if GATHER:
                    drain_gathered(it, steps, LAG, NUM_STAGES, afull)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_fused_mm_blackwell_kernel)
_c_launch(_fused_wgrad_blackwell_kernel)
