"""SwiGLU fused with its FP8 row quantization (plain Triton): the down GEMM's A operand in the
forward, the gate/up GEMM's dX operand in the backward, each in one pass over ``h``.

Legend: M rows (expert-major; padding rows included, as quantize_rows quantizes them), F the
expert intermediate dim, ``h`` ``[M, 2F]`` the gate/up GEMM's output (gate | up halves), ``a``
``[M, F] = silu(gate) * up``, ``dA`` ``[M, F]`` its gradient, ``dh`` ``[M, 2F]`` (d gate | d up),
G the group (128), Fb = cdiv(F, G), F2b = cdiv(2F, G).

The SwiGLU is computed in fp32 and rounded once to the output's dtype; the quantization then reads
that *rounded* value, so ``q, s`` are exactly ``_quant_rows_kernel`` of the stored tensor
(tlx/common/fp8_quant.py: same scale rule, same encoding, same EMULATE switch for the interpreter,
under which the fp32 -> bf16 rounding is done in integer arithmetic too). With
``silu(g) = g / (1 + exp(-g))`` and ``sigmoid(g) = 1 / (1 + exp(-g))`` (IEEE divisions):

    a      = silu(g) * up
    d up   = dA * silu(g)
    d gate = (dA * up) * sigmoid(g) * (1 + g * (1 - sigmoid(g)))

(torch's evaluation order, tlx_dist/fp8/swiglu.py's references).

Kernels (FP8 bit patterns stored through a uint8 view):
  ``_swiglu_quant_kernel``     h [M, 2F] -> a [M, F], q [M, F], s [Fb, M] (M-contiguous, as the
                               row quantizer's). grid (cdiv(M, BLOCK_M), Fb).
  ``_swiglu_bwd_quant_kernel`` h [M, 2F], dA [M, F] -> dh [M, 2F], q [M, 2F], s [F2b, M].
                               PAIRED (F % G == 0): program (i, j) reads the gate, up and dA tiles
                               j once and writes dh's tiles j (d gate) and Fb + j (d up); grid
                               (cdiv(M, BLOCK_M), Fb). Otherwise a 1 x G tile of dh may straddle
                               the halves: program (i, k) computes dh's tile k column by column
                               from the matching gate/up/dA columns; grid (cdiv(M, BLOCK_M), F2b).
  ``_swiglu_quant_tiles_kernel``, ``_swiglu_bwd_quant_tiles_kernel``: the same values quantized
                               both ways (the row form and the weight gradient's expert-tile column
                               form) over the expert-aligned tile grid, each tile in chunks of
                               BLOCK_R rows, twice, as tlx/common/fp8_quant.py's ``_quant_both_kernel``
                               (the second pass recomputes the SwiGLU from h read again, from L2).
"""

import triton
import triton.language as tl

from tlx.common.fp8_quant import (expert_tile_span, quantize_block, round_to, scale_from_amax, store_cols_part,
                                  store_rows)


@triton.jit
def _silu_sigmoid(g):
    """(silu(g), sigmoid(g)) of fp32 ``g``: ``g / (1 + exp(-g))`` and ``1 / (1 + exp(-g))``, IEEE
    divisions (torch's formulas; exp(-g) = inf for g < -88 gives -0 and 0, not NaN)."""
    one = tl.full(g.shape, 1.0, tl.float32)
    e1 = one + tl.exp(-g)
    return tl.math.div_rn(g, e1), tl.math.div_rn(one, e1)


@triton.jit
def _round_to(v, dst_ptr, EMULATE: tl.constexpr):
    """(``v`` fp32 rounded once to dst's dtype, that value back in fp32)."""
    return round_to(v, dst_ptr.dtype.element_ty, EMULATE)


@triton.jit
def _store_quantized(v, dst_ptr, q_ptr, s_ptr, r64, rows, cols, ok, rm, k, stride_dm, stride_qm, stride_sk,
                     FMT: tl.constexpr, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """Round fp32 ``v`` [BLOCK_M, G] once to dst's dtype, store it, and store the quantization of
    the rounded value (q tile and its per-row scales in group ``k``)."""
    vr, vf = _round_to(v, dst_ptr, EMULATE)
    tl.store(dst_ptr + r64[:, None] * stride_dm + cols[None, :], vr, mask=ok)
    x = tl.where(ok, vf, 0.0)
    s, inv = scale_from_amax(tl.max(tl.abs(x), axis=1), FMT, POW2)
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], quantize_block(x, inv[:, None], FMT, EMULATE), mask=ok)
    tl.store(s_ptr + k.to(tl.int64) * stride_sk + rows, s, mask=rm)


@triton.jit
def _swiglu_bwd_values(g, u, da):
    """(d gate, d up) in fp32 from the fp32 gate, up and dA."""
    silu, sig = _silu_sigmoid(g)
    return da * u * sig * (1.0 + g * (1.0 - sig)), da * silu


@triton.jit
def _swiglu_quant_kernel(h_ptr, a_ptr, q_ptr, s_ptr, M, F, stride_hm, stride_am, stride_qm, stride_sk,
                         G: tl.constexpr, BLOCK_M: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                         EMULATE: tl.constexpr):
    pm = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * G + tl.arange(0, G)
    rm = rows < M
    ok = rm[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)
    src = h_ptr + r64[:, None] * stride_hm + cols[None, :]
    g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
    silu, _ = _silu_sigmoid(g)
    a = silu * u
    _store_quantized(a, a_ptr, q_ptr, s_ptr, r64, rows, cols, ok, rm, kb, stride_am, stride_qm, stride_sk, FMT, POW2,
                     EMULATE)


@triton.jit
def _swiglu_bwd_quant_kernel(h_ptr, da_ptr, dh_ptr, q_ptr, s_ptr, M, F, stride_hm, stride_dam, stride_dhm,
                             stride_qm, stride_sk, G: tl.constexpr, BLOCK_M: tl.constexpr, PAIRED: tl.constexpr,
                             FMT: tl.constexpr, POW2: tl.constexpr, EMULATE: tl.constexpr):
    pm = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    r64 = rows.to(tl.int64)
    if PAIRED:
        j = kb * G + tl.arange(0, G)
        ok = rm[:, None] & (j < F)[None, :]
        src = h_ptr + r64[:, None] * stride_hm + j[None, :]
        g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + r64[:, None] * stride_dam + j[None, :], mask=ok, other=0.0).to(tl.float32)
        dg, du = _swiglu_bwd_values(g, u, da)
        _store_quantized(dg, dh_ptr, q_ptr, s_ptr, r64, rows, j, ok, rm, kb, stride_dhm, stride_qm, stride_sk, FMT,
                         POW2, EMULATE)
        _store_quantized(du, dh_ptr, q_ptr, s_ptr, r64, rows, j + F, ok, rm, kb + F // G, stride_dhm, stride_qm,
                         stride_sk, FMT, POW2, EMULATE)
    else:
        c = kb * G + tl.arange(0, G)
        is_gate = c < F
        j = tl.where(is_gate, c, c - F)
        ok = rm[:, None] & (c < 2 * F)[None, :]
        src = h_ptr + r64[:, None] * stride_hm + j[None, :]
        g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + F, mask=ok & is_gate[None, :], other=0.0).to(tl.float32)
        da = tl.load(da_ptr + r64[:, None] * stride_dam + j[None, :], mask=ok, other=0.0).to(tl.float32)
        dg, du = _swiglu_bwd_values(g, u, da)
        v = tl.where(is_gate[None, :], dg, du)
        _store_quantized(v, dh_ptr, q_ptr, s_ptr, r64, rows, c, ok, rm, kb, stride_dhm, stride_qm, stride_sk, FMT,
                         POW2, EMULATE)


@triton.jit
def _swiglu_rows(h_ptr, rows, r_ok, cols, c_ok, F, stride_hm, a_ptr, EMULATE: tl.constexpr):
    """(a rounded to a's dtype, its fp32 value, zero outside the mask) of rows ``rows`` x the
    columns ``cols`` of ``a = silu(gate) * up``."""
    ok = r_ok[:, None] & c_ok[None, :]
    src = h_ptr + rows[:, None] * stride_hm + cols[None, :]
    g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
    silu, _ = _silu_sigmoid(g)
    ar, af = _round_to(silu * u, a_ptr, EMULATE)
    return ar, tl.where(ok, af, 0.0)


@triton.jit
def _swiglu_bwd_rows(h_ptr, da_ptr, rows, r_ok, j, c_ok, F, stride_hm, stride_dam, dh_ptr, PAIRED: tl.constexpr,
                     EMULATE: tl.constexpr):
    """PAIRED: (d gate, d up) of rows ``rows`` x the gate columns ``j`` (and ``j + F``), each as
    (rounded to dh's dtype, its fp32 value zero outside the mask); else dh's columns ``j`` of
    [0, 2F) (a tile that may straddle the halves) as the first pair, the second unused."""
    ok = r_ok[:, None] & c_ok[None, :]
    if PAIRED:
        jj = j
        is_gate = c_ok
    else:
        is_gate = j < F
        jj = tl.where(is_gate, j, j - F)
    src = h_ptr + rows[:, None] * stride_hm + jj[None, :]
    g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=ok & is_gate[None, :], other=0.0).to(tl.float32)
    da = tl.load(da_ptr + rows[:, None] * stride_dam + jj[None, :], mask=ok, other=0.0).to(tl.float32)
    dg, du = _swiglu_bwd_values(g, u, da)
    if not PAIRED:
        dg = tl.where(is_gate[None, :], dg, du)
    gr, gf = _round_to(dg, dh_ptr, EMULATE)
    ur, uf = _round_to(du, dh_ptr, EMULATE)
    return gr, tl.where(ok, gf, 0.0), ur, tl.where(ok, uf, 0.0)


@triton.jit
def _swiglu_quant_tiles_kernel(h_ptr, a_ptr, q_ptr, s_ptr, qc_ptr, sc_ptr, offsets_ptr, tile_cum_ptr, E, M, F,
                               stride_hm, stride_am, stride_qm, stride_sk, stride_qc, G: tl.constexpr,
                               BLOCK_R: tl.constexpr, STORE: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                               EMULATE: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """grid (T, Fb): one expert-aligned tile x one group of a's columns, in chunks of BLOCK_R rows
    (BLOCK_R divides G), two passes as ``_quant_both_kernel``: each chunk's a (stored when STORE),
    its row form and the columns' amax; then (expert tiles only) the column form from a recomputed
    (h read again, from L2). ``a_ptr`` sets the rounding dtype (``h_ptr`` itself when not STORE)."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    base, n, in_expert = expert_tile_span(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    cols = kb * G + tl.arange(0, G)
    c_ok = cols < F
    amax = tl.zeros([G], tl.float32)
    for r0 in range(0, G, BLOCK_R):
        i = r0 + tl.arange(0, BLOCK_R)
        rows, r_ok = base + i, i < n
        ar, af = _swiglu_rows(h_ptr, rows, r_ok, cols, c_ok, F, stride_hm, a_ptr, EMULATE)
        if STORE:
            tl.store(a_ptr + rows[:, None] * stride_am + cols[None, :], ar, mask=r_ok[:, None] & c_ok[None, :])
        store_rows(af, rows, r_ok, cols, c_ok, kb, q_ptr, s_ptr, stride_qm, stride_sk, FMT, POW2, EMULATE)
        amax = tl.maximum(amax, tl.max(tl.abs(af), axis=0))
    if in_expert:
        sc, invc = scale_from_amax(amax, FMT, POW2)
        for r0 in range(0, G, BLOCK_R):
            i = r0 + tl.arange(0, BLOCK_R)
            _, af = _swiglu_rows(h_ptr, base + i, i < n, cols, c_ok, F, stride_hm, a_ptr, EMULATE)
            store_cols_part(af, invc, t.to(tl.int64) * G + r0, cols, c_ok, qc_ptr, stride_qc, BLOCK_R, FMT, EMULATE)
        tl.store(sc_ptr + t.to(tl.int64) * F + cols, sc, mask=c_ok)


@triton.jit
def _swiglu_bwd_quant_tiles_kernel(h_ptr, da_ptr, dh_ptr, q_ptr, s_ptr, qc_ptr, sc_ptr, offsets_ptr, tile_cum_ptr, E,
                                   M, F, stride_hm, stride_dam, stride_dhm, stride_qm, stride_sk, stride_qc,
                                   G: tl.constexpr, BLOCK_R: tl.constexpr, PAIRED: tl.constexpr, STORE: tl.constexpr,
                                   FMT: tl.constexpr, POW2: tl.constexpr, EMULATE: tl.constexpr,
                                   SEARCH_STEPS: tl.constexpr):
    """grid (T, Fb) PAIRED (program (t, j) writes dh's groups j and Fb + j), else (T, F2b); chunks
    of BLOCK_R rows in two passes as ``_swiglu_quant_tiles_kernel``. ``dh_ptr`` sets the rounding
    dtype (``h_ptr`` when not STORE)."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    base, n, in_expert = expert_tile_span(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    j = kb * G + tl.arange(0, G)
    if PAIRED:
        c_ok = j < F
    else:
        c_ok = j < 2 * F
    amax_g = tl.zeros([G], tl.float32)
    amax_u = tl.zeros([G], tl.float32)
    for r0 in range(0, G, BLOCK_R):
        i = r0 + tl.arange(0, BLOCK_R)
        rows, r_ok = base + i, i < n
        gr, gf, ur, uf = _swiglu_bwd_rows(h_ptr, da_ptr, rows, r_ok, j, c_ok, F, stride_hm, stride_dam, dh_ptr,
                                          PAIRED, EMULATE)
        ok = r_ok[:, None] & c_ok[None, :]
        if STORE:
            tl.store(dh_ptr + rows[:, None] * stride_dhm + j[None, :], gr, mask=ok)
        store_rows(gf, rows, r_ok, j, c_ok, kb, q_ptr, s_ptr, stride_qm, stride_sk, FMT, POW2, EMULATE)
        amax_g = tl.maximum(amax_g, tl.max(tl.abs(gf), axis=0))
        if PAIRED:
            if STORE:
                tl.store(dh_ptr + rows[:, None] * stride_dhm + (j + F)[None, :], ur, mask=ok)
            store_rows(uf, rows, r_ok, j + F, c_ok, kb + F // G, q_ptr, s_ptr, stride_qm, stride_sk, FMT, POW2,
                       EMULATE)
            amax_u = tl.maximum(amax_u, tl.max(tl.abs(uf), axis=0))
    if in_expert:
        sg, invg = scale_from_amax(amax_g, FMT, POW2)
        su, invu = scale_from_amax(amax_u, FMT, POW2)
        for r0 in range(0, G, BLOCK_R):
            i = r0 + tl.arange(0, BLOCK_R)
            _, gf, _, uf = _swiglu_bwd_rows(h_ptr, da_ptr, base + i, i < n, j, c_ok, F, stride_hm, stride_dam, dh_ptr,
                                            PAIRED, EMULATE)
            pos = t.to(tl.int64) * G + r0
            store_cols_part(gf, invg, pos, j, c_ok, qc_ptr, stride_qc, BLOCK_R, FMT, EMULATE)
            if PAIRED:
                store_cols_part(uf, invu, pos, j + F, c_ok, qc_ptr, stride_qc, BLOCK_R, FMT, EMULATE)
        tl.store(sc_ptr + t.to(tl.int64) * 2 * F + j, sg, mask=c_ok)
        if PAIRED:
            tl.store(sc_ptr + t.to(tl.int64) * 2 * F + j + F, su, mask=c_ok)
