"""TLX grouped GEMM for Hopper (sm_90): persistent, warp-specialized, one kernel for fwd / dX / dW.

Legend: N rows (expert-major), K reduction dim, NN output columns, E experts, BM x BN output tile
split row-wise between two consumer warp groups (BMS = BM / 2 rows each), BK reduction step.

Pipeline per CTA (grid = #SMs, persistent over tiles from tlx/common/scheduler.py):
  producer warp group ("default", few registers): for each tile and k-step, wait ``empty[s]``, post
    the expected bytes on ``full[s]``, TMA-load A (two BMS-row halves) and B into stage ``s`` of a
    NUM_STAGES ring in shared memory.
  consumer warp groups x2 (232 registers each): wait ``full[s]``, async wgmma on their A half and the
    shared B, keep one wgmma in flight, release stage ``s`` (``empty[s]`` counts both groups), then
    the epilogue: fp32 -> bf16 into a shared-memory tile and one TMA store, which overlaps the next
    tile's main loop (``async_descriptor_store_wait`` before the buffer is reused).

Forms (constexpr WGRAD, B_KMAJOR):
  mm (fwd, dX): A = x [N, K] (2-D descriptor; rows past the expert are read but never stored),
    B = w as a 3-D descriptor over [E, K, NN] (or [E, NN, K] when K-contiguous, i.e. dX's
    ``w.transpose(1, 2)``), so K tails stop at the expert; C = y through a ragged 4-D descriptor
    clipped at the expert's last row. Tiles of the padding pseudo-expert store zeros.
  wgrad: A = x^T and B = dy through ragged 4-D descriptors whose K (row) range stops at the expert's
    last row (TMA zero-fills), C = dw as 3-D [E, D, F]. Experts without rows store zeros.

Tile raster (constexpr GROUP_M): within a form's tile grid, GROUP_M rows of tiles are walked column by
column (tlx/common/scheduler.py ``group_raster``) so the tiles in flight share operands in L2; wgrad
with DYNAMIC only (the static wgrad walk stays row-major). GROUP_M == 1 is row-major.

Tile order (constexpr DYNAMIC, used for wgrad): static round-robin ``t = pid, pid + NUM_SMS, ...``
when off. When on, tiles go longest expert first (``order_ptr``, see tlx/common/scheduler.py) and
the producer claims each next tile from the atomic counter ``sched_ptr[0]`` (zeroed by the host
before the launch; the first tile of each CTA is its program id) once it has issued the current
tile's loads. It hands the tile id to both consumer groups through a two-slot shared-memory ring
(``tid_full`` / ``tid_empty``); a tile id ``>= total`` ends every role's loop.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.scheduler import _k_steps, _num_tiles, _tile_any, ragged_coords


@triton.jit
def _produce_tile(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr, order_ptr,
                  E, N_ROWS, M_DIM, K_DIM, tiles_n,
                  WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr, DYNAMIC: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                  GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    STAGE_BYTES: tl.constexpr = (BM * BK + BK * BN) * 2
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                   DYNAMIC, SEARCH_STEPS, GROUP_M)
    n_off = nt * BN
    for k in range(0, _k_steps(e, cnt, E, K_DIM, BK, WGRAD)):
        s = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        tlx.barrier_wait(empty[s], phase ^ 1)
        tlx.barrier_expect_bytes(full[s], STAGE_BYTES)
        k_off = k * BK
        if WGRAD:
            c0, c1, c2 = ragged_coords(lo, cnt, k_off)
            m_off = mt * BM
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [c0, c1, c2, m_off], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [c0, c1, c2, m_off + BMS], full[s])
            tlx.async_descriptor_load(b_desc, b_buf[s], [c0, c1, c2, n_off], full[s])
        else:
            row = lo + mt * BM
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [row, k_off], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [row + BMS, k_off], full[s])
            if B_KMAJOR:
                tlx.async_descriptor_load(b_desc, b_buf[s], [e, n_off, k_off], full[s])
            else:
                tlx.async_descriptor_load(b_desc, b_buf[s], [e, k_off, n_off], full[s])
        it += 1
    return it


@triton.jit
def _consume_tile(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, tile_cum_ptr, offsets_ptr, order_ptr,
                  E, N_ROWS, M_DIM, K_DIM, tiles_n, CID: tl.constexpr,
                  WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr, DYNAMIC: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                  GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    dtype: tl.constexpr = tlx.dtype_of(c_desc)
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                   DYNAMIC, SEARCH_STEPS, GROUP_M)
    n_steps = _k_steps(e, cnt, E, K_DIM, BK, WGRAD)
    acc = tl.zeros((BMS, BN), dtype=tl.float32)
    prev = 0
    for k in range(0, n_steps):
        s = it % NUM_STAGES
        tlx.barrier_wait(full[s], (it // NUM_STAGES) & 1)
        if WGRAD:
            a = tlx.local_trans(tlx.local_reshape(a_buf[s * 2 + CID], [BK, BMS]))
            b = tlx.local_reshape(b_buf[s], [BK, BN])
        else:
            a = a_buf[s * 2 + CID]
            if B_KMAJOR:
                b = tlx.local_trans(tlx.local_reshape(b_buf[s], [BN, BK]))
            else:
                b = tlx.local_reshape(b_buf[s], [BK, BN])
        acc = tlx.async_dot(a, b, acc)
        # Keep one wgmma in flight; the one before it is done, so its stage is free.
        acc = tlx.async_dot_wait(1, acc)
        if k > 0:
            tlx.barrier_arrive(empty[prev])
        prev = s
        it += 1
    acc = tlx.async_dot_wait(0, acc)
    if n_steps > 0:
        tlx.barrier_arrive(empty[prev])

    # Epilogue: the previous tile's TMA store must have read c_buf before we overwrite it.
    tlx.async_descriptor_store_wait(0)
    tlx.local_store(tlx.local_reshape(c_buf[CID], [BMS, BN]), acc.to(dtype))
    tlx.fence_async_shared()
    m_off = mt * BM + CID * BMS
    if WGRAD:
        tlx.async_descriptor_store(c_desc, c_buf[CID], [e, m_off, nt * BN])
    else:
        c0, c1, c2 = ragged_coords(lo, cnt, m_off)
        tlx.async_descriptor_store(c_desc, c_buf[CID], [c0, c1, c2, nt * BN])
    return it


@triton.jit
def _grouped_gemm_hopper_kernel(
    a_desc, b_desc, c_desc, offsets_ptr, tile_cum_ptr, order_ptr, sched_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN,
    WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr, DYNAMIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
    NUM_SMS: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr,
):
    BMS: tl.constexpr = BM // 2
    dtype: tl.constexpr = tlx.dtype_of(a_desc)
    # Shared-memory ring: A halves [stage * 2 + consumer], B [stage]; one epilogue tile per consumer.
    if WGRAD:
        a_buf = tlx.local_alloc((1, 1, BK, BMS), dtype, NUM_STAGES * 2)
        b_buf = tlx.local_alloc((1, 1, BK, BN), dtype, NUM_STAGES)
        c_buf = tlx.local_alloc((1, BMS, BN), dtype, 2)
    else:
        a_buf = tlx.local_alloc((BMS, BK), dtype, NUM_STAGES * 2)
        if B_KMAJOR:
            b_buf = tlx.local_alloc((1, BN, BK), dtype, NUM_STAGES)
        else:
            b_buf = tlx.local_alloc((1, BK, BN), dtype, NUM_STAGES)
        c_buf = tlx.local_alloc((1, 1, BMS, BN), dtype, 2)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=2)
    if DYNAMIC:
        tile_ids = tlx.local_alloc((1,), tl.int32, 2)
        tid_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
        tid_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads (and, if DYNAMIC, the tile claims)
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            if DYNAMIC:
                t = tl.program_id(0)
                n = 0
                while t < total:
                    slot = n % 2
                    tlx.barrier_wait(tid_empty[slot], ((n // 2) & 1) ^ 1)
                    tlx.local_store(tile_ids[slot], tl.full((1,), t, tl.int32))
                    tlx.barrier_arrive(tid_full[slot])
                    it = _produce_tile(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr,
                                       order_ptr, E, N_ROWS, M_DIM, K_DIM, tiles_n, WGRAD, B_KMAJOR, DYNAMIC, BM, BN,
                                       BK, NUM_STAGES, SEARCH_STEPS, GROUP_M)
                    # Relaxed: the counter only hands out ids; no data is published through it.
                    t = tl.atomic_add(sched_ptr, 1, sem="relaxed") + NUM_SMS
                    n += 1
                slot = n % 2  # the end marker
                tlx.barrier_wait(tid_empty[slot], ((n // 2) & 1) ^ 1)
                tlx.local_store(tile_ids[slot], tl.full((1,), total, tl.int32))
                tlx.barrier_arrive(tid_full[slot])
            else:
                for t in range(tl.program_id(0), total, NUM_SMS):
                    it = _produce_tile(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr,
                                       order_ptr, E, N_ROWS, M_DIM, K_DIM, tiles_n, WGRAD, B_KMAJOR, DYNAMIC, BM, BN,
                                       BK, NUM_STAGES, SEARCH_STEPS, GROUP_M)

        with tlx.async_task(num_warps=4, replicate=2, registers=232):  # consumers: wgmma + epilogue
            cid: tl.constexpr = tlx.async_task_replica_id()
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            if DYNAMIC:
                n = 0
                tlx.barrier_wait(tid_full[0], 0)
                t = tl.sum(tlx.local_load(tile_ids[0]), axis=0)
                tlx.barrier_arrive(tid_empty[0])
                while t < total:
                    it = _consume_tile(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, tile_cum_ptr, offsets_ptr,
                                       order_ptr, E, N_ROWS, M_DIM, K_DIM, tiles_n, cid, WGRAD, B_KMAJOR, DYNAMIC, BM,
                                       BN, BK, NUM_STAGES, SEARCH_STEPS, GROUP_M)
                    n += 1
                    slot = n % 2
                    tlx.barrier_wait(tid_full[slot], (n // 2) & 1)
                    t = tl.sum(tlx.local_load(tile_ids[slot]), axis=0)
                    tlx.barrier_arrive(tid_empty[slot])
            else:
                for t in range(tl.program_id(0), total, NUM_SMS):
                    it = _consume_tile(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, tile_cum_ptr, offsets_ptr,
                                       order_ptr, E, N_ROWS, M_DIM, K_DIM, tiles_n, cid, WGRAD, B_KMAJOR, DYNAMIC, BM,
                                       BN, BK, NUM_STAGES, SEARCH_STEPS, GROUP_M)
            tlx.async_descriptor_store_wait(0)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_grouped_gemm_hopper_kernel)
