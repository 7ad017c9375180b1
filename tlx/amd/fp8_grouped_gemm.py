"""Blockwise-scaled FP8 grouped GEMM for AMD CDNA3 / CDNA4 (gfx942 e4m3fnuz, gfx950 e4m3fn).

Legend as in tlx/hopper/fp8_grouped_gemm.py (N rows, K reduction, NN output columns, E experts;
BM x BN tile, BK = 128 = the scale group). Same operands, scale layouts and forms (constexpr
WGRAD) as the Hopper kernel: mm (fwd, dX) A = q [N, K] with ``sa [Kb, N]``, B = q [E, NN, K] with
``sb [E, NNb, Kb]``, C = y [N, NN]; wgrad A = q [D, P], B = q [F, P] (quantize_cols' expert-tile
layout) with ``sa [T, D]``, ``sb [T, F]``, C = dw [E, D, F]. One program per tile of the shared
scheduler (tlx/common/scheduler.py; programs past the device tile count return). Per k-step: one
``tl.dot`` e4m3 x e4m3 -> fp32 of [BM, 128] x [128, BN] (MFMA fp8 on the CDNA targets), promoted
on the vector ALUs with the two blocks' scales, so the MFMA never accumulates more than 128
products. Loads are masked (rows past the expert or N, columns past NN, K past its end read as
zero bits = 0.0 in both formats); stores are masked; tiles without k-steps store zeros.

This is plain Triton (the compiler's LDS staging and MFMA lowering): the FP8 counterpart of the
warp-pipelined TLX kernel in tlx/amd/grouped_gemm.py is left to the change that can run one on
MI300. Compile-checked for gfx942 and gfx950 (tests/test_fp8_compile.py) and run on CPU under
TRITON_INTERPRET=1 with NO_DOT (a broadcast-sum for tl.dot, which the interpreter lacks;
tests/test_fp8_gemm_interpreted.py); never run on AMD hardware.
"""

import triton
import triton.language as tl

from tlx.common.scheduler import _k_steps, _num_tiles, _tile
from tlx.portable.grouped_gemm import _to_out


@triton.jit
def _as_fp8(bits, FNUZ: tl.constexpr):
    if FNUZ:
        v = bits.to(tl.float8e4b8, bitcast=True)
    else:
        v = bits.to(tl.float8e4nv, bitcast=True)
    return v


@triton.jit
def _fp8_grouped_mm_portable_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, offsets_ptr, tile_cum_ptr,
    N_ROWS, E, M_DIM, K_DIM, NN, P_COLS, stride_sa,
    WGRAD: tl.constexpr, FNUZ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, NO_DOT: tl.constexpr,
):
    """a_ptr / b_ptr: uint8 views of the e4m3 operands; c_ptr: the output (bf16 / fp16 / fp32)."""
    t = tl.program_id(0)
    tiles_n = tl.cdiv(NN, BN)
    if t < _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM, WGRAD):
        e, lo, cnt, mt, nt = _tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD, SEARCH_STEPS)
        first = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
        first = tl.where(e > 0, first, 0)
        i = tl.arange(0, BM)
        n = nt * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        n_ok = n < NN
        if WGRAD:
            rows = mt * BM + i  # features of x = rows of dw
            row_ok = rows < M_DIM
        else:
            rows = lo + mt * BM + i
            row_ok = (mt * BM + i) < cnt
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        kb_n = tl.cdiv(K_DIM, BK)
        for k in range(0, _k_steps(e, cnt, E, K_DIM, BK, WGRAD)):
            if WGRAD:
                col = (first + k).to(tl.int64) * BK + kk
                a_bits = tl.load(a_ptr + rows.to(tl.int64)[:, None] * P_COLS + col[None, :], mask=row_ok[:, None],
                                 other=0)
                b_bits = tl.load(b_ptr + n.to(tl.int64)[:, None] * P_COLS + col[None, :], mask=n_ok[:, None], other=0)
                tk = (first + k).to(tl.int64)
                sa = tl.load(sa_ptr + tk * M_DIM + rows, mask=row_ok, other=0.0)
                sb = tl.load(sb_ptr + tk * NN + n, mask=n_ok, other=0.0)
            else:
                col = k * BK + kk
                k_ok = col < K_DIM
                a_bits = tl.load(a_ptr + rows.to(tl.int64)[:, None] * K_DIM + col[None, :],
                                 mask=row_ok[:, None] & k_ok[None, :], other=0)
                b_bits = tl.load(b_ptr + (e.to(tl.int64) * NN + n)[:, None] * K_DIM + col[None, :],
                                 mask=n_ok[:, None] & k_ok[None, :], other=0)
                sa = tl.load(sa_ptr + k * stride_sa + rows, mask=row_ok, other=0.0)
                sb = tl.load(sb_ptr + (e.to(tl.int64) * tl.cdiv(NN, 128) + n // 128) * kb_n + k, mask=n_ok, other=0.0)
            a = _as_fp8(a_bits, FNUZ)
            b = tl.trans(_as_fp8(b_bits, FNUZ))  # [BK, BN]
            if NO_DOT:
                p = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            else:
                p = tl.dot(a, b, out_dtype=tl.float32)
            acc += p * sa[:, None] * sb[None, :]
        out = _to_out(acc, c_ptr.dtype.element_ty, NO_DOT)  # (NO_DOT runs interpreted: round bf16 by hand)
        if WGRAD:
            dst = c_ptr + (e.to(tl.int64) * M_DIM + rows)[:, None] * NN + n[None, :]
        else:
            dst = c_ptr + rows.to(tl.int64)[:, None] * NN + n[None, :]
        tl.store(dst, out, mask=row_ok[:, None] & n_ok[None, :])
