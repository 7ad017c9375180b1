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
"""

import triton
import triton.language as tl

from tlx import c_launch as _c_launch

from tlx.common.fp8_quant import expert_tile, quantize_block, round_to, scale_from_amax, store_rows_cols


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
def _store_both(v, dst_ptr, rows, r_ok, cols, c_ok, in_expert, k, t, stride_dm, q_ptr, s_ptr, stride_qm, stride_sk,
                qc_ptr, sc_ptr, stride_qc, C, G: tl.constexpr, STORE: tl.constexpr, FMT: tl.constexpr,
                POW2: tl.constexpr, EMULATE: tl.constexpr):
    """Round fp32 ``v`` [G, G] (tile ``t`` x column group ``k``) once to dst's dtype, store it
    (STORE), and store both quantizations of the rounded value (``store_rows_cols``)."""
    vr, vf = _round_to(v, dst_ptr, EMULATE)
    ok = r_ok[:, None] & c_ok[None, :]
    if STORE:
        tl.store(dst_ptr + rows[:, None] * stride_dm + cols[None, :], vr, mask=ok)
    store_rows_cols(tl.where(ok, vf, 0.0), rows, r_ok, cols, c_ok, in_expert, k, t, q_ptr, s_ptr, stride_qm,
                    stride_sk, qc_ptr, sc_ptr, stride_qc, C, G, FMT, POW2, EMULATE)


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
def _swiglu_quant_tiles_kernel(h_ptr, a_ptr, q_ptr, s_ptr, qc_ptr, sc_ptr, offsets_ptr, tile_cum_ptr, E, M, F,
                               stride_hm, stride_am, stride_qm, stride_sk, stride_qc, G: tl.constexpr,
                               STORE: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr, EMULATE: tl.constexpr,
                               SEARCH_STEPS: tl.constexpr):
    """grid (T, Fb). ``a_ptr`` sets the rounding dtype (``h_ptr`` itself when not STORE)."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    rows, r_ok, in_expert = expert_tile(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    cols = kb * G + tl.arange(0, G)
    c_ok = cols < F
    ok = r_ok[:, None] & c_ok[None, :]
    src = h_ptr + rows[:, None] * stride_hm + cols[None, :]
    g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
    silu, _ = _silu_sigmoid(g)
    _store_both(silu * u, a_ptr, rows, r_ok, cols, c_ok, in_expert, kb, t, stride_am, q_ptr, s_ptr, stride_qm,
                stride_sk, qc_ptr, sc_ptr, stride_qc, F, G, STORE, FMT, POW2, EMULATE)


@triton.jit
def _swiglu_bwd_quant_tiles_kernel(h_ptr, da_ptr, dh_ptr, q_ptr, s_ptr, qc_ptr, sc_ptr, offsets_ptr, tile_cum_ptr, E,
                                   M, F, stride_hm, stride_dam, stride_dhm, stride_qm, stride_sk, stride_qc,
                                   G: tl.constexpr, PAIRED: tl.constexpr, STORE: tl.constexpr, FMT: tl.constexpr,
                                   POW2: tl.constexpr, EMULATE: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """grid (T, Fb) PAIRED, else (T, F2b). ``dh_ptr`` sets the rounding dtype (``h_ptr`` when not STORE)."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    rows, r_ok, in_expert = expert_tile(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    if PAIRED:
        j = kb * G + tl.arange(0, G)
        c_ok = j < F
        ok = r_ok[:, None] & c_ok[None, :]
        src = h_ptr + rows[:, None] * stride_hm + j[None, :]
        g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + rows[:, None] * stride_dam + j[None, :], mask=ok, other=0.0).to(tl.float32)
        dg, du = _swiglu_bwd_values(g, u, da)
        _store_both(dg, dh_ptr, rows, r_ok, j, c_ok, in_expert, kb, t, stride_dhm, q_ptr, s_ptr, stride_qm, stride_sk,
                    qc_ptr, sc_ptr, stride_qc, 2 * F, G, STORE, FMT, POW2, EMULATE)
        _store_both(du, dh_ptr, rows, r_ok, j + F, c_ok, in_expert, kb + F // G, t, stride_dhm, q_ptr, s_ptr,
                    stride_qm, stride_sk, qc_ptr, sc_ptr, stride_qc, 2 * F, G, STORE, FMT, POW2, EMULATE)
    else:
        c = kb * G + tl.arange(0, G)
        is_gate = c < F
        j = tl.where(is_gate, c, c - F)
        c_ok = c < 2 * F
        ok = r_ok[:, None] & c_ok[None, :]
        src = h_ptr + rows[:, None] * stride_hm + j[None, :]
        g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + F, mask=ok & is_gate[None, :], other=0.0).to(tl.float32)
        da = tl.load(da_ptr + rows[:, None] * stride_dam + j[None, :], mask=ok, other=0.0).to(tl.float32)
        dg, du = _swiglu_bwd_values(g, u, da)
        _store_both(tl.where(is_gate[None, :], dg, du), dh_ptr, rows, r_ok, c, c_ok, in_expert, kb, t, stride_dhm,
                    q_ptr, s_ptr, stride_qm, stride_sk, qc_ptr, sc_ptr, stride_qc, 2 * F, G, STORE, FMT, POW2, EMULATE)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_swiglu_quant_kernel)
_c_launch(_swiglu_bwd_quant_kernel)
_c_launch(_swiglu_quant_tiles_kernel)
_c_launch(_swiglu_bwd_quant_tiles_kernel)
