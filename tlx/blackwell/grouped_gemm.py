"""TLX grouped GEMM for Blackwell (sm_100): persistent, warp-specialized, tcgen05 MMA into TMEM.

Legend as in tlx/hopper/grouped_gemm.py (N rows, K reduction, NN output columns, E experts; BM x BN
tile, BK step). Same tile scheduler (tlx/common/scheduler.py) and the same descriptors; only the
engine differs:
  producer (1 warp): TMA loads of A [BM, BK] and B into a NUM_STAGES ring (``full`` / ``empty``).
  MMA (1 warp): tcgen05.mma from shared memory into one of two TMEM accumulators; each MMA
    releases its stage through ``empty[s]``; ``tcgen05_commit`` signals ``acc_full[b]``.
  epilogue (default warp group): TMEM -> registers in column slices of BNS <= 128, bf16 into one of
    two shared-memory tiles, TMA store (clipped at the expert's end by the ragged descriptor);
    ``acc_empty[b]`` hands the accumulator back so the next tile's MMAs overlap this epilogue.
Tiles without k-steps (padding pseudo-expert, experts without rows in dW) skip the MMA warp and the
TMEM buffers entirely; the epilogue stores zeros for them.
Compile-checked for sm_100 on the CPU (tests/test_tlx_compile.py); not yet run on a B200.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.scheduler import _k_steps, _num_tiles, _tile, ragged_coords


@triton.jit
def _grouped_gemm_blackwell_kernel(
    a_desc, b_desc, c_desc, offsets_ptr, tile_cum_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN,
    WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
    NUM_SMS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    BNS: tl.constexpr = BN if BN < 128 else 128
    dtype: tl.constexpr = tlx.dtype_of(a_desc)
    if WGRAD:
        a_buf = tlx.local_alloc((1, 1, BK, BM), dtype, NUM_STAGES)
        b_buf = tlx.local_alloc((1, 1, BK, BN), dtype, NUM_STAGES)
        c_buf = tlx.local_alloc((1, BM, BNS), dtype, 2)
    else:
        a_buf = tlx.local_alloc((BM, BK), dtype, NUM_STAGES)
        if B_KMAJOR:
            b_buf = tlx.local_alloc((1, BN, BK), dtype, NUM_STAGES)
        else:
            b_buf = tlx.local_alloc((1, BK, BN), dtype, NUM_STAGES)
        c_buf = tlx.local_alloc((1, 1, BM, BNS), dtype, 2)
    acc_tm = tlx.local_alloc((BM, BN), tl.float32, 2, tlx.storage_kind.tmem)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    acc_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    acc_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    STAGE_BYTES: tl.constexpr = (BM * BK + BK * BN) * 2

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
                    tlx.local_store(tlx.local_reshape(c_buf[eb], [BM, BNS]), vals.to(dtype))
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
                            a = tlx.local_trans(tlx.local_reshape(a_buf[s], [BK, BM]))
                            bb = tlx.local_reshape(b_buf[s], [BK, BN])
                        else:
                            a = a_buf[s]
                            if B_KMAJOR:
                                bb = tlx.local_trans(tlx.local_reshape(b_buf[s], [BN, BK]))
                            else:
                                bb = tlx.local_reshape(b_buf[s], [BK, BN])
                        tlx.async_dot(a, bb, acc_tm[b], use_acc=k > 0, mBarriers=[empty[s]], out_dtype=tl.float32)
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
                for k in range(0, _k_steps(e, cnt, E, K_DIM, BK, WGRAD)):
                    s = it % NUM_STAGES
                    tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
                    tlx.barrier_expect_bytes(full[s], STAGE_BYTES)
                    k_off = k * BK
                    if WGRAD:
                        c0, c1, c2 = ragged_coords(lo, cnt, k_off)
                        tlx.async_descriptor_load(a_desc, a_buf[s], [c0, c1, c2, mt * BM], full[s])
                        tlx.async_descriptor_load(b_desc, b_buf[s], [c0, c1, c2, n_off], full[s])
                    else:
                        tlx.async_descriptor_load(a_desc, a_buf[s], [lo + mt * BM, k_off], full[s])
                        if B_KMAJOR:
                            tlx.async_descriptor_load(b_desc, b_buf[s], [e, n_off, k_off], full[s])
                        else:
                            tlx.async_descriptor_load(b_desc, b_buf[s], [e, k_off, n_off], full[s])
                    it += 1


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_grouped_gemm_blackwell_kernel)
