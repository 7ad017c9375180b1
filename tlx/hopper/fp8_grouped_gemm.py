"""TLX FP8 grouped GEMM for Hopper (sm_90): blockwise-scaled e4m3, persistent, warp-specialized.

Legend: N rows (expert-major), K reduction dim, NN output columns, E experts; BM = 128 output rows
split between two consumer warp groups (BMS = 64 each), BN = NH * 128 output columns in NH halves,
BK = 128 (one k-step = one scale group). Operands are e4m3 with one fp32 scale per 1 x 128 tile of
A and per 128 x 128 block of B (tlx/common/fp8_quant.py, tlx_dist/fp8/quant.py).

Pipeline per CTA (grid = #SMs, persistent over tiles from tlx/common/scheduler.py):
  producer warp group ("default"): for each tile and k-step, wait ``empty[s]``, post the stage's
    bytes on ``full[s]``, TMA-load A (two BMS-row halves) and B (NH 128-column halves, K-major:
    wgmma takes FP8 operands only K-major) into stage ``s`` of a NUM_STAGES ring.
  consumer warp groups x2 (232 registers each): per k-step and half, one wgmma e4m3 x e4m3 of
    [BMS, 128] x [128, 128] into a zeroed fp32 partial, waited, then promoted on the CUDA cores:
    ``acc_h += partial * scale_a[row] * scale_b[col]``, so the tensor core never accumulates more
    than 128 products (its FP8 accumulator keeps fewer bits than fp32) and the error does not grow
    with K. The two halves share one partial: two 64-row accumulators of 128 columns + one
    partial = 192 fp32 registers a thread (a [64, 256] partial would not fit). While one group
    promotes, the other's wgmma runs. Stage ``s`` is released (``empty[s]``, both groups) after
    the last half's wgmma. Epilogue: fp32 -> out dtype into shared memory, TMA stores that overlap
    the next tile's main loop.

Forms (constexpr WGRAD):
  mm (fwd, dX): A = q [N, K] (2-D descriptor) with scales ``sa [Kb, N]`` (``sa_ptr + k * stride_sa +
    row``); B = q [E, NN, K] (3-D descriptor; the forward's ``q_EFD`` or dX's ``q_EDF``) with
    scales ``sb [E, NNb, Kb]``, one per k-step and half; C = y through a ragged 4-D descriptor
    clipped at the expert's last row. K tails are zero-filled by TMA (and the last group's scale
    covers only the valid values). Tiles of the padding pseudo-expert store zeros.
  wgrad: A = x's transposed tiles q [D, P] and B = dy's q [F, P] (tlx_dist.fp8.quantize_cols: the
    expert's rows start at column ``128 * tile_cum[e-1]``, zero past its end) with scales
    ``sa [T, D]``, ``sb [T, F]`` per tile; k-step j of expert e reads tile ``tile_cum[e-1] + j``;
    C = dw [E, D, F]. Experts without rows store zeros.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.scheduler import _k_steps, _num_tiles, _tile_any, ragged_coords

# The fp32 accumulator layout of wgmma m64n128 over one warp group (lane % 4 -> column pairs,
# lane / 4 -> rows, warp -> 16-row slabs; registers: column +1, row +8, 16 column blocks of 8),
# as a [64, 128] row-major thread-value layout. The promoted accumulators are pinned to it so the
# partial products are added where wgmma left them (no shared-memory layout conversion).
_ACC = tl.constexpr(tlx.layout(shape=((4, 8, 4), (2, 2, 16)), stride=((2, 128, 2048), (1, 1024, 8))))


@triton.jit
def _tile_base(tile_cum_ptr, e):
    first = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
    return tl.where(e > 0, first, 0)


@triton.jit
def _produce(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM,
             K_DIM, tiles_n, WGRAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr,
             NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    STAGE_BYTES: tl.constexpr = (BM + NH * 128) * BK  # one byte an element
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                   False, SEARCH_STEPS, GROUP_M)
    n_off = nt * (NH * 128)
    tb = _tile_base(tile_cum_ptr, e)
    for k in range(0, _k_steps(e, cnt, E, K_DIM, BK, WGRAD)):
        s = it % NUM_STAGES
        tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
        tlx.barrier_expect_bytes(full[s], STAGE_BYTES)
        if WGRAD:
            col = (tb + k) * BK
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [mt * BM, col], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [mt * BM + BMS, col], full[s])
            for h in tl.static_range(NH):
                tlx.async_descriptor_load(b_desc, b_buf[s * NH + h], [n_off + h * 128, col], full[s])
        else:
            row = lo + mt * BM
            k_off = k * BK
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [row, k_off], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [row + BMS, k_off], full[s])
            for h in tl.static_range(NH):
                tlx.async_descriptor_load(b_desc, b_buf[s * NH + h], [e, n_off + h * 128, k_off], full[s])
        it += 1
    return it


@triton.jit
def _mma_half(a, b_buf, idx, WGRAD: tl.constexpr, BK: tl.constexpr, BMS: tl.constexpr):
    if WGRAD:
        b = tlx.local_trans(b_buf[idx])
    else:
        b = tlx.local_trans(tlx.local_reshape(b_buf[idx], [128, BK]))
    p = tlx.async_dot(a, b, tl.zeros((BMS, 128), dtype=tl.float32))
    return tlx.async_dot_wait(0, p)


@triton.jit
def _consume(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, sa_ptr, sb_ptr, stride_sa, tile_cum_ptr, offsets_ptr,
             E, N_ROWS, M_DIM, K_DIM, NN, tiles_n, CID: tl.constexpr, WGRAD: tl.constexpr, BM: tl.constexpr,
             BK: tl.constexpr, NH: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr,
             GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    dtype: tl.constexpr = tlx.dtype_of(c_desc)
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                   False, SEARCH_STEPS, GROUP_M)
    n_steps = _k_steps(e, cnt, E, K_DIM, BK, WGRAD)
    n_off = nt * (NH * 128)
    tb = _tile_base(tile_cum_ptr, e)
    cols = tl.arange(0, 128)
    acc0 = tl.zeros((BMS, 128), dtype=tl.float32)
    acc1 = tl.zeros((BMS, 128), dtype=tl.float32)
    if WGRAD:
        rows = mt * BM + CID * BMS + tl.arange(0, BMS)  # features of x (rows of dw)
        row_ok = rows < M_DIM
    else:
        rows = lo + mt * BM + CID * BMS + tl.arange(0, BMS)  # rows of x / dy
        row_ok = rows < N_ROWS
        kb_n = tl.cdiv(K_DIM, BK)
        sb_row = (e.to(tl.int64) * tl.cdiv(NN, 128) + nt * NH) * kb_n
    for k in range(0, n_steps):
        s = it % NUM_STAGES
        # Scales first: their loads are in flight while this group waits for the stage.
        if WGRAD:
            tk = (tb + k).to(tl.int64)
            sa = tl.load(sa_ptr + tk * M_DIM + rows, mask=row_ok, other=0.0)
            sb0 = tl.load(sb_ptr + tk * NN + n_off + cols, mask=n_off + cols < NN, other=0.0)
            if NH == 2:
                sb1 = tl.load(sb_ptr + tk * NN + n_off + 128 + cols, mask=n_off + 128 + cols < NN, other=0.0)
        else:
            sa = tl.load(sa_ptr + k * stride_sa + rows, mask=row_ok, other=0.0)
            sb0 = tl.load(sb_ptr + sb_row + k)
            if NH == 2:
                sb1 = tl.load(sb_ptr + sb_row + kb_n + k, mask=n_off + 128 < NN, other=0.0)
        tlx.barrier_wait(full[s], (it // NUM_STAGES) & 1)
        a = a_buf[s * 2 + CID]
        p = _mma_half(a, b_buf, s * NH, WGRAD, BK, BMS)
        if NH == 1:
            tlx.barrier_arrive(empty[s])
        if WGRAD:
            acc0 += p * sa[:, None] * sb0[None, :]
        else:
            acc0 += p * (sa * sb0)[:, None]
        if NH == 2:
            p = _mma_half(a, b_buf, s * NH + 1, WGRAD, BK, BMS)
            tlx.barrier_arrive(empty[s])
            if WGRAD:
                acc1 += p * sa[:, None] * sb1[None, :]
            else:
                acc1 += p * (sa * sb1)[:, None]
        it += 1

    # Epilogue: the previous tile's TMA stores must have read c_buf before we overwrite it.
    tlx.async_descriptor_store_wait(0)
    m_off = mt * BM + CID * BMS
    if WGRAD:
        tlx.local_store(tlx.local_reshape(c_buf[CID * NH], [BMS, 128]), acc0.to(dtype))
        if NH == 2:
            tlx.local_store(tlx.local_reshape(c_buf[CID * NH + 1], [BMS, 128]), acc1.to(dtype))
        tlx.fence_async_shared()
        tlx.async_descriptor_store(c_desc, c_buf[CID * NH], [e, m_off, n_off])
        if NH == 2:
            tlx.async_descriptor_store(c_desc, c_buf[CID * NH + 1], [e, m_off, n_off + 128])
    else:
        tlx.local_store(tlx.local_reshape(c_buf[CID * NH], [BMS, 128]), acc0.to(dtype))
        if NH == 2:
            tlx.local_store(tlx.local_reshape(c_buf[CID * NH + 1], [BMS, 128]), acc1.to(dtype))
        tlx.fence_async_shared()
        c0, c1, c2 = ragged_coords(lo, cnt, m_off)
        tlx.async_descriptor_store(c_desc, c_buf[CID * NH], [c0, c1, c2, n_off])
        if NH == 2:
            tlx.async_descriptor_store(c_desc, c_buf[CID * NH + 1], [c0, c1, c2, n_off + 128])
    return it


@triton.jit
def _fp8_grouped_gemm_hopper_kernel(
    a_desc, b_desc, c_desc, sa_ptr, sb_ptr, offsets_ptr, tile_cum_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN, stride_sa,
    WGRAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NH: tl.constexpr, NUM_STAGES: tl.constexpr,
    NUM_SMS: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr,
):
    BMS: tl.constexpr = BM // 2
    dtype: tl.constexpr = tlx.dtype_of(a_desc)
    out_dtype: tl.constexpr = tlx.dtype_of(c_desc)
    a_buf = tlx.local_alloc((BMS, BK), dtype, NUM_STAGES * 2)
    if WGRAD:
        b_buf = tlx.local_alloc((128, BK), dtype, NUM_STAGES * NH)
        c_buf = tlx.local_alloc((1, BMS, 128), out_dtype, 2 * NH)
    else:
        b_buf = tlx.local_alloc((1, 128, BK), dtype, NUM_STAGES * NH)
        c_buf = tlx.local_alloc((1, 1, BMS, 128), out_dtype, 2 * NH)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads
            tiles_n = tl.cdiv(NN, NH * 128)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                it = _produce(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr, E, N_ROWS,
                              M_DIM, K_DIM, tiles_n, WGRAD, BM, BK, NH, NUM_STAGES, SEARCH_STEPS, GROUP_M)

        with tlx.async_task(num_warps=4, replicate=2, registers=232):  # consumers: wgmma + promotion + epilogue
            cid: tl.constexpr = tlx.async_task_replica_id()
            tiles_n = tl.cdiv(NN, NH * 128)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                it = _consume(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, sa_ptr, sb_ptr, stride_sa,
                              tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, K_DIM, NN, tiles_n, cid, WGRAD, BM, BK,
                              NH, NUM_STAGES, SEARCH_STEPS, GROUP_M)
            tlx.async_descriptor_store_wait(0)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_fp8_grouped_gemm_hopper_kernel)
