"""TLX MXFP8 grouped GEMM for Blackwell (sm_100): block-scaled tcgen05 MMA, persistent, warp-specialized.

Legend as in tlx/hopper/fp8_grouped_gemm.py (N rows, K reduction, NN output columns, E experts;
BM = 128 x BN tile, BK = 128 k-step). MXFP8: e4m3 operands with one e8m0 scale (a power of two,
the exponent byte) per 1 x 32 values along K, applied by the tensor core itself
(``tcgen05.mma ... .block_scale``), so the fp32 TMEM accumulator needs no promotion on the CUDA
cores. The scales of one 128-row block and one k-step are 128 x 4 bytes in cuBLAS's block-scaling
order (byte ``(r % 32) * 16 + (r // 32) * 4 + j`` for row r, 32-group j: 512 contiguous bytes),
TMA-loaded through 5-D descriptors whose two last dims are [2, 256]. Scale layouts (uint8;
tlx_dist/fp8/mx.py builds them and their references):
  mm (fwd, dX):  sa [T, Kb, 512] by global m-tile (``tile_cum[e-1] + mt``: the tiles start at each
                 expert's first row, as the scheduler's tiles do), sb [E, NNb, Kb, 512].
  wgrad:         A = x's transposed tiles q [D, P] and B = dy's q [F, P] (quantize_cols' layout),
                 sa [Db, T, 512], sb [Fb, T, 512] (k-step j of expert e = token tile tile_cum[e-1] + j).
Pipeline: producer warp (TMA: A, B and both scale blocks into a NUM_STAGES ring), MMA warp (one
``async_dot_scaled`` per k-step into one of two TMEM accumulators, releasing the stage through its
mbarrier), epilogue warp group (TMEM -> registers -> out dtype -> shared memory -> TMA store, clipped
at the expert's end; overlaps the next tile's MMAs). Tiles without k-steps store zeros.
Compile-checked for sm_100 on the CPU (tests/test_fp8_compile.py); not yet run on a B200.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.scheduler import _k_steps, _num_tiles, _tile, ragged_coords


@triton.jit
def _first_tile(tile_cum_ptr, e):
    first = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
    return tl.where(e > 0, first, 0)


@triton.jit
def _mxfp8_grouped_gemm_blackwell_kernel(
    a_desc, b_desc, c_desc, sa_desc, sb_desc, offsets_ptr, tile_cum_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN,
    WGRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
    NUM_SMS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    BNS: tl.constexpr = BN if BN < 128 else 128
    REP_N: tl.constexpr = BN // 128
    dtype: tl.constexpr = tlx.dtype_of(a_desc)
    out_dtype: tl.constexpr = tlx.dtype_of(c_desc)
    a_buf = tlx.local_alloc((BM, BK), dtype, NUM_STAGES)
    if WGRAD:
        b_buf = tlx.local_alloc((BN, BK), dtype, NUM_STAGES)
        c_buf = tlx.local_alloc((1, BM, BNS), out_dtype, 2)
    else:
        b_buf = tlx.local_alloc((1, BN, BK), dtype, NUM_STAGES)
        c_buf = tlx.local_alloc((1, 1, BM, BNS), out_dtype, 2)
    sa_buf = tlx.local_alloc((1, 1, 1, 2, 256), tl.uint8, NUM_STAGES)
    sb_buf = tlx.local_alloc((1, REP_N, 1, 2, 256), tl.uint8, NUM_STAGES)
    acc_tm = tlx.local_alloc((BM, BN), tl.float32, 2, tlx.storage_kind.tmem)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    acc_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    acc_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    STAGE_BYTES: tl.constexpr = (BM + BN) * BK + (1 + REP_N) * 512

    with tlx.async_tasks():
        with tlx.async_task("default"):  # epilogue
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            tc = 0
            sc = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                e, lo, cnt, mt, nt = _tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                           SEARCH_STEPS)
                has_k = _k_steps(e, cnt, E, K_DIM, BK, WGRAD) > 0
                b = tc % 2
                if has_k:
                    tlx.barrier_wait(acc_full[b], (tc // 2) & 1)
                m_off = mt * BM
                for j in tl.static_range(BN // BNS):
                    if has_k:
                        vals = tlx.local_load(tlx.local_slice(acc_tm[b], [0, j * BNS], [BM, BNS]))
                    else:
                        vals = tl.zeros((BM, BNS), dtype=tl.float32)
                    eb = sc % 2
                    tlx.async_descriptor_store_wait(1)
                    tlx.local_store(tlx.local_reshape(c_buf[eb], [BM, BNS]), vals.to(out_dtype))
                    tlx.fence_async_shared()
                    n_off = nt * BN + j * BNS
                    if WGRAD:
                        tlx.async_descriptor_store(c_desc, c_buf[eb], [e, m_off, n_off])
                    else:
                        c0, c1, c2 = ragged_coords(lo, cnt, m_off)
                        tlx.async_descriptor_store(c_desc, c_buf[eb], [c0, c1, c2, n_off])
                    sc += 1
                if has_k:
                    tlx.barrier_arrive(acc_empty[b], 1)
                    tc += 1
            tlx.async_descriptor_store_wait(0)

        with tlx.async_task(num_warps=1, num_regs=48):  # MMA issuer
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            tc = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                e, lo, cnt, mt, nt = _tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                           SEARCH_STEPS)
                n_steps = _k_steps(e, cnt, E, K_DIM, BK, WGRAD)
                if n_steps > 0:
                    b = tc % 2
                    tlx.barrier_wait(acc_empty[b], ((tc // 2) & 1) ^ 1)
                    for k in range(0, n_steps):
                        s = it % NUM_STAGES
                        tlx.barrier_wait(full[s], (it // NUM_STAGES) & 1)
                        if WGRAD:
                            bb = tlx.local_trans(b_buf[s])
                        else:
                            bb = tlx.local_trans(tlx.local_reshape(b_buf[s], [BN, BK]))
                        tlx.async_dot_scaled(a_buf[s], bb, acc_tm[b], sa_buf[s], "e4m3", sb_buf[s], "e4m3",
                                             use_acc=k > 0, mBarriers=[empty[s]])
                        it += 1
                    tlx.tcgen05_commit(acc_full[b])
                    tc += 1

        with tlx.async_task(num_warps=1, num_regs=48):  # TMA producer
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                e, lo, cnt, mt, nt = _tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                           SEARCH_STEPS)
                n_off = nt * BN
                tb = _first_tile(tile_cum_ptr, e)
                for k in range(0, _k_steps(e, cnt, E, K_DIM, BK, WGRAD)):
                    s = it % NUM_STAGES
                    tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
                    tlx.barrier_expect_bytes(full[s], STAGE_BYTES)
                    if WGRAD:
                        col = (tb + k) * BK
                        tlx.async_descriptor_load(a_desc, a_buf[s], [mt * BM, col], full[s])
                        tlx.async_descriptor_load(b_desc, b_buf[s], [n_off, col], full[s])
                        tlx.async_descriptor_load(sa_desc, sa_buf[s], [0, mt, tb + k, 0, 0], full[s])
                        tlx.async_descriptor_load(sb_desc, sb_buf[s], [0, nt * REP_N, tb + k, 0, 0], full[s])
                    else:
                        tlx.async_descriptor_load(a_desc, a_buf[s], [lo + mt * BM, k * BK], full[s])
                        tlx.async_descriptor_load(b_desc, b_buf[s], [e, n_off, k * BK], full[s])
                        tlx.async_descriptor_load(sa_desc, sa_buf[s], [0, tb + mt, k, 0, 0], full[s])
                        tlx.async_descriptor_load(sb_desc, sb_buf[s], [e, nt * REP_N, k, 0, 0], full[s])
                    it += 1


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_mxfp8_grouped_gemm_blackwell_kernel)
