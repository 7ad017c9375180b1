"""Portable (stock Triton) fused MoE expert GEMMs: gather-on-load prologue, SwiGLU / gate-scatter /
dSwiGLU epilogues, and a varlen-K weight gradient whose operands are read through row indices.

Legend: R source rows (``x_TD`` on one rank, a receive buffer under EP), N expert-major rows,
T_out destination rows, D hidden, F expert intermediate, E experts, ``offsets_E`` cumulative end
row per expert (int32, device). ``src_N[n]`` is the source row of row n; ``dst_N[n]`` its
destination row. Rows at or past ``offsets_E[E-1]`` are padding (the scheduler's pseudo-expert E).

``_fused_mm_kernel`` (ragged M; one program per possible tile, as tlx/portable/grouped_gemm.py):
  EPILOGUE == SWIGLU  : A = x[src] (A_GATHER) @ w13[e] [D, 2F]; the tile's F-columns c get two
                        accumulators (gate columns c, up columns F + c) and store
                        h[n, c], h[n, F + c] (rounded) and a[n, c] = silu(hg) * hu; padding rows store 0.
  EPILOGUE == SCATTER : A = a (or dh) rows n; out_f32[dst[n], :] += scale[n] * acc (fp32 atomics;
                        HAS_SCALE false = scale 1); padding rows add nothing.
  EPILOGUE == DSWIGLU : A = dout[dst] (A_GATHER) @ w2[e]^T; with h and gate: stores dh [N, 2F],
                        ag = gate * a [N, F] and the gate-gradient partial dot for this F-tile in
                        part[n, f-tile] (summed on the host side: deterministic, no atomics).
``_fused_wgrad_kernel``: dw[e] = sum_{n of e} A[ia[n]]^T B[ib[n]] with ia/ib the identity unless
A_GATHER / B_GATHER; one program per (expert, D-tile, F-tile); empty experts store zeros.
VIRT > 1 (the EP overlap's phased launches, ``backends.compose_forward``): E counts VIRT runs of
rows per expert, each a virtual expert of the tile walk with expert e // VIRT's weights.
Epilogue math: tlx/common/moe_epilogues.py (shared with the Hopper kernels).
"""

import triton
import triton.language as tl

from tlx.common.moe_epilogues import swiglu_bwd, swiglu_fwd
from tlx.common.scheduler import mm_num_tiles, mm_tile, wgrad_tile
from tlx.portable.grouped_gemm import _dot_acc, _to_out

SWIGLU = tl.constexpr(1)
SCATTER = tl.constexpr(2)
DSWIGLU = tl.constexpr(3)


@triton.jit(do_not_specialize=["N_ROWS", "E", "stride_pn"])
def _fused_mm_kernel(
    a_ptr, src_ptr, w_ptr, offsets_ptr, tile_cum_ptr,
    c_ptr, c2_ptr, dst_ptr, scale_ptr, h_ptr, part_ptr,
    N_ROWS, E, K, NN, F_OFF,
    stride_an, stride_ak, stride_we, stride_wk, stride_wn, stride_cn, stride_c2n, stride_hn, stride_pn,
    EPILOGUE: tl.constexpr, A_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, IEEE: tl.constexpr, NO_DOT: tl.constexpr, VIRT: tl.constexpr = 1,
):
    t = tl.program_id(0)
    tiles_n = tl.cdiv(NN, BN)
    if t < mm_num_tiles(tile_cum_ptr, E, tiles_n):
        e, lo, cnt, mt, nt = mm_tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS)
        rows = mt * BM + tl.arange(0, BM)
        cols = nt * BN + tl.arange(0, BN)
        row_ok = rows < cnt
        col_ok = cols < NN
        n_idx = (lo + rows).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)  # SwiGLU: the up columns F_OFF + cols
        if e < E:
            if A_GATHER:
                a_row = tl.load(src_ptr + n_idx, mask=row_ok, other=0).to(tl.int64)
            else:
                a_row = n_idx
            ks = tl.arange(0, BK)
            a_rows = a_ptr + a_row[:, None] * stride_an
            w_e = w_ptr + (e // VIRT).to(tl.int64) * stride_we + cols[None, :] * stride_wn
            for k0 in range(0, K, BK):
                k_ok = (k0 + ks) < K
                a = tl.load(a_rows + (k0 + ks)[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b_ok = k_ok[:, None] & col_ok[None, :]
                b = tl.load(w_e + (k0 + ks)[:, None] * stride_wk, mask=b_ok, other=0.0)
                acc = _dot_acc(a, b, acc, IEEE, NO_DOT)
                if EPILOGUE == SWIGLU:
                    b_u = tl.load(w_e + (k0 + ks)[:, None] * stride_wk + F_OFF * stride_wn, mask=b_ok, other=0.0)
                    acc_u = _dot_acc(a, b_u, acc_u, IEEE, NO_DOT)
        ok = row_ok[:, None] & col_ok[None, :]
        out_ty: tl.constexpr = c_ptr.dtype.element_ty
        if EPILOGUE == SWIGLU:
            # Padding tiles (e == E) store the zeros they accumulated.
            hg = _to_out(acc, out_ty, NO_DOT)
            hu = _to_out(acc_u, out_ty, NO_DOT)
            h_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
            tl.store(h_ptrs, hg, mask=ok)
            tl.store(h_ptrs + F_OFF, hu, mask=ok)
            a_val = swiglu_fwd(hg.to(tl.float32), hu.to(tl.float32))
            tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], _to_out(a_val, out_ty, NO_DOT), mask=ok)
        elif EPILOGUE == SCATTER:
            if e < E:
                d_row = tl.load(dst_ptr + n_idx, mask=row_ok, other=0).to(tl.int64)
                val = acc
                if HAS_SCALE:
                    val = val * tl.load(scale_ptr + n_idx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
                tl.atomic_add(c_ptr + d_row[:, None] * stride_cn + cols[None, :], val, mask=ok, sem="relaxed")
        else:  # DSWIGLU: acc = g = dout[dst] @ w2^T on the tile's F-columns
            h_ptrs = h_ptr + n_idx[:, None] * stride_hn + cols[None, :]
            hg = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
            hu = tl.load(h_ptrs + F_OFF, mask=ok, other=0.0).to(tl.float32)
            gate = tl.load(scale_ptr + n_idx, mask=row_ok & (e < E), other=0.0).to(tl.float32)
            a_val, dhg, dhu = swiglu_bwd(hg, hu, acc, gate[:, None])
            tl.store(part_ptr + n_idx * stride_pn + nt, tl.sum(a_val * acc, axis=1), mask=row_ok)
            dh_ptrs = c_ptr + n_idx[:, None] * stride_cn + cols[None, :]
            tl.store(dh_ptrs, _to_out(dhg, out_ty, NO_DOT), mask=ok)
            tl.store(dh_ptrs + F_OFF, _to_out(dhu, out_ty, NO_DOT), mask=ok)
            ag = _to_out(a_val * gate[:, None], out_ty, NO_DOT)
            tl.store(c2_ptr + n_idx[:, None] * stride_c2n + cols[None, :], ag, mask=ok)


@triton.jit(do_not_specialize=["N_ROWS", "E"])
def _fused_wgrad_kernel(
    a_ptr, ia_ptr, b_ptr, ib_ptr, dw_ptr, offsets_ptr,
    N_ROWS, E, D, F,
    stride_an, stride_ad, stride_bn, stride_bf, stride_we, stride_wd, stride_wf,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr,
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
        if A_GATHER:
            a_rows = tl.load(ia_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        else:
            a_rows = rows
        if B_GATHER:
            b_rows = tl.load(ib_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        else:
            b_rows = rows
        a = tl.load(a_ptr + a_rows[None, :] * stride_an + offs_d[:, None] * stride_ad,
                    mask=d_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + b_rows[:, None] * stride_bn + offs_f[None, :] * stride_bf,
                    mask=r_ok[:, None] & f_ok[None, :], other=0.0)
        acc = _dot_acc(a, b, acc, IEEE, NO_DOT)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + offs_d[:, None] * stride_wd + offs_f[None, :] * stride_wf
    tl.store(dw_ptrs, _to_out(acc, dw_ptr.dtype.element_ty, NO_DOT), mask=d_ok[:, None] & f_ok[None, :])
