"""TLX grouped GEMM for AMD CDNA3/CDNA4 (gfx942: MI300X, gfx950: MI350): persistent, wave-group pipelined.

Legend: N rows (expert-major), K reduction dim, NN output columns, E experts, BM x BN output tile,
BK reduction step (one k-step), NB slots in the LDS ring.

One kernel runs the three forms (constexpr WGRAD, B_KMAJOR) through the tile scheduler the Hopper
kernel uses (tlx/common/scheduler.py: ``_tile_any`` / ``_num_tiles``):
  mm (fwd, dX): A = x [N, K] (the tile's rows of its expert), B = w[e] viewed [K, NN] (``B_KMAJOR``:
    the K-contiguous ``w.transpose(1, 2)`` of dX), C = y [N, NN]; tiles of the padding pseudo-expert
    store zeros.
  wgrad: A = x^T (features x the expert's rows), B = dy (the expert's rows), C = dw [E, D, F]; the
    K loop runs over the expert's rows, and experts without rows store zeros.

Pipeline per workgroup (grid = #CUs, persistent; ids remapped so that each of the XCDs walks a
contiguous range of tiles, whose operands then meet in that XCD's L2):
  8 waves form two wave groups (one wave per SIMD each). Each k-step has two stages, marked with
  ``tlx.warp_pipeline_stage``:
    "mfma" (consumer role): MFMA of k-step ``j`` (operands already in registers) into the fp32
           accumulator;
    "mem"  (producer role, issued at higher priority): k-step ``j + NB`` into the LDS slot that
           k-step ``j`` vacated, then k-step ``j + 1`` from LDS into registers.
  The compiler offsets the two wave groups by one stage with conditional barriers: one group feeds
  memory while the other runs MFMAs, and they swap roles at every stage boundary.
  gfx950 (DIRECT_LDS): global -> LDS without registers (direct-to-LDS loads, 16 bytes per lane),
  counted by async commit groups; each wave waits for its own copies before the stage barrier, so a
  slot is complete for every wave before any wave reads it. gfx942's direct-to-LDS loads move 4
  bytes per lane, so there the producer stages through registers (16-byte global loads, then LDS
  stores into a K-contiguous layout, so that the MFMA operand reads are vectorized).
Every load is masked: rows past the expert or past N, columns past NN, K past its end and k-steps
past the tile's count read as zeros. A tile therefore always runs at least NB k-steps (its ring
prologue and drain are static) and a short or empty expert just multiplies zeros. The host
guarantees that D, F and the row strides are multiples of 8 elements; the kernel restates that in a
form the compiler can prove, so each lane moves 16 contiguous bytes and each 8-wide mask group is
uniform.
Epilogue: fp32 -> output dtype, masked stores straight from the accumulator registers.

Tile order (constexpr DYNAMIC, used for wgrad): static ``t = v, v + P, ...`` (``v`` the remapped id,
P programs) when off; when on, tiles go longest expert first (``order_ptr``) and each workgroup
claims its next tile from the atomic counter ``sched_ptr[0]`` (zeroed by the host) as it starts the
current one, so the claim's latency hides behind the tile.

EMULATE (tests only, under TRITON_INTERPRET=1): the LDS ring lives in ``scratch_ptr`` (global memory,
``[P, NB * (BM*BK + BK*BN)]``) and the MMA is a broadcast-sum; the tile walk, the addressing, the
masks, the ring's slot arithmetic and the epilogue are the ones compiled for the GPU. Otherwise
``scratch_ptr`` is unused.
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from tlx.common.scheduler import _k_steps, _num_tiles, _tile_any
from tlx.portable.grouped_gemm import _dot_acc, _to_out

# LDS layouts for the register-staged path (gfx942): K fastest for both operands, the order the MFMA
# operand reads want (A [BM, BK]: dim 1; B [BK, BN]: dim 0), 8-element vectors, XOR-swizzled rows.
_LDS_A = tl.constexpr(tlx.swizzled_shared_layout_encoding(8, 1, 8, [1, 0], [1, 1], [1, 1], [1, 1], [1, 0]))
_LDS_B = tl.constexpr(tlx.swizzled_shared_layout_encoding(8, 1, 8, [0, 1], [1, 1], [1, 1], [1, 1], [1, 0]))


@triton.jit
def _xcd_remap(pid, P, NUM_XCDS: tl.constexpr):
    """Workgroup ``pid`` is dispatched to XCD ``pid % NUM_XCDS``: give each XCD a contiguous range of
    the ids ``[0, P)`` (a bijection; XCDs ``< P % NUM_XCDS`` get one id more)."""
    per = P // NUM_XCDS
    xcd = pid % NUM_XCDS
    return xcd * per + tl.minimum(xcd, P % NUM_XCDS) + pid // NUM_XCDS


@triton.jit
def _a_tile(a_ptr, j, lo, row_end, mt, M_DIM, k_lim, stride_a, WGRAD: tl.constexpr, BM: tl.constexpr,
            BK: tl.constexpr):
    """Pointers and mask of A [BM, BK] at k-step ``j``. mm: rows ``lo + mt*BM + i`` below ``row_end``,
    columns ``j*BK + kk`` below ``k_lim``. wgrad (x^T): features ``mt*BM + i`` below M_DIM, rows
    ``lo + j*BK + kk`` below ``row_end``."""
    i = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    if WGRAD:
        m = mt * BM + i
        rows = lo + j * BK + kk
        ptrs = a_ptr + rows.to(tl.int64)[None, :] * stride_a + m[:, None]
        mask = (m < M_DIM)[:, None] & (rows < row_end)[None, :]
    else:
        rows = lo + mt * BM + i
        k = j * BK + kk
        ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + k[None, :]
        mask = (rows < row_end)[:, None] & (k < k_lim)[None, :]
    return ptrs, mask


@triton.jit
def _b_tile(b_ptr, j, e, lo, row_end, nt, NN, k_lim, stride_be, stride_b, WGRAD: tl.constexpr,
            B_KMAJOR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Pointers and mask of B [BK, BN] at k-step ``j``. mm: w[e] rows ``j*BK + kk`` below ``k_lim``
    (K-contiguous when B_KMAJOR). wgrad: dy rows ``lo + j*BK + kk`` below ``row_end``."""
    n = nt * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    if WGRAD:
        rows = lo + j * BK + kk
        ptrs = b_ptr + rows.to(tl.int64)[:, None] * stride_b + n[None, :]
        mask = (rows < row_end)[:, None] & (n < NN)[None, :]
    else:
        k = j * BK + kk
        w_e = b_ptr + e.to(tl.int64) * stride_be
        if B_KMAJOR:
            ptrs = w_e + k[:, None] + n.to(tl.int64)[None, :] * stride_b
        else:
            ptrs = w_e + k.to(tl.int64)[:, None] * stride_b + n[None, :]
        mask = (k < k_lim)[:, None] & (n < NN)[None, :]
    return ptrs, mask


@triton.jit
def _lds_store(buf, slot, tile, ROWS: tl.constexpr, COLS: tl.constexpr, EMULATE: tl.constexpr):
    if EMULATE:
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tl.store(buf + slot * (ROWS * COLS) + offs, tile)
    else:
        tlx.local_store(buf[slot], tile)


@triton.jit
def _lds_load(buf, slot, ROWS: tl.constexpr, COLS: tl.constexpr, EMULATE: tl.constexpr):
    if EMULATE:
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tile = tl.load(buf + slot * (ROWS * COLS) + offs)
    else:
        tile = tlx.local_load(buf[slot])
    return tile


@triton.jit
def _put(a_buf, b_buf, slot, j, a_ptr, b_ptr, e, lo, row_end, mt, nt, M_DIM, NN, k_lim, stride_a, stride_be,
         stride_b, WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, DIRECT_LDS: tl.constexpr, EMULATE: tl.constexpr):
    """Producer: k-step ``j`` of A and B into ring slot ``slot`` (one async commit group if DIRECT_LDS)."""
    a_ptrs, a_mask = _a_tile(a_ptr, j, lo, row_end, mt, M_DIM, k_lim, stride_a, WGRAD, BM, BK)
    b_ptrs, b_mask = _b_tile(b_ptr, j, e, lo, row_end, nt, NN, k_lim, stride_be, stride_b, WGRAD, B_KMAJOR, BN, BK)
    if DIRECT_LDS:
        ta = tlx.async_load(a_ptrs, a_buf[slot], mask=a_mask, other=0.0)
        tb = tlx.async_load(b_ptrs, b_buf[slot], mask=b_mask, other=0.0)
        tlx.async_load_commit_group([ta, tb])
    else:
        _lds_store(a_buf, slot, tl.load(a_ptrs, mask=a_mask, other=0.0), BM, BK, EMULATE)
        _lds_store(b_buf, slot, tl.load(b_ptrs, mask=b_mask, other=0.0), BK, BN, EMULATE)


@triton.jit
def _landed(pending: tl.constexpr, DIRECT_LDS: tl.constexpr):
    # At most ``pending`` k-steps of this wave still in flight (register staging has none).
    if DIRECT_LDS:
        tlx.async_load_wait_group(pending)


@triton.jit
def _mma(a, b, acc, EMULATE: tl.constexpr):
    if EMULATE:
        acc = _dot_acc(a, b, acc, False, True)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile_acc(a_ptr, b_ptr, a_buf, b_buf, e, lo, cnt, mt, nt, E, N_ROWS, M_DIM, K_DIM, NN, stride_a, stride_be,
              stride_b, WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, NB: tl.constexpr, DIRECT_LDS: tl.constexpr, EMULATE: tl.constexpr):
    """The fp32 [BM, BN] accumulator of one tile, through the NB-slot ring."""
    row_end = tl.minimum(lo + cnt, N_ROWS)  # never past N, whatever the offsets say
    k_lim = tl.where(e < E, K_DIM, 0)  # mm: the padding pseudo-expert loads nothing
    steps = tl.maximum(_k_steps(e, cnt, E, K_DIM, BK, WGRAD), NB)
    e = tl.minimum(e, E - 1)

    for j in tl.static_range(NB):  # prologue: k-steps 0 .. NB-1 in flight
        _put(a_buf, b_buf, j, j, a_ptr, b_ptr, e, lo, row_end, mt, nt, M_DIM, NN, k_lim, stride_a, stride_be,
             stride_b, WGRAD, B_KMAJOR, BM, BN, BK, DIRECT_LDS, EMULATE)
    _landed(NB - 1, DIRECT_LDS)
    a = _lds_load(a_buf, 0, BM, BK, EMULATE)
    b = _lds_load(b_buf, 0, BK, BN, EMULATE)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in tl.range(0, steps - NB, num_stages=1):
        with tlx.warp_pipeline_stage("mfma", priority=0):
            acc = _mma(a, b, acc, EMULATE)
        _landed(NB - 2, DIRECT_LDS)  # k-step j + 1 is in its slot
        with tlx.warp_pipeline_stage("mem", priority=1):
            _put(a_buf, b_buf, j % NB, j + NB, a_ptr, b_ptr, e, lo, row_end, mt, nt, M_DIM, NN, k_lim, stride_a,
                 stride_be, stride_b, WGRAD, B_KMAJOR, BM, BN, BK, DIRECT_LDS, EMULATE)
            a = _lds_load(a_buf, (j + 1) % NB, BM, BK, EMULATE)
            b = _lds_load(b_buf, (j + 1) % NB, BK, BN, EMULATE)
    # drain: the last NB k-steps (the first of them is already in registers)
    acc = _mma(a, b, acc, EMULATE)
    _landed(0, DIRECT_LDS)
    for i in tl.static_range(1, NB):
        s = (steps - NB + i) % NB
        acc = _mma(_lds_load(a_buf, s, BM, BK, EMULATE), _lds_load(b_buf, s, BK, BN, EMULATE), acc, EMULATE)
    return acc


@triton.jit
def _store_tile(c_ptr, acc, e, lo, cnt, mt, nt, N_ROWS, M_DIM, NN, stride_ce, stride_c, WGRAD: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, EMULATE: tl.constexpr):
    n = nt * BN + tl.arange(0, BN)
    if WGRAD:
        m = mt * BM + tl.arange(0, BM)
        ptrs = c_ptr + e.to(tl.int64) * stride_ce + m.to(tl.int64)[:, None] * stride_c + n[None, :]
        mask = (m < M_DIM)[:, None] & (n < NN)[None, :]
    else:
        rows = lo + mt * BM + tl.arange(0, BM)
        ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c + n[None, :]
        mask = (rows < tl.minimum(lo + cnt, N_ROWS))[:, None] & (n < NN)[None, :]
    tl.store(ptrs, _to_out(acc, c_ptr.dtype.element_ty, EMULATE), mask=mask)


@triton.jit
def _grouped_gemm_amd_kernel(
    a_ptr, b_ptr, c_ptr, offsets_ptr, tile_cum_ptr, order_ptr, sched_ptr, scratch_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN,
    stride_a, stride_be, stride_b, stride_ce, stride_c,
    WGRAD: tl.constexpr, B_KMAJOR: tl.constexpr, DYNAMIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, NUM_XCDS: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr,
    DIRECT_LDS: tl.constexpr, EMULATE: tl.constexpr,
):
    # Multiples of 8 (host checks): ``// 8 * 8`` changes no value but lets the compiler prove it.
    # (M_DIM is N for mm and K_DIM unused by wgrad: those two are left alone.)
    if WGRAD:
        M_DIM = M_DIM // 8 * 8
    else:
        K_DIM = K_DIM // 8 * 8
    NN = NN // 8 * 8
    stride_a = stride_a // 8 * 8
    stride_be = stride_be // 8 * 8
    stride_b = stride_b // 8 * 8
    stride_ce = stride_ce // 8 * 8
    stride_c = stride_c // 8 * 8

    if EMULATE:
        a_buf = scratch_ptr + tl.program_id(0).to(tl.int64) * (NB * (BM * BK + BK * BN))
        b_buf = a_buf + NB * BM * BK
    elif DIRECT_LDS:  # layouts inferred from the direct-to-LDS copies and the MFMA operands
        a_buf = tlx.local_alloc((BM, BK), a_ptr.dtype.element_ty, NB)
        b_buf = tlx.local_alloc((BK, BN), a_ptr.dtype.element_ty, NB)
    else:
        a_buf = tlx.local_alloc((BM, BK), a_ptr.dtype.element_ty, NB, layout=_LDS_A)
        b_buf = tlx.local_alloc((BK, BN), a_ptr.dtype.element_ty, NB, layout=_LDS_B)

    tiles_n = tl.cdiv(NN, BN)
    total = _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD)
    t = _xcd_remap(tl.program_id(0), NUM_PROGRAMS, NUM_XCDS)
    while t < total:
        if DYNAMIC:
            # Relaxed: the counter only hands out tile ids; no data is published through it.
            nxt = tl.atomic_add(sched_ptr, 1, sem="relaxed") + NUM_PROGRAMS
        else:
            nxt = t + NUM_PROGRAMS
        e, lo, cnt, mt, nt = _tile_any(t, tile_cum_ptr, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, tiles_n, BM,
                                       WGRAD, DYNAMIC, SEARCH_STEPS, GROUP_M)
        acc = _tile_acc(a_ptr, b_ptr, a_buf, b_buf, e, lo, cnt, mt, nt, E, N_ROWS, M_DIM, K_DIM, NN, stride_a,
                        stride_be, stride_b, WGRAD, B_KMAJOR, BM, BN, BK, NB, DIRECT_LDS, EMULATE)
        _store_tile(c_ptr, acc, e, lo, cnt, mt, nt, N_ROWS, M_DIM, NN, stride_ce, stride_c, WGRAD, BM, BN, EMULATE)
        t = nxt
