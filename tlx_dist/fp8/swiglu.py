"""SwiGLU fused with the FP8 row quantization around it: host wrappers of tlx/common/fp8_swiglu.py,
their torch references, and the custom ops the FP8 experts call.

Legend: M rows (expert-major, padding rows included), F the expert intermediate dim, G = 128,
Fb = cdiv(F, G), F2b = cdiv(2F, G). ``h_M2F`` is the gate/up GEMM's output (gate | up halves).

    a_MF, a_fp8  = swiglu_quant(h_M2F)             # a = silu(gate) * up; a_fp8 = quantize_rows(a)
    dh_M2F, dh_fp8 = swiglu_bwd_quant(h_M2F, dA_MF)  # dh = d gate | d up; dh_fp8 = quantize_rows(dh)
    _, a_fp8, a_cols = swiglu_quant_both(h_M2F, offsets_E)           # + a_cols = quantize_cols(a, offsets)
    _, dh_fp8, dh_cols = swiglu_bwd_quant_both(h_M2F, dA_MF, offsets_E)  # + dh_cols = quantize_cols(dh, ...)

The ``*_both`` forms walk quantize_cols' expert-aligned 128-row tiles (``offsets_E``, guarded on the
device as there) and also emit the weight gradient's column form, so that neither ``a`` / ``dh``
itself nor a second pass over it is needed (``keep_a`` / ``keep_dh`` still return it).

Both compute in fp32 and round once to ``h``'s dtype; the quantization is of that rounded tensor,
so ``a_fp8`` / ``dh_fp8`` equal :func:`~tlx_dist.fp8.quant.quantize_rows` of ``a`` / ``dh`` bit for
bit (the same scale rule and encoding). The references use torch's own silu / silu_backward in fp32,
which is what autograd runs through ``silu(gate.float()) * up.float()``; the kernels' exp may round
differently in the last fp32 bit (the tests bound them by one unit of the output dtype's last
place from the float64 value, plus the fp32 formula's own error).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..grouped_gemm.eager import custom_op
from ..grouped_gemm.host import launch_meta, search_steps
from .api import _cols_fake, _quant_backend, _rows_fake
from .quant import (FORMATS, emulate, GROUP, Fp8Cols, Fp8Rows, _check_input, _use_kernels, check_fmt, check_offsets,
                    empty_rows, empty_rows_cols, quantize_cols_ref, quantize_rows_ref, tile_grid)

__all__ = ["swiglu_quant", "swiglu_bwd_quant", "swiglu_quant_ref", "swiglu_bwd_quant_ref", "swiglu_quant_both",
           "swiglu_bwd_quant_both", "swiglu_quant_both_ref", "swiglu_bwd_quant_both_ref"]

_BLOCK_M = 32
# The *_both kernels' launch meta-parameters (the tile is G x G: the scale group, not a launch
# choice); their wrappers' private ``_launch=`` overrides them for one call (bench/fp8_kernels.py --sweep).
_TILES_LAUNCH = {"num_warps": 8}
_BWD_TILES_LAUNCH = {"num_warps": 8}


def _check_h(h_M2F: torch.Tensor) -> int:
    _check_input("h_M2F", h_M2F, 2)
    if h_M2F.shape[1] % 2:
        raise ValueError(f"h_M2F must be [M, 2F] (gate | up halves), got an odd width {h_M2F.shape[1]}")
    return h_M2F.shape[1] // 2


def _check_dA(dA_MF: torch.Tensor, h_M2F: torch.Tensor, F_: int) -> None:
    _check_input("dA_MF", dA_MF, 2)
    if tuple(dA_MF.shape) != (h_M2F.shape[0], F_):
        raise ValueError(f"dA_MF must be [M, F] = {(h_M2F.shape[0], F_)} to match h_M2F {tuple(h_M2F.shape)}, got "
                         f"{tuple(dA_MF.shape)}")
    if dA_MF.dtype != h_M2F.dtype or dA_MF.device != h_M2F.device:
        raise TypeError(f"dA_MF ({dA_MF.dtype}, {dA_MF.device}) must have h_M2F's dtype and device "
                        f"({h_M2F.dtype}, {h_M2F.device})")


# --- torch references ------------------------------------------------------------------------------


def swiglu_quant_ref(h_M2F: torch.Tensor, fmt: str = "e4m3fn", pow2: bool = False) -> tuple[torch.Tensor, Fp8Rows]:
    """Reference of :func:`swiglu_quant` (torch ops, any device)."""
    F_ = _check_h(h_M2F)
    check_fmt(fmt)
    g, u = h_M2F[:, :F_].float(), h_M2F[:, F_:].float()
    a = (F.silu(g) * u).to(h_M2F.dtype)
    return a, quantize_rows_ref(a, fmt, pow2)


def swiglu_bwd_quant_ref(h_M2F: torch.Tensor, dA_MF: torch.Tensor, fmt: str = "e4m3fn",
                         pow2: bool = False) -> tuple[torch.Tensor, Fp8Rows]:
    """Reference of :func:`swiglu_bwd_quant` (torch ops, any device): the gradient autograd gives
    through ``(silu(gate.float()) * up.float()).to(h.dtype)``, bit for bit."""
    F_ = _check_h(h_M2F)
    _check_dA(dA_MF, h_M2F, F_)
    check_fmt(fmt)
    g, u, da = h_M2F[:, :F_].float(), h_M2F[:, F_:].float(), dA_MF.float()
    dh = torch.cat([torch.ops.aten.silu_backward(da * u, g), da * F.silu(g)], dim=1).to(h_M2F.dtype)
    return dh, quantize_rows_ref(dh, fmt, pow2)


def swiglu_quant_both_ref(h_M2F: torch.Tensor, offsets_E: torch.Tensor, fmt: str = "e4m3fn",
                          pow2: bool = False) -> tuple[torch.Tensor, Fp8Rows, Fp8Cols]:
    """Reference of :func:`swiglu_quant_both`: ``(a, quantize_rows_ref(a), quantize_cols_ref(a, offsets))``."""
    a, r = swiglu_quant_ref(h_M2F, fmt, pow2)
    return a, r, quantize_cols_ref(a, offsets_E, fmt, pow2)


def swiglu_bwd_quant_both_ref(h_M2F: torch.Tensor, dA_MF: torch.Tensor, offsets_E: torch.Tensor, fmt: str = "e4m3fn",
                              pow2: bool = False) -> tuple[torch.Tensor, Fp8Rows, Fp8Cols]:
    """Reference of :func:`swiglu_bwd_quant_both`: ``(dh, quantize_rows_ref(dh), quantize_cols_ref(dh, offsets))``."""
    dh, r = swiglu_bwd_quant_ref(h_M2F, dA_MF, fmt, pow2)
    return dh, r, quantize_cols_ref(dh, offsets_E, fmt, pow2)


# --- kernels -----------------------------------------------------------------------------------------


def swiglu_quant(h_M2F: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                 backend: Optional[str] = None) -> tuple[torch.Tensor, Fp8Rows]:
    """``a = silu(gate) * up`` and its 1 x 128 row quantization, in one pass over ``h``.

    Args:
        h_M2F: ``[M, 2F]`` bf16 / fp16 / fp32, gate | up halves (unit column stride on the kernel
            path, else copied).
        fmt, pow2, backend: as :func:`~tlx_dist.fp8.quant.quantize_rows`.
    Returns:
        ``(a_MF, Fp8Rows)``: ``a`` ``[M, F]`` contiguous in ``h``'s dtype (fp32 math, one rounding);
        q ``[M, F]`` fp8 and s ``[M, Fb]`` fp32 (M-contiguous) = ``quantize_rows(a)``.
    """
    F_ = _check_h(h_M2F)
    check_fmt(fmt)
    if not _use_kernels(h_M2F, backend):
        return swiglu_quant_ref(h_M2F, fmt, pow2)
    from tlx.common.fp8_swiglu import _swiglu_quant_kernel

    if h_M2F.stride(1) != 1:
        h_M2F = h_M2F.contiguous()
    M = h_M2F.shape[0]
    a = torch.empty(M, F_, dtype=h_M2F.dtype, device=h_M2F.device)
    q, s = empty_rows(M, F_, fmt, a.device)
    if M and F_:
        _swiglu_quant_kernel[(-(-M // _BLOCK_M), -(-F_ // GROUP))](
            h_M2F, a, q.view(torch.uint8), s, M, F_, h_M2F.stride(0), F_, F_, M, G=GROUP, BLOCK_M=_BLOCK_M,
            FMT=FORMATS[fmt][2], POW2=pow2, EMULATE=emulate(fmt), num_warps=4)
    return a, Fp8Rows(q, s.t())


def swiglu_bwd_quant(h_M2F: torch.Tensor, dA_MF: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                     backend: Optional[str] = None) -> tuple[torch.Tensor, Fp8Rows]:
    """The SwiGLU's gradient wrt ``h`` and its 1 x 128 row quantization, in one pass (no cat).

    Args:
        h_M2F: ``[M, 2F]`` the forward's input (bf16 / fp16 / fp32).
        dA_MF: ``[M, F]`` the gradient of ``a``, in ``h``'s dtype.
        fmt, pow2, backend: as :func:`~tlx_dist.fp8.quant.quantize_rows`.
    Returns:
        ``(dh_M2F, Fp8Rows)``: ``dh`` ``[M, 2F]`` contiguous in ``h``'s dtype, d gate | d up
        (fp32 math, one rounding each); q ``[M, 2F]`` fp8 and s ``[M, F2b]`` fp32 = ``quantize_rows(dh)``.
    """
    F_ = _check_h(h_M2F)
    _check_dA(dA_MF, h_M2F, F_)
    check_fmt(fmt)
    if not _use_kernels(h_M2F, backend):
        return swiglu_bwd_quant_ref(h_M2F, dA_MF, fmt, pow2)
    from tlx.common.fp8_swiglu import _swiglu_bwd_quant_kernel

    if h_M2F.stride(1) != 1:
        h_M2F = h_M2F.contiguous()
    if dA_MF.stride(1) != 1:
        dA_MF = dA_MF.contiguous()
    M = h_M2F.shape[0]
    dh = torch.empty(M, 2 * F_, dtype=h_M2F.dtype, device=h_M2F.device)
    q, s = empty_rows(M, 2 * F_, fmt, dh.device)
    if M and F_:
        paired = F_ % GROUP == 0
        groups = F_ // GROUP if paired else -(-2 * F_ // GROUP)
        _swiglu_bwd_quant_kernel[(-(-M // _BLOCK_M), groups)](
            h_M2F, dA_MF, dh, q.view(torch.uint8), s, M, F_, h_M2F.stride(0), dA_MF.stride(0), 2 * F_, 2 * F_, M,
            G=GROUP, BLOCK_M=_BLOCK_M, PAIRED=paired, FMT=FORMATS[fmt][2], POW2=pow2, EMULATE=emulate(fmt),
            num_warps=4)
    return dh, Fp8Rows(q, s.t())


def swiglu_quant_both(h_M2F: torch.Tensor, offsets_E: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                      backend: Optional[str] = None, keep_a: bool = False, _launch: Optional[dict] = None) -> tuple[
                          Optional[torch.Tensor], Fp8Rows, Fp8Cols]:
    """``a = silu(gate) * up`` quantized both ways in one pass over ``h``: the down GEMM's row form
    and the weight gradient's expert-tile column form.

    Args:
        h_M2F: ``[M, 2F]`` as :func:`swiglu_quant`, rows in expert-major order.
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (guarded on the device, as
            :func:`~tlx_dist.fp8.quant.quantize_cols`).
        fmt, pow2, backend: as :func:`~tlx_dist.fp8.quant.quantize_rows`.
        keep_a: also return ``a`` itself (else None, and the kernel does not store it).
        _launch: private, the kernel's meta-parameter overrides (a launch-config sweep's; None: the
            wrapper's constants).
    Returns:
        ``(a_MF or None, Fp8Rows, Fp8Cols)`` = ``(a, quantize_rows(a), quantize_cols(a, offsets_E))``
        of the rounded ``a`` (:func:`swiglu_quant`'s), bit for bit.
    """
    F_ = _check_h(h_M2F)
    check_fmt(fmt)
    check_offsets(offsets_E, h_M2F, "h_M2F")
    if not _use_kernels(h_M2F, backend):
        a, r, c = swiglu_quant_both_ref(h_M2F, offsets_E, fmt, pow2)
        return (a if keep_a else None), r, c
    from tlx.common.fp8_swiglu import _swiglu_quant_tiles_kernel

    if h_M2F.stride(1) != 1:
        h_M2F = h_M2F.contiguous()
    M, E = h_M2F.shape[0], offsets_E.shape[0]
    T, safe, tile_cum = tile_grid(offsets_E, M)
    a = torch.empty(M, F_, dtype=h_M2F.dtype, device=h_M2F.device) if keep_a else None
    q, s, qc, sc = empty_rows_cols(M, F_, T, fmt, h_M2F.device)
    if F_:
        _swiglu_quant_tiles_kernel[(T, -(-F_ // GROUP))](
            h_M2F, h_M2F if a is None else a, q.view(torch.uint8), s, qc.view(torch.uint8), sc, safe, tile_cum, E, M,
            F_, h_M2F.stride(0), F_, F_, M, GROUP * T, G=GROUP, STORE=keep_a, FMT=FORMATS[fmt][2], POW2=pow2,
            EMULATE=emulate(fmt), SEARCH_STEPS=search_steps(E), **launch_meta(_TILES_LAUNCH, _launch))
    return a, Fp8Rows(q, s.t()), Fp8Cols(qc, sc, tile_cum, safe, M)


def swiglu_bwd_quant_both(h_M2F: torch.Tensor, dA_MF: torch.Tensor, offsets_E: torch.Tensor, *, fmt: str = "e4m3fn",
                          pow2: bool = False, backend: Optional[str] = None, keep_dh: bool = False,
                          _launch: Optional[dict] = None) -> tuple[Optional[torch.Tensor], Fp8Rows, Fp8Cols]:
    """The SwiGLU's gradient ``dh`` quantized both ways in one pass: the dX GEMM's row form and the
    weight gradient's expert-tile column form.

    Args:
        h_M2F, dA_MF: as :func:`swiglu_bwd_quant`, rows in expert-major order.
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (as :func:`swiglu_quant_both`).
        fmt, pow2, backend: as :func:`~tlx_dist.fp8.quant.quantize_rows`.
        keep_dh: also return ``dh`` itself (else None, and the kernel does not store it).
        _launch: as :func:`swiglu_quant_both`.
    Returns:
        ``(dh_M2F or None, Fp8Rows, Fp8Cols)`` = ``(dh, quantize_rows(dh), quantize_cols(dh, offsets_E))``
        of the rounded ``dh`` (:func:`swiglu_bwd_quant`'s), bit for bit.
    """
    F_ = _check_h(h_M2F)
    _check_dA(dA_MF, h_M2F, F_)
    check_fmt(fmt)
    check_offsets(offsets_E, h_M2F, "h_M2F")
    if not _use_kernels(h_M2F, backend):
        dh, r, c = swiglu_bwd_quant_both_ref(h_M2F, dA_MF, offsets_E, fmt, pow2)
        return (dh if keep_dh else None), r, c
    from tlx.common.fp8_swiglu import _swiglu_bwd_quant_tiles_kernel

    if h_M2F.stride(1) != 1:
        h_M2F = h_M2F.contiguous()
    if dA_MF.stride(1) != 1:
        dA_MF = dA_MF.contiguous()
    M, E = h_M2F.shape[0], offsets_E.shape[0]
    T, safe, tile_cum = tile_grid(offsets_E, M)
    dh = torch.empty(M, 2 * F_, dtype=h_M2F.dtype, device=h_M2F.device) if keep_dh else None
    q, s, qc, sc = empty_rows_cols(M, 2 * F_, T, fmt, h_M2F.device)
    if F_:
        paired = F_ % GROUP == 0
        groups = F_ // GROUP if paired else -(-2 * F_ // GROUP)
        _swiglu_bwd_quant_tiles_kernel[(T, groups)](
            h_M2F, dA_MF, h_M2F if dh is None else dh, q.view(torch.uint8), s, qc.view(torch.uint8), sc, safe,
            tile_cum, E, M, F_, h_M2F.stride(0), dA_MF.stride(0), 2 * F_, 2 * F_, M, GROUP * T, G=GROUP,
            PAIRED=paired, STORE=keep_dh, FMT=FORMATS[fmt][2], POW2=pow2, EMULATE=emulate(fmt),
            SEARCH_STEPS=search_steps(E), **launch_meta(_BWD_TILES_LAUNCH, _launch))
    return dh, Fp8Rows(q, s.t()), Fp8Cols(qc, sc, tile_cum, safe, M)


# --- custom ops (e4m3fn, per-tile fp32 scales: what the NVIDIA GEMMs read) ------------------------------
# backend: the FP8 GEMM backend's name; "reference" runs the torch references (as the row quantizer's
# op in api.py does), any other the kernels where they run. Eager calls run the bodies directly
# (tlx_dist/grouped_gemm/eager.py).


@custom_op("tlx_dist::fp8_swiglu_quant")
def _swiglu_quant_op(h_M2F: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, r = swiglu_quant(h_M2F, backend=_quant_backend(backend))
    return a, r.q_MC, r.s_MCb.t().contiguous()


@_swiglu_quant_op.register_fake
def _(h_M2F, backend):
    M, F2 = h_M2F.shape
    return (h_M2F.new_empty(M, F2 // 2), h_M2F.new_empty(M, F2 // 2, dtype=torch.float8_e4m3fn),
            h_M2F.new_empty(-(-(F2 // 2) // GROUP), M, dtype=torch.float32))


@custom_op("tlx_dist::fp8_swiglu_bwd_quant")
def _swiglu_bwd_quant_op(h_M2F: torch.Tensor, dA_MF: torch.Tensor, backend: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    dh, r = swiglu_bwd_quant(h_M2F, dA_MF, backend=_quant_backend(backend))
    return dh, r.q_MC, r.s_MCb.t().contiguous()


@_swiglu_bwd_quant_op.register_fake
def _(h_M2F, dA_MF, backend):
    M, F2 = h_M2F.shape
    return (h_M2F.new_empty(M, F2), h_M2F.new_empty(M, F2, dtype=torch.float8_e4m3fn),
            h_M2F.new_empty(-(-F2 // GROUP), M, dtype=torch.float32))


# The *_both ops return the row form (q, s [Cb, M]) then the column form (q [C, P], s [T, C],
# tile_cum_E1, safe_E), as _quant_rows_op and _quant_cols_op do; the bf16 output is not kept.


@custom_op("tlx_dist::fp8_swiglu_quant_both")
def _swiglu_quant_both_op(h_M2F: torch.Tensor, offsets_E: torch.Tensor, backend: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _, r, c = swiglu_quant_both(h_M2F, offsets_E, backend=_quant_backend(backend))
    return r.q_MC, r.s_MCb.t().contiguous(), c.q_CP, c.s_TC, c.tile_cum_E1, c.offsets_E


@_swiglu_quant_both_op.register_fake
def _(h_M2F, offsets_E, backend):
    M, F2 = h_M2F.shape
    return _rows_fake(h_M2F, M, F2 // 2) + _cols_fake(h_M2F, offsets_E, M, F2 // 2)


@custom_op("tlx_dist::fp8_swiglu_bwd_quant_both")
def _swiglu_bwd_quant_both_op(h_M2F: torch.Tensor, dA_MF: torch.Tensor, offsets_E: torch.Tensor, backend: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _, r, c = swiglu_bwd_quant_both(h_M2F, dA_MF, offsets_E, backend=_quant_backend(backend))
    return r.q_MC, r.s_MCb.t().contiguous(), c.q_CP, c.s_TC, c.tile_cum_E1, c.offsets_E


@_swiglu_bwd_quant_both_op.register_fake
def _(h_M2F, dA_MF, offsets_E, backend):
    M, F2 = h_M2F.shape
    return _rows_fake(h_M2F, M, F2) + _cols_fake(h_M2F, offsets_E, M, F2)
