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


@triton.jit
def split_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(left, right) column halves of a ``[ROWS, COLS]`` register tile. In a wgmma accumulator each
    thread holds columns of both halves, so this moves no data."""
    return tl.split(tl.permute(tl.reshape(x, [ROWS, 2, COLS // 2]), [0, 2, 1]))
