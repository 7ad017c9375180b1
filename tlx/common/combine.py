"""Single-rank combine kernels (plain Triton): the gate-weighted k-sum of the expert outputs, its
backward, and the ungated k-sum that is a dispatch's backward, each one pass over the rows.

Legend: T tokens, K top-k, S = T*K slots (slot s = t*K + k), D hidden, N = S expert-major rows
(a permutation of the slots). ``order_S[n]`` is the slot of expert-major row n; ``inverse_S[s]``
the row of slot s. ``y_ND`` / ``g_ND`` bf16 or fp16 rows, ``gate_S`` the gates ``[T, K]`` read
flat (fp32, bf16 or fp16), ``g_TD`` the gradient of the combined rows (``y``'s dtype).

Semantics (the torch composition of tlx_dist/comm/dispatcher.py ``Dispatcher.combine_weighted``,
which is the reference):

    w[s]       = act(gate[s])                                  (the gate rounded to y's dtype)
    out[t]     = act( sum_k act(w[t*K+k] * y[inverse_S[t*K+k]]) )   k-sum in fp32, k = 0..K-1
    g_y[n]     = act(g[t] * w[s])                               s = order_S[n], t = s // K
    g_gate[s]  = gate_dtype( sum_d g[t, d] * y[n, d] )         fp32 products and sum, one rounding
    g_TD[t]    = act( sum_k g_ND[inverse_S[t*K+k]] )           (no gates: ``HAS_GATE=False``)

A bf16 x bf16 or fp16 x fp16 product is exact in fp32, so ``act(fp32 product)`` is the correctly
rounded product torch computes. No [T, K, D] intermediate, no atomics: the forward programs own
token tiles, the backward programs own expert-major row tiles (each slot's gate gradient is one
row's dot product).

Kernels:
  ``_gather_ksum_kernel``     grid (cdiv(T, BLOCK_R), cdiv(D, BLOCK_D)): out / g_TD.
  ``_combine_bwd_kernel``     grid (cdiv(N, BLOCK_R),): g_y [N, D] and g_gate [S], looping over D.

EMULATE (TRITON_INTERPRET=1 only): the interpreter's fp32 -> bf16 cast truncates and its bf16 <->
fp32 casts mishandle subnormals, so there bf16 values are read, rounded (to nearest even, as the
GPU's cvt.rn) and written in integer arithmetic on their bits.
"""

import triton
import triton.language as tl

from tlx import c_launch as _c_launch


@triton.jit
def _round_to(v, dst_ty: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``v`` rounded to nearest even in ``dst_ty``, returned as fp32 (exact) values."""
    if EMULATE and dst_ty == tl.bfloat16:
        # bf16 is fp32's top 16 bits: rounding the magnitude's bits at bit 16 is exact for normals,
        # subnormals and overflow to inf; NaN stays NaN (its quiet bit survives the carry).
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 31) << 31
        mag = bits & 0x7FFFFFFF
        r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
        r = tl.where(mag > 0x7F800000, (mag >> 16) | 0x40, r)  # NaN stays a (quiet) NaN, no carry to inf
        return ((r << 16) | sign).to(tl.float32, bitcast=True)
    else:
        return v.to(dst_ty).to(tl.float32)


@triton.jit
def _load_f32(ptrs, mask, EMULATE: tl.constexpr):
    """fp32 values of the elements at ``ptrs`` (masked ones 0)."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    if EMULATE and v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _as(v, dst_ty: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``v`` holding values exact in ``dst_ty`` (from :func:`_round_to`), in ``dst_ty``."""
    if EMULATE and dst_ty == tl.bfloat16:
        return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dst_ty)


@triton.jit
def _gather_ksum_kernel(y_ptr, gate_ptr, inv_ptr, out_ptr, T, K, D, stride_yn, stride_ot,
                        HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                        EMULATE: tl.constexpr):
    pt = tl.program_id(0)
    pd = tl.program_id(1)
    act: tl.constexpr = out_ptr.dtype.element_ty
    t = pt * BLOCK_R + tl.arange(0, BLOCK_R)
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < T
    ok = t_ok[:, None] & (d < D)[None, :]
    t64 = t.to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for k in range(K):
        s = t64 * K + k
        n = tl.load(inv_ptr + s, mask=t_ok, other=0).to(tl.int64)
        y = _load_f32(y_ptr + n[:, None] * stride_yn + d[None, :], ok, EMULATE)
        if HAS_GATE:
            w = _round_to(_load_f32(gate_ptr + s, t_ok, EMULATE), act, EMULATE)
            y = _round_to(w[:, None] * y, act, EMULATE)
        acc += y
    r = _as(_round_to(acc, act, EMULATE), act, EMULATE)
    tl.store(out_ptr + t64[:, None] * stride_ot + d[None, :], r, mask=ok)


@triton.jit
def _combine_bwd_kernel(g_ptr, y_ptr, gate_ptr, order_ptr, gy_ptr, ggate_ptr, N, K, D, stride_gt, stride_yn,
                        stride_gyn, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    pn = tl.program_id(0)
    act: tl.constexpr = gy_ptr.dtype.element_ty
    n = pn * BLOCK_R + tl.arange(0, BLOCK_R)
    n_ok = n < N
    n64 = n.to(tl.int64)
    s = tl.load(order_ptr + n64, mask=n_ok, other=0).to(tl.int64)
    t = s // K
    w = _round_to(_load_f32(gate_ptr + s, n_ok, EMULATE), act, EMULATE)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = n_ok[:, None] & (d < D)[None, :]
        g = _load_f32(g_ptr + t[:, None] * stride_gt + d[None, :], ok, EMULATE)
        y = _load_f32(y_ptr + n64[:, None] * stride_yn + d[None, :], ok, EMULATE)
        gy = _as(_round_to(g * w[:, None], act, EMULATE), act, EMULATE)
        tl.store(gy_ptr + n64[:, None] * stride_gyn + d[None, :], gy, mask=ok)
        dot += tl.sum(g * y, axis=1)
    gt: tl.constexpr = ggate_ptr.dtype.element_ty
    gg = _as(_round_to(dot, gt, EMULATE), gt, EMULATE)
    tl.store(ggate_ptr + s, gg, mask=n_ok)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_gather_ksum_kernel)
_c_launch(_combine_bwd_kernel)
