"""TLX FP8 grouped GEMM for Hopper (sm_90): blockwise-scaled e4m3, persistent, warp-specialized.

Legend: N rows (expert-major), K reduction dim, NN output columns, E experts; BM = 128 output rows
split between two consumer warp groups (BMS = 64 each), BN output columns run as NSUB = BN / SUBN
slices, BK = 128 (one k-step = one scale group). Operands are e4m3 with one fp32 scale per
1 x 128 tile of A and per 128 x 128 block of B (tlx/common/fp8_quant.py, tlx_dist/fp8/quant.py).

Pipeline per CTA (grid = #SMs, persistent over tiles from tlx/common/scheduler.py):
  producer warp group ("default"): for each tile and k-step, wait ``empty[s]``, post the stage's
    bytes on ``full[s]``, TMA-load A (two BMS-row halves) and B (NSUB slices of SUBN rows, K-major:
    wgmma takes FP8 operands only K-major) into stage ``s`` of a NUM_STAGES ring.
  consumer warp groups x2 (240 registers each): per k-step and slice, one wgmma e4m3 x e4m3 of
    [BMS, 128] x [128, SUBN] into a zeroed fp32 partial, waited, then promoted on the CUDA cores:
    ``acc_j += partial * scale_a[row] * scale_b[col]``, so the tensor core never accumulates more
    than 128 products (its FP8 accumulation keeps fewer bits than fp32) and the error does not
    grow with K. The slices share the partial's registers: BN / 2 accumulator registers a thread
    plus one or two partials of SUBN / 2 (ptxas overlaps a promotion with the next slice's wgmma
    when registers allow). Stage ``s`` is released (``empty[s]``, both groups) after the last
    slice's wgmma. Epilogue: fp32 -> out dtype into shared memory, TMA stores that overlap the next
    tile's main loop.
  Each slice's wgmma is waited before its promotion: issuing the next wgmma before waiting for the
    last makes ptxas serialize every wgmma of the kernel (C7514: it cannot tell which in-flight
    accumulator a ``wgmma.wait_group 1`` retires). The two groups issue independently (turns taken
    through named barriers were slower: docs/decisions.md).

Forms (constexpr WGRAD):
  mm (fwd, dX): A = q [N, K] (2-D descriptor) with scales ``sa [Kb, N]`` (``sa_ptr + k * stride_sa +
    row``); B = q [E, NN, K] (3-D descriptor; the forward's ``q_EFD`` or dX's ``q_EDF``) with
    scales ``sb [E, NNb, Kb]``, a scalar per k-step and slice; C = y through a ragged 4-D
    descriptor clipped at the expert's last row. K tails are zero-filled by TMA (the last group's
    scale covers only the valid values). Tiles of the padding pseudo-expert store zeros.
  wgrad: A = x's transposed tiles q [D, P] and B = dy's q [F, P] (tlx_dist.fp8.quantize_cols: the
    expert's rows start at column ``128 * tile_cum[e-1]``, zeros past its end) with scales
    ``sa [T, D]``, ``sb [T, F]`` per tile; k-step j of expert e reads tile ``tile_cum[e-1] + j``;
    C = dw [E, D, F]. Experts without rows store zeros.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx import c_launch as _c_launch
from tlx.common.scheduler import _k_steps, _num_tiles, _tile_any, ragged_coords
from triton.language.core import builtin
from triton.language.extra.tlx.mma_ops import require_nv_mma_shared_layout


@builtin
def _in_mma_layout(x, a, _semantic=None):
    """``x`` (a [64, N] fp32 register tile) in the accumulator layout wgmma with A operand ``a``
    produces, as ``tlx.async_dot`` requires its accumulator."""
    b = _semantic.builder
    a_handle = require_nv_mma_shared_layout(a, True, b)
    mma = b.make_nv_mma_encoding_attr(a_handle, x.handle, 3, 0, b.options.num_warps)
    return tl.tensor(b.create_release_layout(b.create_require_layout(x.handle, mma)), x.type)


@triton.jit
def _tile_base(tile_cum_ptr, e):
    first = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
    return tl.where(e > 0, first, 0)


@triton.jit
def _produce(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM,
             K_DIM, tiles_n, WGRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             SUBN: tl.constexpr, NUM_STAGES: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    NSUB: tl.constexpr = BN // SUBN
    STAGE_BYTES: tl.constexpr = (BM + BN) * BK  # one byte an element
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                   False, SEARCH_STEPS, GROUP_M)
    n_off = nt * BN
    tb = _tile_base(tile_cum_ptr, e)
    for k in range(0, _k_steps(e, cnt, E, K_DIM, BK, WGRAD)):
        s = it % NUM_STAGES
        tlx.barrier_wait(empty[s], ((it // NUM_STAGES) & 1) ^ 1)
        tlx.barrier_expect_bytes(full[s], STAGE_BYTES)
        if WGRAD:
            col = (tb + k) * BK
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [mt * BM, col], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [mt * BM + BMS, col], full[s])
            for j in tl.static_range(NSUB):
                tlx.async_descriptor_load(b_desc, b_buf[s * NSUB + j], [n_off + j * SUBN, col], full[s])
        else:
            row = lo + mt * BM
            k_off = k * BK
            tlx.async_descriptor_load(a_desc, a_buf[s * 2], [row, k_off], full[s])
            tlx.async_descriptor_load(a_desc, a_buf[s * 2 + 1], [row + BMS, k_off], full[s])
            for j in tl.static_range(NSUB):
                tlx.async_descriptor_load(b_desc, b_buf[s * NSUB + j], [e, n_off + j * SUBN, k_off], full[s])
        it += 1
    return it


@triton.jit
def _sub_step(acc, a, b_buf, idx, sa, sb_ptr, k, tk, sb_base, kb_n, n_sub, NN, WGRAD: tl.constexpr,
              BK: tl.constexpr, BMS: tl.constexpr, SUBN: tl.constexpr):
    """One k-step of one SUBN-column slice: wgmma into a zeroed partial, wait, promote."""
    if WGRAD:
        b = tlx.local_trans(b_buf[idx])
        cols = n_sub + tl.arange(0, SUBN)
        # dy's scales for this slice, in flight during the wgmma
        sb = tl.load(sb_ptr + tk * NN + cols, mask=cols < NN, other=0.0)
    else:
        b = tlx.local_trans(tlx.local_reshape(b_buf[idx], [SUBN, BK]))
        # (a slice past NN multiplies zero-filled B and is never stored: any in-range scale will do)
        sb = tl.load(sb_ptr + sb_base + (tl.minimum(n_sub, NN - 1) // 128) * kb_n + k)
    p = tlx.async_dot(a, b, tl.zeros((BMS, SUBN), dtype=tl.float32))
    p = tlx.async_dot_wait(0, p)
    if WGRAD:
        acc = _in_mma_layout(acc + p * sa[:, None] * sb[None, :], a)
    else:
        acc = _in_mma_layout(acc + p * (sa * sb)[:, None], a)
    return acc


@triton.jit
def _store_sub(c_desc, c_buf, idx, acc, e, lo, cnt, m_off, n_sub, WGRAD: tl.constexpr, BMS: tl.constexpr,
               SUBN: tl.constexpr):
    tlx.local_store(tlx.local_reshape(c_buf[idx], [BMS, SUBN]), acc.to(tlx.dtype_of(c_desc)))
    tlx.fence_async_shared()
    if WGRAD:
        tlx.async_descriptor_store(c_desc, c_buf[idx], [e, m_off, n_sub])
    else:
        c0, c1, c2 = ragged_coords(lo, cnt, m_off)
        tlx.async_descriptor_store(c_desc, c_buf[idx], [c0, c1, c2, n_sub])


@triton.jit
def _consume(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, sa_ptr, sb_ptr, stride_sa, tile_cum_ptr, offsets_ptr,
             E, N_ROWS, M_DIM, K_DIM, NN, tiles_n, CID: tl.constexpr, WGRAD: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, SUBN: tl.constexpr, NUM_STAGES: tl.constexpr,
             SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr):
    BMS: tl.constexpr = BM // 2
    NSUB: tl.constexpr = BN // SUBN
    e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD,
                                   False, SEARCH_STEPS, GROUP_M)
    n_steps = _k_steps(e, cnt, E, K_DIM, BK, WGRAD)
    n_off = nt * BN
    tb = _tile_base(tile_cum_ptr, e)
    # One fp32 accumulator per SUBN-column slice (those past NSUB are never touched and vanish).
    acc0 = tl.zeros((BMS, SUBN), dtype=tl.float32)
    acc1 = tl.zeros((BMS, SUBN), dtype=tl.float32)
    acc2 = tl.zeros((BMS, SUBN), dtype=tl.float32)
    acc3 = tl.zeros((BMS, SUBN), dtype=tl.float32)
    if WGRAD:
        rows = mt * BM + CID * BMS + tl.arange(0, BMS)  # features of x (rows of dw)
        row_ok = rows < M_DIM
        sb_base = 0
        kb_n = 0
    else:
        rows = lo + mt * BM + CID * BMS + tl.arange(0, BMS)  # rows of x / dy
        row_ok = rows < N_ROWS
        kb_n = tl.cdiv(K_DIM, BK)
        sb_base = e.to(tl.int64) * tl.cdiv(NN, 128) * kb_n
    for k in range(0, n_steps):
        s = it % NUM_STAGES
        tk = (tb + k).to(tl.int64)
        # A's scales first: the load is in flight while this group waits for the stage.
        if WGRAD:
            sa = tl.load(sa_ptr + tk * M_DIM + rows, mask=row_ok, other=0.0)
        else:
            sa = tl.load(sa_ptr + k * stride_sa + rows, mask=row_ok, other=0.0)
        tlx.barrier_wait(full[s], (it // NUM_STAGES) & 1)
        a = a_buf[s * 2 + CID]
        acc0 = _sub_step(acc0, a, b_buf, s * NSUB, sa, sb_ptr, k, tk, sb_base, kb_n, n_off, NN, WGRAD, BK, BMS, SUBN)
        if NSUB > 1:
            acc1 = _sub_step(acc1, a, b_buf, s * NSUB + 1, sa, sb_ptr, k, tk, sb_base, kb_n, n_off + SUBN, NN, WGRAD,
                             BK, BMS, SUBN)
        if NSUB > 2:
            acc2 = _sub_step(acc2, a, b_buf, s * NSUB + 2, sa, sb_ptr, k, tk, sb_base, kb_n, n_off + 2 * SUBN, NN,
                             WGRAD, BK, BMS, SUBN)
            acc3 = _sub_step(acc3, a, b_buf, s * NSUB + 3, sa, sb_ptr, k, tk, sb_base, kb_n, n_off + 3 * SUBN, NN,
                             WGRAD, BK, BMS, SUBN)
        tlx.barrier_arrive(empty[s])  # every wgmma reading stage s has completed
        it += 1

    # Epilogue: the previous tile's TMA stores must have read c_buf before we overwrite it.
    tlx.async_descriptor_store_wait(0)
    m_off = mt * BM + CID * BMS
    _store_sub(c_desc, c_buf, CID * NSUB, acc0, e, lo, cnt, m_off, n_off, WGRAD, BMS, SUBN)
    if NSUB > 1:
        _store_sub(c_desc, c_buf, CID * NSUB + 1, acc1, e, lo, cnt, m_off, n_off + SUBN, WGRAD, BMS, SUBN)
    if NSUB > 2:
        _store_sub(c_desc, c_buf, CID * NSUB + 2, acc2, e, lo, cnt, m_off, n_off + 2 * SUBN, WGRAD, BMS, SUBN)
        _store_sub(c_desc, c_buf, CID * NSUB + 3, acc3, e, lo, cnt, m_off, n_off + 3 * SUBN, WGRAD, BMS, SUBN)
    return it


@triton.jit
def _fp8_grouped_gemm_hopper_kernel(
    a_desc, b_desc, c_desc, sa_ptr, sb_ptr, offsets_ptr, tile_cum_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN, stride_sa,
    WGRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUBN: tl.constexpr,
    NUM_STAGES: tl.constexpr, NUM_SMS: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr,
):
    BMS: tl.constexpr = BM // 2
    NSUB: tl.constexpr = BN // SUBN
    tl.static_assert(NSUB == 1 or NSUB == 2 or NSUB == 4)
    dtype: tl.constexpr = tlx.dtype_of(a_desc)
    out_dtype: tl.constexpr = tlx.dtype_of(c_desc)
    a_buf = tlx.local_alloc((BMS, BK), dtype, NUM_STAGES * 2)
    if WGRAD:
        b_buf = tlx.local_alloc((SUBN, BK), dtype, NUM_STAGES * NSUB)
        c_buf = tlx.local_alloc((1, BMS, SUBN), out_dtype, 2 * NSUB)
    else:
        b_buf = tlx.local_alloc((1, SUBN, BK), dtype, NUM_STAGES * NSUB)
        c_buf = tlx.local_alloc((1, 1, BMS, SUBN), out_dtype, 2 * NSUB)
    full = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    empty = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                it = _produce(t, it, a_desc, b_desc, a_buf, b_buf, full, empty, tile_cum_ptr, offsets_ptr, E, N_ROWS,
                              M_DIM, K_DIM, tiles_n, WGRAD, BM, BN, BK, SUBN, NUM_STAGES, SEARCH_STEPS, GROUP_M)

        with tlx.async_task(num_warps=4, replicate=2, registers=240):  # consumers: wgmma + promotion + epilogue
            cid: tl.constexpr = tlx.async_task_replica_id()
            tiles_n = tl.cdiv(NN, BN)
            total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
            it = 0
            for t in range(tl.program_id(0), total, NUM_SMS):
                it = _consume(t, it, c_desc, a_buf, b_buf, c_buf, full, empty, sa_ptr, sb_ptr, stride_sa,
                              tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, K_DIM, NN, tiles_n, cid, WGRAD, BM, BN, BK,
                              SUBN, NUM_STAGES, SEARCH_STEPS, GROUP_M)
            tlx.async_descriptor_store_wait(0)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_fp8_grouped_gemm_hopper_kernel)
