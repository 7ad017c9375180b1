"""FP8 block quantization: host wrappers of tlx/common/fp8_quant.py and their torch references.

Legend: M rows (tokens, expert-major), C columns, E experts, G = 128 (the group), Cb = cdiv(C, G),
T = M // G + E + 1 (a bound on the expert-aligned G-row tiles, from shapes only), P = G * T.

The recipe is DeepSeek-V3's: activations in 1 x G tiles along the GEMM's reduction dimension,
weights in G x G blocks, e4m3 values and one fp32 scale per group,

    s = max(amax, AMAX_FLOOR) / FP8_MAX        (pow2: the next power of two up, an exact e8m0)
    q = fp8(clamp(x * (FP8_MAX / max(amax, AMAX_FLOOR)), -FP8_MAX, FP8_MAX)),    x ~= q * s

(FP8_MAX = 448 for e4m3fn, 240 for e4m3fnuz). An all-zero group gives zeros and a tiny scale,
never NaN; a group whose values are all below AMAX_FLOOR is quantized against the floor. C (or
the weight's dims) need not be multiples of G: the last group is partial and its missing values
count as zeros. Non-finite inputs give non-finite outputs.

Forms:
  ``quantize_rows(x_MC)``            -> Fp8Rows: q [M, C], s [M, Cb] (M-contiguous storage):
                                       the A operand of the forward / dX GEMMs (reduction = C).
  ``quantize_cols(x_MC, offsets_E)`` -> Fp8Cols: q [C, P], s [T, C], tiles along M that start
                                       at each expert's first row: the operands of the
                                       weight gradient (reduction = the expert's rows).
  ``quantize_both(x_MC, offsets_E)`` -> (Fp8Rows, Fp8Cols): the two above from one read of x
                                       (a tensor both the dX / forward GEMM and the weight
                                       gradient read, e.g. the down GEMM's dy).
  ``quantize_cols_from_rows(rows, offsets_E, dtype=)`` -> Fp8Cols: ``quantize_cols`` of the
                                       rows' dequantization to ``dtype``, made from the FP8 rows
                                       (an FP8 dispatch's receiver: no ``[M, C]`` tensor of x).
  ``quantize_weight(w_EDF)``         -> Fp8Weight: G x G blocks, stored twice (K-contiguous
                                       [E, F, D] for the forward, [E, D, F] for dX) with scales.

Each runs the Triton kernel on a GPU (and on CPU under TRITON_INTERPRET=1, where the FP8 encoding
is emulated in integer arithmetic), else its ``*_ref``; kernels and references agree bit for bit.
Nothing here reads device values on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..grouped_gemm.host import interpret_mode, launch_meta, max_m_tiles, search_steps
from ..grouped_gemm.reference import check_num_experts, safe_offsets_ref

__all__ = ["GROUP", "AMAX_FLOOR", "FORMATS", "Fp8Rows", "Fp8Cols", "Fp8Weight", "quantize_rows", "quantize_cols",
           "quantize_both", "quantize_cols_from_rows", "quantize_weight", "quantize_rows_ref", "quantize_cols_ref",
           "quantize_both_ref", "quantize_cols_from_rows_ref", "quantize_weight_ref", "dequantize_rows",
           "dequantize_rows_rounded", "dequantize_cols", "dequantize_weight", "tile_cum_ref", "check_fmt",
           "values_placeholder", "is_values_placeholder"]

GROUP = 128
AMAX_FLOOR = 1e-12  # the value of tlx/common/fp8_quant.py's AMAX_FLOOR
# format name -> (torch dtype, largest finite value, kernel FMT code)
FORMATS = {"e4m3fn": (torch.float8_e4m3fn, 448.0, 0), "e4m3fnuz": (torch.float8_e4m3fnuz, 240.0, 1)}
# Each kernel's launch meta-parameters. A wrapper's private ``_launch=`` dict overrides them for one
# call (bench/fp8_kernels.py --sweep; grouped_gemm/host.py launch_meta); None launches these.
_ROWS_LAUNCH = {"BLOCK_M": 32, "num_warps": 4}
_DEQUANT_ROWS_LAUNCH = {"BLOCK_M": 32, "num_warps": 4}
_COLS_LAUNCH = {"BLOCK_C": 64, "num_warps": 2}
_COLS_FROM_ROWS_LAUNCH = {"BLOCK_C": 64, "num_warps": 4}  # BLOCK_C divides GROUP: one scale of each row
_BOTH_LAUNCH = {"num_warps": 4}  # the tile is G x G (G = GROUP, the scale group: not a launch choice)


@dataclass(frozen=True)
class Fp8Rows:
    """Row-quantized ``[M, C]``: ``q_MC`` fp8 ``[M, C]`` (unit column stride: contiguous from
    ``quantize_rows``, a view of the packed rows from an FP8 dispatch); ``s_MCb`` fp32 ``[M, Cb]`` with
    strides ``(1, M)`` (stored ``[Cb, M]``): ``x[m, c] ~= q[m, c] * s[m, c // G]``."""

    q_MC: torch.Tensor
    s_MCb: torch.Tensor


def values_placeholder(M: int, C: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[M, C]`` of ``dtype`` with strides ``(0, 0)`` (one NaN element, expanded): what stands for a
    tensor whose values travel only as its :class:`Fp8Rows` (``dispatch_fp8(dequantize=False)``). It
    carries the shape, dtype, device and gradient; its values are never to be read (the FP8
    experts refuse it without the rows, and a stray read shows NaN)."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(M, C)


def is_values_placeholder(x: torch.Tensor) -> bool:
    """Whether ``x`` is a :func:`values_placeholder` (a 2-D tensor with strides ``(0, 0)``)."""
    return isinstance(x, torch.Tensor) and x.dim() == 2 and x.stride() == (0, 0)


@dataclass(frozen=True)
class Fp8Cols:
    """Transposed, expert-tile-aligned quantization of ``x_MC`` over ``offsets_E``.

    ``q_CP`` fp8 ``[C, P]`` and ``s_TC`` fp32 ``[T, C]``: tile ``t = tile_cum_E1[e-1] + j`` holds rows
    ``lo_e + G*j + i`` (``i < G``, below expert e's end) at ``q_CP[:, G*t + i]``, each column's G values
    sharing the scale ``s_TC[t, c]``; positions past an expert's last row are zero, slack tiles past
    ``tile_cum_E1[E-1]`` are unwritten. ``tile_cum_E1`` int32 ``[E + 1]`` (entry E counts the padding
    rows' tiles), ``offsets_E`` int32 ``[E]``, the guarded offsets the tiles were cut from."""

    q_CP: torch.Tensor
    s_TC: torch.Tensor
    tile_cum_E1: torch.Tensor
    offsets_E: torch.Tensor
    n_rows: int


@dataclass(frozen=True)
class Fp8Weight:
    """Block-quantized ``w_EDF`` (G x G blocks over (D, F)), in both layouts the GEMMs read.

    ``q_EFD`` fp8 ``[E, F, D]`` (the forward's K-contiguous B operand) with ``s_EFbDb`` fp32
    ``[E, Fb, Db]``; ``q_EDF`` fp8 ``[E, D, F]`` (dX's, reduction over F) with ``s_EDbFb`` fp32
    ``[E, Db, Fb]``. ``w[e, d, f] ~= q_EDF[e, d, f] * s_EDbFb[e, d // G, f // G]``."""

    q_EFD: torch.Tensor
    s_EFbDb: torch.Tensor
    q_EDF: torch.Tensor
    s_EDbFb: torch.Tensor
    fmt: str = "e4m3fn"

    @property
    def shape(self) -> torch.Size:
        return self.q_EDF.shape


def emulate(fmt: str) -> bool:
    """Whether the kernels encode FP8 in integer arithmetic (``EMULATE``): under the interpreter,
    and for e4m3fnuz off ROCm -- Triton on NVIDIA GPUs has no e4m3fnuz type, and the emulated
    encoding gives the same bytes the hardware one would."""
    return interpret_mode() or (fmt == "e4m3fnuz" and not getattr(torch.version, "hip", None))


def check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {sorted(FORMATS)}")


_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_input(name: str, x: torch.Tensor, dims: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_offsets(offsets_E: torch.Tensor, x: torch.Tensor, x_name: str) -> None:
    """``offsets_E`` must be a 1-D int32 / int64 tensor of E >= 1 cumulative end rows on ``x``'s device."""
    if not isinstance(offsets_E, torch.Tensor) or offsets_E.dim() != 1 or offsets_E.dtype not in (torch.int32,
                                                                                                 torch.int64):
        raise ValueError("offsets_E must be a 1-D int32 / int64 tensor of cumulative end rows")
    check_num_experts(offsets_E.shape[0], "offsets_E")
    if offsets_E.device != x.device:
        raise ValueError(f"{x_name} is on {x.device} but offsets_E on {offsets_E.device}")


def _use_kernels(t: torch.Tensor, backend: Optional[str]) -> bool:
    if backend not in (None, "triton", "reference"):
        raise ValueError(f"backend={backend!r} must be None, 'triton' or 'reference'")
    if backend == "reference":
        return False
    from tlx import triton_available

    ok = triton_available() and (t.is_cuda or interpret_mode())
    if backend == "triton" and not ok:
        raise ValueError(f"backend='triton' needs a GPU tensor or TRITON_INTERPRET=1 (got a {t.device} tensor)")
    return ok


# --- torch references ------------------------------------------------------------------------------


def _scales_ref(amax: torch.Tensor, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.tensor(FORMATS[fmt][1], dtype=torch.float32, device=amax.device)
    a = amax.float().clamp_min(AMAX_FLOOR)
    if pow2:
        bits = (a / top).view(torch.int32)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        return (e << 23).view(torch.float32), ((254 - e) << 23).view(torch.float32)
    return a / top, top / a


def _encode_ref(x: torch.Tensor, inv: torch.Tensor, fmt: str) -> torch.Tensor:
    dtype, top, _ = FORMATS[fmt]
    return (x * inv).clamp(-top, top).to(dtype)


def quantize_rows_ref(x_MC: torch.Tensor, fmt: str = "e4m3fn", pow2: bool = False) -> Fp8Rows:
    """Reference of :func:`quantize_rows` (torch ops, any device)."""
    M, C = x_MC.shape
    Cb = -(-C // GROUP)
    xf = torch.nn.functional.pad(x_MC.float(), (0, Cb * GROUP - C)).view(M, Cb, GROUP)
    s, inv = _scales_ref(xf.abs().amax(-1) if M else xf.new_zeros(0, Cb), fmt, pow2)
    q = _encode_ref(xf, inv[..., None], fmt).view(M, Cb * GROUP)[:, :C].contiguous()
    return Fp8Rows(q, s.t().contiguous().t())


def tile_cum_ref(offsets_E: torch.Tensor, n_rows: int, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe offsets ``[E]`` int32, ``tile_cum_E1`` ``[E + 1]`` int32): what the scheduler's prep
    kernel computes with BM = group (torch ops, no host sync)."""
    safe = safe_offsets_ref(offsets_E, n_rows)[0].to(torch.int64)
    bounds = torch.cat([safe, safe.new_full((1,), n_rows)])
    cnt = bounds - torch.cat([safe.new_zeros(1), bounds[:-1]])
    return safe.to(torch.int32), torch.cumsum((cnt + group - 1) // group, 0).to(torch.int32)


def quantize_cols_ref(x_MC: torch.Tensor, offsets_E: torch.Tensor, fmt: str = "e4m3fn",
                      pow2: bool = False) -> Fp8Cols:
    """Reference of :func:`quantize_cols` (torch ops; reads the offsets on the host)."""
    M, C = x_MC.shape
    E = offsets_E.shape[0]
    T = max_m_tiles(M, E, GROUP)
    safe, tile_cum = tile_cum_ref(offsets_E, M)
    q = torch.zeros(C, GROUP * T, dtype=FORMATS[fmt][0], device=x_MC.device)
    s = torch.zeros(T, C, dtype=torch.float32, device=x_MC.device)
    ends = safe.tolist()
    first = [0] + tile_cum.tolist()[:-1]
    for e in range(E):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        n_t = -(-(hi - lo) // GROUP)
        if n_t == 0:
            continue
        xe = torch.nn.functional.pad(x_MC[lo:hi].float(), (0, 0, 0, n_t * GROUP - (hi - lo)))
        xe = xe.view(n_t, GROUP, C)
        se, inv = _scales_ref(xe.abs().amax(1), fmt, pow2)
        qe = _encode_ref(xe, inv[:, None, :], fmt)  # [n_t, G, C]
        t0 = first[e]
        s[t0:t0 + n_t] = se
        q[:, GROUP * t0:GROUP * (t0 + n_t)] = qe.reshape(n_t * GROUP, C).t()
    return Fp8Cols(q, s, tile_cum, safe, M)


def quantize_both_ref(x_MC: torch.Tensor, offsets_E: torch.Tensor, fmt: str = "e4m3fn",
                      pow2: bool = False) -> tuple[Fp8Rows, Fp8Cols]:
    """Reference of :func:`quantize_both`: ``(quantize_rows_ref(x), quantize_cols_ref(x, offsets))``."""
    return quantize_rows_ref(x_MC, fmt, pow2), quantize_cols_ref(x_MC, offsets_E, fmt, pow2)


def quantize_cols_from_rows_ref(rows: Fp8Rows, offsets_E: torch.Tensor, dtype: torch.dtype, fmt: str = "e4m3fn",
                                pow2: bool = False) -> Fp8Cols:
    """Reference of :func:`quantize_cols_from_rows`, its definition: ``quantize_cols_ref`` of the
    rows dequantized to ``dtype`` (the fp32 product ``q * s`` rounded once; torch ops, reads the
    offsets on the host)."""
    return quantize_cols_ref(dequantize_rows(rows, torch.float32).to(dtype), offsets_E, fmt, pow2)


def quantize_weight_ref(w_EDF: torch.Tensor, fmt: str = "e4m3fn", pow2: bool = False) -> Fp8Weight:
    """Reference of :func:`quantize_weight` (torch ops, any device)."""
    E, D, F = w_EDF.shape
    Db, Fb = -(-D // GROUP), -(-F // GROUP)
    wf = torch.nn.functional.pad(w_EDF.float(), (0, Fb * GROUP - F, 0, Db * GROUP - D))
    wf = wf.view(E, Db, GROUP, Fb, GROUP)
    amax = wf.abs().amax(dim=(2, 4)) if E * D * F else wf.new_zeros(E, Db, Fb)
    s, inv = _scales_ref(amax, fmt, pow2)  # [E, Db, Fb]
    q = _encode_ref(wf, inv[:, :, None, :, None], fmt).view(E, Db * GROUP, Fb * GROUP)[:, :D, :F]
    return Fp8Weight(q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous(), q.contiguous(), s, fmt)


# --- dequantization (tests, the reference GEMMs) ----------------------------------------------------


def dequantize_rows(r: Fp8Rows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[M, C]`` in ``dtype``: ``q * s`` (exact in float64; one rounding in float32)."""
    C = r.q_MC.shape[1]
    return r.q_MC.to(dtype) * r.s_MCb.to(dtype).repeat_interleave(GROUP, dim=1)[:, :C]


def dequantize_rows_rounded(r: Fp8Rows, dtype: torch.dtype, *, _launch: Optional[dict] = None) -> torch.Tensor:
    """``[M, C]`` in ``dtype`` (bf16 / fp16 / fp32): the fp32 product ``q * s`` rounded once --
    ``dequantize_rows(r, float32).to(dtype)`` bit for bit, in one kernel on a GPU (e4m3fn) instead
    of an fp32 ``[M, C]`` temporary. ``_launch``: the kernel's meta-parameter overrides (a sweep's)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    q = r.q_MC
    from tlx import triton_available

    if not (q.is_cuda and q.dtype == torch.float8_e4m3fn and triton_available()) or interpret_mode():
        return dequantize_rows(r, torch.float32).to(dtype)
    from tlx.common.fp8_quant import _dequant_rows_kernel

    M, C = q.shape
    y = torch.empty(M, C, dtype=dtype, device=q.device)
    s = r.s_MCb.t()
    if not s.is_contiguous():
        s = s.contiguous()
    if M and C:
        meta = launch_meta(_DEQUANT_ROWS_LAUNCH, _launch)
        _dequant_rows_kernel[(-(-M // meta["BLOCK_M"]), -(-C // GROUP))](q.view(torch.uint8), s, y, M, C, q.stride(0),
                                                                        M, C, G=GROUP, **meta)
    return y


def dequantize_cols(c: Fp8Cols, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[M, C]`` in ``dtype`` from an :class:`Fp8Cols` (rows outside every expert are zero)."""
    C = c.q_CP.shape[0]
    x = torch.zeros(c.n_rows, C, dtype=dtype, device=c.q_CP.device)
    ends = c.offsets_E.tolist()
    first = [0] + c.tile_cum_E1.tolist()[:-1]
    for e in range(len(ends)):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        if hi <= lo:
            continue
        n_t = -(-(hi - lo) // GROUP)
        t0 = first[e]
        q = c.q_CP[:, GROUP * t0:GROUP * (t0 + n_t)].to(dtype).t()  # [n_t * G, C]
        sc = c.s_TC[t0:t0 + n_t].to(dtype).repeat_interleave(GROUP, dim=0)
        x[lo:hi] = (q * sc)[:hi - lo]
    return x


def dequantize_weight(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[E, D, F]`` in ``dtype`` from the dX layout (``q_EDF``, ``s_EDbFb``)."""
    E, D, F = w.q_EDF.shape
    s = w.s_EDbFb.to(dtype).repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)[:, :D, :F]
    return w.q_EDF.to(dtype) * s


# --- kernels -----------------------------------------------------------------------------------------


def quantize_rows(x_MC: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                  backend: Optional[str] = None, _launch: Optional[dict] = None) -> Fp8Rows:
    """Quantize each row in 1 x 128 tiles along the columns.

    Args:
        x_MC: ``[M, C]`` bf16 / fp16 / fp32, unit column stride on the kernel path (else copied).
        fmt: ``"e4m3fn"`` (NVIDIA) or ``"e4m3fnuz"`` (AMD MI300).
        pow2: power-of-two scales (exact e8m0; MXFP8-compatible).
        backend: None (kernel where it runs, else the reference), ``"triton"`` or ``"reference"``.
        _launch: private, the kernel's meta-parameter overrides (a launch-config sweep's; None: the
            wrapper's constants). The same on every wrapper here.
    Returns:
        :class:`Fp8Rows` (q ``[M, C]`` fp8, s ``[M, Cb]`` fp32, M-contiguous).
    """
    _check_input("x_MC", x_MC, 2)
    check_fmt(fmt)
    if not _use_kernels(x_MC, backend):
        return quantize_rows_ref(x_MC, fmt, pow2)
    from tlx.common.fp8_quant import _quant_rows_kernel

    if x_MC.stride(1) != 1:
        x_MC = x_MC.contiguous()
    M, C = x_MC.shape
    Cb = -(-C // GROUP)
    q, s = empty_rows(M, C, fmt, x_MC.device)
    if M and C:
        meta = launch_meta(_ROWS_LAUNCH, _launch)
        _quant_rows_kernel[(-(-M // meta["BLOCK_M"]), Cb)](x_MC, q.view(torch.uint8), s, M, C, x_MC.stride(0), C, M,
                                                          G=GROUP, FMT=FORMATS[fmt][2], POW2=pow2,
                                                          EMULATE=emulate(fmt), **meta)
    return Fp8Rows(q, s.t())


def quantize_cols(x_MC: torch.Tensor, offsets_E: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                  backend: Optional[str] = None, _launch: Optional[dict] = None) -> Fp8Cols:
    """Quantize ``x_MC`` transposed, in tiles of 128 rows that start at each expert's first row.

    Args:
        x_MC: ``[M, C]`` rows in expert-major order (bf16 / fp16 / fp32).
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (guarded on the device like the grouped
            GEMM's: clamped into ``[0, M]`` and made non-decreasing; see grouped_gemm/guard.py).
        fmt, pow2, backend, _launch: as :func:`quantize_rows`.
    Returns:
        :class:`Fp8Cols` (q ``[C, P]`` fp8, s ``[T, C]`` fp32, the tile cumsum and the safe offsets).
    """
    _check_input("x_MC", x_MC, 2)
    check_fmt(fmt)
    check_offsets(offsets_E, x_MC, "x_MC")
    if not _use_kernels(x_MC, backend):
        return quantize_cols_ref(x_MC, offsets_E, fmt, pow2)
    from tlx.common.fp8_quant import _quant_cols_kernel

    if x_MC.stride(1) != 1:
        x_MC = x_MC.contiguous()
    M, C = x_MC.shape
    E = offsets_E.shape[0]
    T, safe, tile_cum = tile_grid(offsets_E, M)
    q, s = empty_cols(C, T, fmt, x_MC.device)
    if C:
        meta = launch_meta(_COLS_LAUNCH, _launch)
        _quant_cols_kernel[(T, -(-C // meta["BLOCK_C"]))](x_MC, q.view(torch.uint8), s, safe, tile_cum, E, M, C,
                                                         x_MC.stride(0), GROUP * T, G=GROUP, FMT=FORMATS[fmt][2],
                                                         POW2=pow2, EMULATE=emulate(fmt),
                                                         SEARCH_STEPS=search_steps(E), **meta)
    return Fp8Cols(q, s, tile_cum, safe, M)


def tile_grid(offsets_E: torch.Tensor, n_rows: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(T, safe_E, tile_cum_E1)`` of the expert-aligned G-row tiles (on the device, no sync)."""
    from ..grouped_gemm.host import prep_offsets

    safe, tile_cum = prep_offsets(offsets_E, n_rows, GROUP)  # clamped on the device, flagged (guard.py)
    return max_m_tiles(n_rows, offsets_E.shape[0], GROUP), safe, tile_cum


def empty_rows(M: int, C: int, fmt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``q_MC`` [M, C] (fp8) and ``s`` [Cb, M] (fp32): a row quantization's storage."""
    return (torch.empty(M, C, dtype=FORMATS[fmt][0], device=device),
            torch.empty(-(-C // GROUP), M, dtype=torch.float32, device=device))


def empty_cols(C: int, T: int, fmt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``q_CP`` [C, G*T] (fp8) and ``s_TC`` [T, C] (fp32): a column quantization's storage."""
    return (torch.empty(C, GROUP * T, dtype=FORMATS[fmt][0], device=device),
            torch.empty(T, C, dtype=torch.float32, device=device))


def empty_rows_cols(M: int, C: int, T: int, fmt: str, device) -> tuple[torch.Tensor, ...]:
    """Uninitialized ``q_MC`` [M, C], ``s`` [Cb, M], ``q_CP`` [C, G*T], ``s_TC`` [T, C] (fp8 / fp32)."""
    return empty_rows(M, C, fmt, device) + empty_cols(C, T, fmt, device)


def quantize_both(x_MC: torch.Tensor, offsets_E: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                  backend: Optional[str] = None, _launch: Optional[dict] = None) -> tuple[Fp8Rows, Fp8Cols]:
    """:func:`quantize_rows` and :func:`quantize_cols` of ``x_MC`` from one read of it, bit for bit
    equal to the two (every row gets its row quantization, padding rows past ``offsets_E[-1]``
    included; only the experts' tiles get the column form).

    Args:
        x_MC: ``[M, C]`` rows in expert-major order (bf16 / fp16 / fp32).
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (guarded on the device, as
            :func:`quantize_cols`).
        fmt, pow2, backend, _launch: as :func:`quantize_rows`.
    Returns:
        ``(Fp8Rows, Fp8Cols)``: q ``[M, C]`` fp8 + s ``[M, Cb]`` fp32 (M-contiguous); q ``[C, P]``
        fp8 + s ``[T, C]`` fp32, the tile cumsum and the safe offsets.
    """
    _check_input("x_MC", x_MC, 2)
    check_fmt(fmt)
    check_offsets(offsets_E, x_MC, "x_MC")
    if not _use_kernels(x_MC, backend):
        return quantize_both_ref(x_MC, offsets_E, fmt, pow2)
    from tlx.common.fp8_quant import _quant_both_kernel

    if x_MC.stride(1) != 1:
        x_MC = x_MC.contiguous()
    M, C = x_MC.shape
    E = offsets_E.shape[0]
    T, safe, tile_cum = tile_grid(offsets_E, M)
    q, s, qc, sc = empty_rows_cols(M, C, T, fmt, x_MC.device)
    if C:
        _quant_both_kernel[(T, -(-C // GROUP))](x_MC, q.view(torch.uint8), s, qc.view(torch.uint8), sc, safe, tile_cum,
                                               E, M, C, x_MC.stride(0), C, M, GROUP * T, G=GROUP,
                                               FMT=FORMATS[fmt][2], POW2=pow2, EMULATE=emulate(fmt),
                                               SEARCH_STEPS=search_steps(E), **launch_meta(_BOTH_LAUNCH, _launch))
    return Fp8Rows(q, s.t()), Fp8Cols(qc, sc, tile_cum, safe, M)


def check_rows(rows, name: str = "rows") -> None:
    """``rows`` must be an :class:`Fp8Rows`: ``q_MC`` 2-D e4m3fn / e4m3fnuz, ``s_MCb`` fp32
    ``[M, cdiv(C, 128)]`` on its device."""
    if not isinstance(rows, Fp8Rows):
        raise TypeError(f"{name} must be an Fp8Rows (quantize_rows / dispatch_fp8), got {type(rows).__name__}")
    q, s = rows.q_MC, rows.s_MCb
    if q.dim() != 2 or q.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise ValueError(f"{name}.q_MC must be a 2-D e4m3fn / e4m3fnuz tensor, got {tuple(q.shape)} {q.dtype}")
    M, C = q.shape
    if tuple(s.shape) != (M, -(-C // GROUP)) or s.dtype != torch.float32 or s.device != q.device:
        raise ValueError(f"{name}.s_MCb must be fp32 [{M}, {-(-C // GROUP)}] on {q.device} to match q_MC "
                         f"{(M, C)}, got {tuple(s.shape)} {s.dtype} on {s.device}")


def quantize_cols_from_rows(rows: Fp8Rows, offsets_E: torch.Tensor, *, dtype: torch.dtype, fmt: str = "e4m3fn",
                            pow2: bool = False, backend: Optional[str] = None,
                            _launch: Optional[dict] = None) -> Fp8Cols:
    """:func:`quantize_cols` of ``dequantize_rows_rounded(rows, dtype)``, bit for bit, straight from
    the FP8 rows: each value the fp32 product ``q * s`` rounded once to ``dtype``, then quantized
    in the expert-aligned 128-row tiles -- one read of the rows' bytes, no ``[M, C]`` tensor in
    ``dtype`` written or read (the weight gradient's operand of an FP8 dispatch's rows).

    Args:
        rows: :class:`Fp8Rows` of ``[M, C]`` (e4m3fn / e4m3fnuz; ``q_MC`` any row stride, e.g. the
            packed dispatch rows' view; ``s_MCb`` any strides, e.g. ``[Cb, M]`` storage).
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (guarded on the device, as
            :func:`quantize_cols`).
        dtype: the dequantized rows' dtype (bf16 / fp16 / fp32: the activation dtype).
        fmt, pow2, backend, _launch: of the column quantization, as :func:`quantize_rows`
            (``_launch["BLOCK_C"]`` must divide 128).
    Returns:
        :class:`Fp8Cols` (q ``[C, P]`` fp8, s ``[T, C]`` fp32, the tile cumsum and the safe offsets).
    """
    check_rows(rows)
    if dtype not in _IN_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    check_fmt(fmt)
    q = rows.q_MC
    check_offsets(offsets_E, q, "rows.q_MC")
    if not _use_kernels(q, backend):
        return quantize_cols_from_rows_ref(rows, offsets_E, dtype, fmt, pow2)
    import triton.language as tl

    from tlx.common.fp8_quant import _quant_cols_from_rows_kernel

    if q.stride(1) != 1:
        q = q.contiguous()
    s = rows.s_MCb
    M, C = q.shape
    E = offsets_E.shape[0]
    in_fmt = "e4m3fn" if q.dtype == torch.float8_e4m3fn else "e4m3fnuz"
    T, safe, tile_cum = tile_grid(offsets_E, M)
    qc, sc = empty_cols(C, T, fmt, q.device)
    if C:
        meta = launch_meta(_COLS_FROM_ROWS_LAUNCH, _launch)
        if GROUP % meta["BLOCK_C"]:  # a program's columns must share one scale of each row
            raise ValueError(f"_launch BLOCK_C={meta['BLOCK_C']} must divide {GROUP}")
        dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
        _quant_cols_from_rows_kernel[(T, -(-C // meta["BLOCK_C"]))](
            q.view(torch.uint8), s, qc.view(torch.uint8), sc, safe, tile_cum, E, M, C, q.stride(0), s.stride(0),
            s.stride(1), GROUP * T, G=GROUP, IN_FMT=FORMATS[in_fmt][2], FMT=FORMATS[fmt][2], POW2=pow2, DTYPE=dt,
            EMULATE_IN=emulate(in_fmt), EMULATE=emulate(fmt), SEARCH_STEPS=search_steps(E), **meta)
    return Fp8Cols(qc, sc, tile_cum, safe, M)


def quantize_weight(w_EDF: torch.Tensor, *, fmt: str = "e4m3fn", pow2: bool = False,
                    backend: Optional[str] = None) -> Fp8Weight:
    """Quantize per-expert weights in 128 x 128 blocks, in both GEMM layouts.

    Args:
        w_EDF: ``[E, D, F]`` (bf16 / fp16 / fp32; unit last stride on the kernel path, else copied).
        fmt, pow2, backend: as :func:`quantize_rows`.
    Returns:
        :class:`Fp8Weight`.
    """
    _check_input("w_EDF", w_EDF, 3)
    check_num_experts(w_EDF.shape[0], f"w_EDF of shape {tuple(w_EDF.shape)}")
    check_fmt(fmt)
    if not _use_kernels(w_EDF, backend):
        return quantize_weight_ref(w_EDF, fmt, pow2)
    from tlx.common.fp8_quant import _quant_blocks_kernel

    if w_EDF.stride(2) != 1:
        w_EDF = w_EDF.contiguous()
    E, D, F = w_EDF.shape
    Db, Fb = -(-D // GROUP), -(-F // GROUP)
    dt = FORMATS[fmt][0]
    q = torch.empty(E, D, F, dtype=dt, device=w_EDF.device)
    qt = torch.empty(E, F, D, dtype=dt, device=w_EDF.device)
    s = torch.empty(E, Db, Fb, dtype=torch.float32, device=w_EDF.device)
    st = torch.empty(E, Fb, Db, dtype=torch.float32, device=w_EDF.device)
    if D and F:
        _quant_blocks_kernel[(Db, Fb, E)](w_EDF, q.view(torch.uint8), qt.view(torch.uint8), s, st, D, F,
                                         w_EDF.stride(0), w_EDF.stride(1), G=GROUP, FMT=FORMATS[fmt][2], POW2=pow2,
                                         EMULATE=emulate(fmt), num_warps=8)
    return Fp8Weight(qt, st, q, s, fmt)
