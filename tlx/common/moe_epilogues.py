"""Epilogue math of the fused MoE expert GEMMs, shared by the portable and the Hopper kernels.

Legend: rows of a tile (expert-major), F expert intermediate; ``hg`` / ``hu`` the gate and up halves
of ``h = x @ w13`` for the tile's F-columns, as fp32 values of their stored (rounded) copies.

    forward :  a   = silu(hg) * hu
    backward:  given g = dL/da (fp32) and the row's gate weight,
               dgate_row = sum_f a * g           (the gate gradient, a row dot product)
               da        = gate * g
               dhg       = da * hu * sig(hg) * (1 + hg * (1 - sig(hg)))
               dhu       = da * silu(hg)
               ag        = gate * a               (the A operand of dW2 = ag^T @ dout[dst])

``a`` is always computed from the *rounded* h that backward reads back, so forward and backward see
the same activation.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_fwd(hg, hu):
    """a = silu(hg) * hu (fp32 in, fp32 out)."""
    return hg * tl.sigmoid(hg) * hu


@triton.jit
def swiglu_bwd(hg, hu, g, gate_row):
    """(a, dhg, dhu) for upstream ``g`` = dL/d(gate * a) / gate, i.e. dL/da = gate * g.
    ``gate_row`` is ``[rows, 1]``; everything fp32."""
    sig = tl.sigmoid(hg)
    silu = hg * sig
    da = g * gate_row
    dhg = da * hu * sig * (1.0 + hg * (1.0 - sig))
    dhu = da * silu
    return silu * hu, dhg, dhu


# --- the epilogue's memory accesses straight from the wgmma accumulator layout (Hopper, DIRECT) -----
#
# A thread of a wgmma accumulator holds its columns in adjacent (even, odd) pairs. ``split_pairs``
# separates them without moving data, and the helpers below read, write or reduce each pair with one
# 4-byte (16-bit elements) or 8-byte (fp32) PTX access. Triton's own loads, stores and atomics first
# convert the tile through shared memory (a barrier and a round trip a tensor) to reach 16-byte
# accesses. Pointers address the even columns and must be aligned to the pair.


@triton.jit
def split_pairs(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(even columns, odd columns) of a ``[ROWS, COLS]`` register tile."""
    return tl.split(tl.reshape(x, [ROWS, COLS // 2, 2]))


@triton.jit
def split_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(left, right) column halves of a ``[ROWS, COLS]`` wgmma accumulator tile (COLS >= 16): a thread
    holds columns of both halves, so this moves no data either."""
    return tl.split(tl.permute(tl.reshape(x, [ROWS, 2, COLS // 2]), [0, 2, 1]))


@triton.jit
def load_pairs(ptrs, ok):
    """(even, odd) fp32 values of the 16-bit (bf16 / fp16) element pairs at ``ptrs``; 0 where not ``ok``.
    Not marked pure, so the compiler keeps it after earlier stores (it would otherwise hoist every
    load of an epilogue to the top and spill)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        e, o = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 r; .reg .b16 lo, hi; setp.ne.b32 p, $3, 0; mov.b32 r, 0; "
            "@p ld.global.b32 r, [$2]; mov.b32 {lo, hi}, r; cvt.f32.bf16 $0, lo; cvt.f32.bf16 $1, hi; }",
            "=f,=f,l,r", [ptrs.to(tl.int64), ok.to(tl.int32)], dtype=(tl.float32, tl.float32), is_pure=False,
            pack=1)
    else:
        e, o = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 r; .reg .b16 lo, hi; setp.ne.b32 p, $3, 0; mov.b32 r, 0; "
            "@p ld.global.b32 r, [$2]; mov.b32 {lo, hi}, r; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=f,=f,l,r", [ptrs.to(tl.int64), ok.to(tl.int32)], dtype=(tl.float32, tl.float32), is_pure=False,
            pack=1)
    return e, o


@triton.jit
def store_pairs(ptrs, v_even, v_odd, ok):
    """Round fp32 ``v_even`` / ``v_odd`` to the 16-bit element type of ``ptrs`` (nearest even) and
    store each pair with one 4-byte store where ``ok``."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 r; setp.ne.b32 p, $4, 0; cvt.rn.bf16x2.f32 r, $3, $2; "
            "@p st.global.b32 [$1], r; mov.u32 $0, 0; }",
            "=r,l,f,f,r", [ptrs.to(tl.int64), v_even, v_odd, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
            pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 r; setp.ne.b32 p, $4, 0; cvt.rn.f16x2.f32 r, $3, $2; "
            "@p st.global.b32 [$1], r; mov.u32 $0, 0; }",
            "=r,l,f,f,r", [ptrs.to(tl.int64), v_even, v_odd, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
            pack=1)


@triton.jit
def red_add_pairs(c_ptr, d_row, stride_cn, col0, NN, val, row_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``c[d_row[i], col0 + j] += val[i, j]`` (fp32, relaxed) as one ``red.global.add.v2.f32`` (sm_90+)
    per column pair, for rows with ``row_ok`` and pairs before ``NN`` (``col0``, ``NN``, the row stride
    even; ``c`` 8-byte aligned)."""
    v_even, v_odd = split_pairs(val, ROWS, COLS)
    ce = col0 + 2 * tl.arange(0, COLS // 2)
    ptrs = c_ptr + d_row[:, None] * stride_cn + ce[None, :]
    ok = (row_ok[:, None] & (ce < NN)[None, :]).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $4, 0; @p red.global.gpu.relaxed.add.v2.f32 [$1], {$2, $3}; mov.u32 $0, 0; }",
        "=r,l,f,f,r", [ptrs.to(tl.int64), v_even, v_odd, ok], dtype=tl.int32, is_pure=False, pack=1)
