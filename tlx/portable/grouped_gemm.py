"""Portable grouped GEMM in stock Triton: forward / dX (ragged M) and weight gradient (ragged K).

Legend: N rows (expert-major), K reduction dim, NN output columns, E experts; ``offsets_E`` cumulative
end row per expert (int32, device). Pipeline: ``_grouped_tile_prep_kernel`` (tlx/common/scheduler.py)
writes ``tile_cum_E1``; ``_grouped_mm_kernel`` launches one program per possible tile (an upper
bound computed from shapes on the host), looks its tile up on the device and exits if past the
end; pointer loads with masks handle every tail, any stride and the transposed weight of dX.
Padding rows (the pseudo-expert E) get zeros. ``_grouped_wgrad_kernel`` runs one program per
(expert, D-tile, F-tile) and loops over the expert's rows; experts without rows store zeros.
"""

import triton
import triton.language as tl

from tlx.common.scheduler import mm_num_tiles, mm_tile, wgrad_tile


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr, NO_DOT: tl.constexpr):
    # NO_DOT: broadcast-multiply-sum instead of tl.dot, for TRITON_INTERPRET=1 (fbtriton 3.7.4's
    # interpreter cannot run tl.dot: InterpreterBuilder.create_dot has a stale signature).
    if NO_DOT:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _to_out(acc, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):
    # The interpreter's fp32 -> bf16 cast truncates; round to nearest even by hand there so the
    # CPU tests see the rounding the GPU does (cvt.rn).
    if INTERPRETED and out_ty == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(out_ty)


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr, tile_cum_ptr,
    N_ROWS, E, K, NN,
    stride_xn, stride_xk, stride_we, stride_wk, stride_wn, stride_yn, stride_yf,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, IEEE: tl.constexpr, NO_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    tiles_n = tl.cdiv(NN, BN)
    if t < mm_num_tiles(tile_cum_ptr, E, tiles_n):
        e, lo, cnt, mt, nt = mm_tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS)
        rows = mt * BM + tl.arange(0, BM)
        cols = nt * BN + tl.arange(0, BN)
        row_ok = rows < cnt
        col_ok = cols < NN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if e < E:
            ks = tl.arange(0, BK)
            x_rows = x_ptr + (lo + rows).to(tl.int64)[:, None] * stride_xn
            w_e = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn
            for k0 in range(0, K, BK):
                k_ok = (k0 + ks) < K
                a = tl.load(x_rows + (k0 + ks)[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_e + (k0 + ks)[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = _dot_acc(a, b, acc, IEEE, NO_DOT)
        y_ptrs = y_ptr + (lo + rows).to(tl.int64)[:, None] * stride_yn + cols[None, :] * stride_yf
        tl.store(y_ptrs, _to_out(acc, y_ptr.dtype.element_ty, NO_DOT), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr,
    N_ROWS, E, D, F,
    stride_xn, stride_xd, stride_dyn, stride_dyf, stride_we, stride_wd, stride_wf,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, NO_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    e, lo, cnt, mt, nt = wgrad_tile(t, offsets_ptr, E, N_ROWS, tl.cdiv(D, BM), tl.cdiv(F, BN))
    offs_d = mt * BM + tl.arange(0, BM)
    offs_f = nt * BN + tl.arange(0, BN)
    d_ok = offs_d < D
    f_ok = offs_f < F
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, cnt, BK):
        r_ok = (k0 + ks) < cnt
        rows = (lo + k0 + ks).to(tl.int64)
        # x^T tile: [BM, BK] gathered from the row-major x (D runs along BM).
        a = tl.load(x_ptr + rows[None, :] * stride_xn + offs_d[:, None] * stride_xd,
                    mask=d_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * stride_dyn + offs_f[None, :] * stride_dyf,
                    mask=r_ok[:, None] & f_ok[None, :], other=0.0)
        acc = _dot_acc(a, b, acc, IEEE, NO_DOT)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + offs_d[:, None] * stride_wd + offs_f[None, :] * stride_wf
    tl.store(dw_ptrs, _to_out(acc, dw_ptr.dtype.element_ty, NO_DOT), mask=d_ok[:, None] & f_ok[None, :])
