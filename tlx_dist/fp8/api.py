"""FP8 grouped GEMMs with autograd, registered as torch custom ops; backend choice; weight cache.

Legend: N rows in expert-major order, D input features, F output features, E experts,
``offsets_E`` cumulative end row of each expert (int32 / int64, on the operands' device).

    cache = Fp8WeightCache()                       # one per weight; requantizes when it changes
    y_NF = grouped_mm_fp8(x_ND, w_EDF, offsets_E, w_fp8=cache.get(w_EDF))
    dw_EDF = grouped_mm_fp8_wgrad(x_ND, dy_NF, offsets_E)

Forward: ``x`` is quantized in 1 x 128 tiles along D, ``w`` in 128 x 128 blocks (DeepSeek-V3's
recipe, tlx_dist/fp8/quant.py), and the GEMM runs e4m3 x e4m3 with fp32 accumulation promoted every
128-wide k-step. Backward: ``dx = dy @ w^T`` with ``dy`` quantized along F and the weight's other
stored layout; ``dw[e] = x[rows e]^T @ dy[rows e]`` with both quantized in 128-row tiles along the
expert's rows. The master weight ``w_EDF`` is never read by the GEMMs (only its FP8 copy is); it
receives ``dw`` in its own dtype. Output dtype = ``x.dtype``; rows past ``offsets_E[-1]`` are zero.

Backends (``backend=``, or automatic):
  ``"tlx"``       the TLX Hopper kernel (tlx/hopper/fp8_grouped_gemm.py): sm_90 with fbtriton.
  ``"torch"``     torch's FP8 tensor-core path (``torch._scaled_mm`` per expert and k-group) on the
                  same quantized operands: other GPUs with FP8 tensor cores (sm_89+); syncs the host.
  ``"reference"`` dequantize + fp32 matmul (any device, any shape): the CPU fallback.
Automatic: CPU tensors -> reference; CUDA sm_90 with TLX -> tlx; CUDA sm_89+ -> torch. A GPU
without FP8 tensor cores, a ROCm device (the e4m3fnuz kernel, tlx/amd/fp8_grouped_gemm.py, is
compile-checked only) and shapes the GPU paths cannot take are a ValueError naming ``precision``
or the argument -- never a silent bf16 fallback.
"""

from __future__ import annotations

from typing import Optional

import torch

import tlx

from ..grouped_gemm.api import _check_offsets_values
from ..grouped_gemm.eager import custom_op
from ..grouped_gemm.reference import check_num_experts
from .quant import (FORMATS, Fp8Cols, Fp8Rows, Fp8Weight, is_values_placeholder, quantize_both, quantize_cols,
                    quantize_cols_from_rows, quantize_rows, quantize_weight)
from .reference import mm_fp8_ref, mm_fp8_torch, wgrad_fp8_ref, wgrad_fp8_torch
from .tlx_gemm import Fp8GemmConfig

__all__ = ["BACKENDS", "grouped_mm_fp8", "grouped_mm_fp8_wgrad", "mm_fp8", "wgrad_fp8", "select_fp8_backend",
           "Fp8WeightCache"]

BACKENDS = ("tlx", "torch", "reference")
_OUT = (torch.bfloat16, torch.float16)


# --- backend choice ---------------------------------------------------------------------------------


def _gpu_reason(device: torch.device) -> Optional[str]:
    """Why FP8 GEMMs cannot run on this CUDA / ROCm device, or None."""
    if getattr(torch.version, "hip", None):
        return ("ROCm has no FP8 host path yet (the e4m3fnuz kernel, tlx/amd/fp8_grouped_gemm.py, is compile-checked "
                "only)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}) has no FP8 tensor cores (they start at sm_89: "
                "Ada, Hopper, Blackwell); use precision='bf16'")
    return None


def _shape_reason(K: int, NN: int, what: str) -> Optional[str]:
    if K % 16 or NN % 16:
        return (f"{what}: the FP8 GPU kernels need both dims to be multiples of 16 (16-byte aligned fp8 rows for "
                f"TMA / cuBLAS), got {K} and {NN}; pad the feature dims or use precision='bf16'")
    return None


def runs_reference(device: torch.device, backend: Optional[str]) -> bool:
    """Whether :func:`select_fp8_backend` picks the torch reference for ``backend`` on ``device``
    (pinned, or the automatic choice on CPU), without its shape and device checks."""
    return backend == "reference" or (backend is None and device.type == "cpu")


def select_fp8_backend(device: torch.device, K: int, NN: int, backend: Optional[str] = None,
                       what: str = "the GEMM's (K, NN)") -> str:
    """The FP8 backend for operands on ``device`` with reduction K and output width NN: the pinned
    one if it can run them (else ValueError saying why), or the automatic choice (module docstring)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS} or None")
    if runs_reference(device, backend):
        return "reference"
    if device.type == "cpu":
        if backend == "torch":
            return backend  # torch._scaled_mm runs on CPU too (tests)
        raise ValueError(f"precision='fp8' backend={backend!r} needs a CUDA device, got {device}")
    if device.type != "cuda":
        raise ValueError(f"precision='fp8' is not supported on device {device}")
    why = _gpu_reason(device) or _shape_reason(K, NN, what)
    if why is not None:
        raise ValueError(f"precision='fp8': {why}")
    tlx_ok = tlx.tlx_available() and tlx.gpu_arch() == "sm_90"
    if backend == "tlx" and not tlx_ok:
        raise ValueError(f"precision='fp8' backend='tlx' needs sm_90 with fbtriton (here: {tlx.describe()})")
    if backend is not None:
        return backend
    return "tlx" if tlx_ok else "torch"


# --- custom ops on quantized operands ---------------------------------------------------------------
# Backend names (and a pinned tile config, as JSON) travel as strings so that torch.compile / CUDA
# graphs see one opaque op per call. Eager calls run the bodies directly, without the op's dispatch
# layers; anything that traces gets the op (tlx_dist/grouped_gemm/eager.py).


def _config_json(config: Optional[Fp8GemmConfig]) -> str:
    if config is None:
        return ""
    if not isinstance(config, Fp8GemmConfig):
        raise TypeError(f"config must be an Fp8GemmConfig (tlx_dist.fp8.tlx_gemm) or None, got {type(config).__name__}"
                        " (precision='fp8' takes the FP8 kernel's tile configs)")
    return config.to_json()


def _quant_backend(backend: str) -> Optional[str]:
    return "reference" if backend == "reference" else None


# Fake outputs from shapes only, for an [M, C] tensor (T = M // 128 + E + 1 bounds the expert-aligned tiles).
def _rows_fake(x_MC, M, C):
    return x_MC.new_empty(M, C, dtype=torch.float8_e4m3fn), x_MC.new_empty(-(-C // 128), M, dtype=torch.float32)


def _cols_fake(x_MC, offsets_E, M, C):
    E = offsets_E.shape[0]
    T = M // 128 + E + 1
    return (x_MC.new_empty(C, 128 * T, dtype=torch.float8_e4m3fn), x_MC.new_empty(T, C, dtype=torch.float32),
            offsets_E.new_empty(E + 1, dtype=torch.int32), offsets_E.new_empty(E, dtype=torch.int32))


@custom_op("tlx_dist::fp8_quantize_rows")
def _quant_rows_op(x_MC: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    r = quantize_rows(x_MC, backend=_quant_backend(backend))
    return r.q_MC, r.s_MCb.t().contiguous()


@_quant_rows_op.register_fake
def _(x_MC, backend):
    return _rows_fake(x_MC, *x_MC.shape)


@custom_op("tlx_dist::fp8_quantize_cols")
def _quant_cols_op(x_MC: torch.Tensor, offsets_E: torch.Tensor, backend: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    c = quantize_cols(x_MC, offsets_E, backend=_quant_backend(backend))
    return c.q_CP, c.s_TC, c.tile_cum_E1, c.offsets_E


@_quant_cols_op.register_fake
def _(x_MC, offsets_E, backend):
    return _cols_fake(x_MC, offsets_E, *x_MC.shape)


@custom_op("tlx_dist::fp8_quantize_cols_from_rows")
def _quant_cols_from_rows_op(x_q: torch.Tensor, x_s_CbN: torch.Tensor, offsets_E: torch.Tensor, dtype: torch.dtype,
                             backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # _quant_cols_op's four outputs for x = the rows (q [N, D], s [Cb, N]) dequantized to dtype, bit
    # for bit, made from the rows themselves (no [N, D] x read)
    c = quantize_cols_from_rows(Fp8Rows(x_q, x_s_CbN.t()), offsets_E, dtype=dtype, backend=_quant_backend(backend))
    return c.q_CP, c.s_TC, c.tile_cum_E1, c.offsets_E


@_quant_cols_from_rows_op.register_fake
def _(x_q, x_s_CbN, offsets_E, dtype, backend):
    return _cols_fake(x_q, offsets_E, *x_q.shape)


@custom_op("tlx_dist::fp8_quantize_both")
def _quant_both_op(x_MC: torch.Tensor, offsets_E: torch.Tensor, backend: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # _quant_rows_op's two outputs then _quant_cols_op's four, from one read of x
    r, c = quantize_both(x_MC, offsets_E, backend=_quant_backend(backend))
    return r.q_MC, r.s_MCb.t().contiguous(), c.q_CP, c.s_TC, c.tile_cum_E1, c.offsets_E


@_quant_both_op.register_fake
def _(x_MC, offsets_E, backend):
    return _rows_fake(x_MC, *x_MC.shape) + _cols_fake(x_MC, offsets_E, *x_MC.shape)


@custom_op("tlx_dist::fp8_mm")
def _mm_op(a_q: torch.Tensor, a_s_CbN: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, offsets_E: torch.Tensor,
           out_dtype: torch.dtype, backend: str, config: str = "") -> torch.Tensor:
    # config: a pinned Fp8GemmConfig as JSON ("" = the host's default), read by the tlx backend only
    a = Fp8Rows(a_q, a_s_CbN.t())
    if backend == "tlx":
        from .tlx_gemm import config_from_json, mm_fp8_tlx

        return mm_fp8_tlx(a_q, a.s_MCb, b_q, b_s, offsets_E, out_dtype, cfg=config_from_json(config))
    if backend == "torch":
        return mm_fp8_torch(a, b_q, b_s, offsets_E, out_dtype)
    return mm_fp8_ref(a, b_q, b_s, offsets_E).to(out_dtype)


@_mm_op.register_fake
def _(a_q, a_s_CbN, b_q, b_s, offsets_E, out_dtype, backend, config=""):
    return a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=out_dtype)


@custom_op("tlx_dist::fp8_wgrad")
def _wgrad_op(x_q: torch.Tensor, x_s: torch.Tensor, dy_q: torch.Tensor, dy_s: torch.Tensor, tile_cum_E1: torch.Tensor,
              safe_E: torch.Tensor, n_rows: int, out_dtype: torch.dtype, backend: str, config: str = "") -> torch.Tensor:
    xc = Fp8Cols(x_q, x_s, tile_cum_E1, safe_E, n_rows)
    dyc = Fp8Cols(dy_q, dy_s, tile_cum_E1, safe_E, n_rows)
    if backend == "tlx":
        from .tlx_gemm import config_from_json, wgrad_fp8_tlx

        return wgrad_fp8_tlx(xc, dyc, out_dtype, cfg=config_from_json(config))
    if backend == "torch":
        return wgrad_fp8_torch(xc, dyc, out_dtype)
    return wgrad_fp8_ref(xc, dyc).to(out_dtype)


@_wgrad_op.register_fake
def _(x_q, x_s, dy_q, dy_s, tile_cum_E1, safe_E, n_rows, out_dtype, backend, config=""):
    return x_q.new_empty(safe_E.shape[0], x_q.shape[0], dy_q.shape[0], dtype=out_dtype)


def mm_fp8(a: Fp8Rows, b_q: torch.Tensor, b_s: torch.Tensor, offsets_E: torch.Tensor, *,
           out_dtype: torch.dtype = torch.bfloat16, backend: Optional[str] = None,
           config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """Grouped GEMM on quantized operands (no autograd): ``y[rows e] = dequant(a)[rows e] @ dequant(b[e])^T``.

    Args:
        a: :class:`Fp8Rows` of ``[N, K]`` (e.g. rows quantized where they were produced).
        b_q: ``[E, NN, K]`` e4m3 (``Fp8Weight.q_EFD`` for the forward, ``q_EDF`` for dX); b_s:
            ``[E, NNb, Kb]`` fp32 (``s_EFbDb`` / ``s_EDbFb``).
        offsets_E: ``[E]`` cumulative end rows.
        config: pin the TLX kernel's :class:`~tlx_dist.fp8.tlx_gemm.Fp8GemmConfig` (tlx backend).
    Returns:
        ``[N, NN]`` in ``out_dtype`` (bf16 / fp16); rows past ``offsets_E[-1]`` are zero.
    """
    N, K = a.q_MC.shape
    if b_q.dim() != 3 or b_q.shape[2] != K or b_s.shape[0] != b_q.shape[0]:
        raise ValueError(f"b_q {tuple(b_q.shape)} / b_s {tuple(b_s.shape)} do not match a of shape {(N, K)} "
                         "(b_q must be [E, NN, K])")
    if offsets_E.shape != (b_q.shape[0],):
        raise ValueError(f"offsets_E has shape {tuple(offsets_E.shape)}, expected ({b_q.shape[0]},) (E of b_q)")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype={out_dtype} must be bfloat16 or float16")
    name = select_fp8_backend(a.q_MC.device, K, b_q.shape[1], backend, f"(K, NN) = ({K}, {b_q.shape[1]})")
    return _mm_op(a.q_MC, a.s_MCb.t(), b_q, b_s, offsets_E, out_dtype, name, _config_json(config))


def wgrad_fp8(x: Fp8Cols, dy: Fp8Cols, *, out_dtype: torch.dtype = torch.bfloat16,
              backend: Optional[str] = None, config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """Weight gradient on quantized operands (no autograd): ``dw[e] = dequant(x)[rows e]^T @ dequant(dy)[rows e]``.
    ``x`` and ``dy`` must come from :func:`quantize_cols` with the same offsets. Returns ``[E, D, F]``."""
    if x.n_rows != dy.n_rows or x.offsets_E.shape != dy.offsets_E.shape or x.q_CP.shape[1] != dy.q_CP.shape[1]:
        raise ValueError("x and dy must be quantize_cols() of the same rows and offsets")
    if out_dtype not in _OUT + (torch.float32,):
        raise ValueError(f"out_dtype={out_dtype} must be bfloat16, float16 or float32")
    D, F = x.q_CP.shape[0], dy.q_CP.shape[0]
    name = select_fp8_backend(x.q_CP.device, D, F, backend, f"(D, F) = ({D}, {F})")
    return _wgrad_op(x.q_CP, x.s_TC, dy.q_CP, dy.s_TC, x.tile_cum_E1, x.offsets_E, x.n_rows, out_dtype, name,
                     _config_json(config))


# --- the differentiable op ----------------------------------------------------------------------------


@custom_op("tlx_dist::grouped_mm_fp8")
def _grouped_mm_fp8_op(x_ND: torch.Tensor, w_EDF: torch.Tensor, q_EFD: torch.Tensor, s_EFbDb: torch.Tensor,
                       q_EDF: torch.Tensor, s_EDbFb: torch.Tensor, offsets_E: torch.Tensor, backend: str,
                       config: str = "", x_q: Optional[torch.Tensor] = None,
                       x_s_CbN: Optional[torch.Tensor] = None) -> torch.Tensor:
    # w_EDF is here for autograd only (it receives dW); the GEMM reads its FP8 copy. x_q / x_s_CbN:
    # x's rows already quantized (an FP8 dispatch delivered them): the forward reads them instead.
    if x_q is None:
        x_q, x_s_CbN = _quant_rows_op(x_ND, backend)
    return _mm_op(x_q, x_s_CbN, q_EFD, s_EFbDb, offsets_E, x_ND.dtype, backend, config)


@_grouped_mm_fp8_op.register_fake
def _(x_ND, w_EDF, q_EFD, s_EFbDb, q_EDF, s_EDbFb, offsets_E, backend, config="", x_q=None, x_s_CbN=None):
    return x_ND.new_empty(x_ND.shape[0], w_EDF.shape[2])


def _setup_context(ctx, inputs, output):
    x_ND, w_EDF, _, _, q_EDF, s_EDbFb, offsets_E, backend, config, _, _ = inputs
    ctx.save_for_backward(x_ND, q_EDF, s_EDbFb, offsets_E)
    ctx.backend = backend
    ctx.config = config
    ctx.w_dtype = w_EDF.dtype


def _backward(ctx, dy_NF):
    x_ND, q_EDF, s_EDbFb, offsets_E = ctx.saved_tensors
    dx = dw = None
    dy_NF = dy_NF.contiguous()
    need_x, need_w = ctx.needs_input_grad[:2]
    if need_x and need_w:  # dy's two forms from one read of it
        q, s, dyq, dys, _, _ = _quant_both_op(dy_NF, offsets_E, ctx.backend)
    elif need_x:
        q, s = _quant_rows_op(dy_NF, ctx.backend)
    elif need_w:
        dyq, dys, _, _ = _quant_cols_op(dy_NF, offsets_E, ctx.backend)
    if need_x:
        dx = _mm_op(q, s, q_EDF, s_EDbFb, offsets_E, dy_NF.dtype, ctx.backend, ctx.config)
    if need_w:
        xq, xs, tile_cum, safe = _quant_cols_op(x_ND, offsets_E, ctx.backend)
        out = ctx.w_dtype if ctx.w_dtype in _OUT + (torch.float32,) else torch.float32
        dw = _wgrad_op(xq, xs, dyq, dys, tile_cum, safe, x_ND.shape[0], out, ctx.backend,
                       ctx.config).to(ctx.w_dtype)
    return dx, dw, None, None, None, None, None, None, None, None, None


_grouped_mm_fp8_op.register_autograd(_backward, setup_context=_setup_context)


def _check_args(x_ND, w_EDF, offsets_E, w_fp8) -> None:
    for name, t in (("x_ND", x_ND), ("w_EDF", w_EDF), ("offsets_E", offsets_E)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x_ND.dim() != 2:
        raise ValueError(f"x_ND must be 2-D [N, D], got shape {tuple(x_ND.shape)}")
    if w_EDF.dim() != 3:
        raise ValueError(f"w_EDF must be 3-D [E, D, F], got shape {tuple(w_EDF.shape)}")
    check_num_experts(w_EDF.shape[0], f"w_EDF of shape {tuple(w_EDF.shape)}")
    if x_ND.shape[1] != w_EDF.shape[1]:
        raise ValueError(f"x_ND has D={x_ND.shape[1]} columns but w_EDF expects D={w_EDF.shape[1]}")
    if x_ND.dtype not in _OUT + (torch.float32,):
        raise TypeError(f"x_ND must be bfloat16, float16 or float32, got {x_ND.dtype}")
    if offsets_E.dim() != 1 or offsets_E.shape[0] != w_EDF.shape[0]:
        raise ValueError(f"offsets_E must be 1-D [E={w_EDF.shape[0]}], got shape {tuple(offsets_E.shape)}")
    if offsets_E.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets_E must be int32 or int64, got {offsets_E.dtype}")
    devs = {x_ND.device, w_EDF.device, offsets_E.device}
    if len(devs) != 1:
        raise ValueError(f"x_ND, w_EDF and offsets_E must be on one device, got {sorted(map(str, devs))}")
    _check_offsets_values(offsets_E, x_ND.shape[0])  # on CPU (and with TLX_DIST_CHECK_OFFSETS=1): raises
    if w_fp8 is not None:
        _check_w_fp8(w_fp8, w_EDF)


def _check_w_fp8(w_fp8, w_EDF: torch.Tensor, name: str = "w_fp8", w_name: str = "w_EDF") -> None:
    if not isinstance(w_fp8, Fp8Weight):
        raise TypeError(f"{name} must be an Fp8Weight (Fp8WeightCache.get / quantize_weight), got {type(w_fp8).__name__}")
    if tuple(w_fp8.shape) != tuple(w_EDF.shape):
        raise ValueError(f"{name} has shape {tuple(w_fp8.shape)} but {w_name} {tuple(w_EDF.shape)}: a stale copy?")
    if w_fp8.fmt != "e4m3fn":
        raise ValueError(f"{name}.fmt={w_fp8.fmt!r}: the NVIDIA paths take e4m3fn")
    if w_fp8.q_EDF.device != w_EDF.device:
        raise ValueError(f"{name} is on {w_fp8.q_EDF.device} but {w_name} on {w_EDF.device}")


def _refuse_placeholder(x: torch.Tensor, name: str) -> None:
    if is_values_placeholder(x):
        raise ValueError(f"{name} is a values placeholder (strides (0, 0): dispatch_fp8(dequantize=False)), but this "
                         "weight gradient quantizes its values: pass the dequantized rows (dequantize=True), or use "
                         "swiglu_experts_fp8(x_fp8=...), which makes them from the FP8 rows")


def _resolve(x_ND, w_EDF, offsets_E, w_fp8, backend, config, x_fp8):
    """grouped_mm_fp8's checks and choices: ``(backend name, w_fp8, x_q, x_s_CbN)`` (the weight
    quantized here when no copy was given; x_q / x_s None unless ``x_fp8`` was)."""
    _check_args(x_ND, w_EDF, offsets_E, w_fp8)
    D, F = w_EDF.shape[1], w_EDF.shape[2]
    name = select_fp8_backend(x_ND.device, D, F, backend, f"w_EDF's (D, F) = ({D}, {F})")
    if name != "reference" and x_ND.dtype not in _OUT:
        raise TypeError(f"precision='fp8' backend={name!r}: x_ND must be bfloat16 or float16, got {x_ND.dtype}")
    if config is not None and name != "tlx":
        raise ValueError(f"config= pins the TLX FP8 kernel's tile config, but backend {name!r} runs here, which has "
                         "no tiles (pin backend='tlx' on sm_90, or drop the config)")
    x_q = x_s = None
    if x_fp8 is not None:
        if not isinstance(x_fp8, Fp8Rows):
            raise TypeError(f"x_fp8 must be an Fp8Rows (quantize_rows / dispatch_fp8), got {type(x_fp8).__name__}")
        if tuple(x_fp8.q_MC.shape) != tuple(x_ND.shape) or x_fp8.q_MC.dtype != torch.float8_e4m3fn:
            raise ValueError(f"x_fp8 must hold e4m3fn rows of x_ND's shape {tuple(x_ND.shape)}, got "
                             f"{tuple(x_fp8.q_MC.shape)} {x_fp8.q_MC.dtype}")
        if x_fp8.q_MC.device != x_ND.device or x_fp8.q_MC.stride(1) != 1:
            raise ValueError("x_fp8 must be on x_ND's device with a unit column stride")
        x_q, x_s = x_fp8.q_MC, x_fp8.s_MCb.t()
    if w_fp8 is None:
        w_fp8 = quantize_weight(w_EDF.detach(), backend=_quant_backend(name))
    return name, w_fp8, x_q, x_s


def grouped_mm_fp8(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor, *,
                   w_fp8: Optional[Fp8Weight] = None, backend: Optional[str] = None,
                   config: Optional[Fp8GemmConfig] = None, x_fp8: Optional[Fp8Rows] = None) -> torch.Tensor:
    """FP8 grouped GEMM over experts, differentiable in ``x_ND`` and ``w_EDF``.

    Args:
        x_ND: ``[N, D]`` rows grouped by expert, bf16 / fp16 (fp32: reference backend only).
        w_EDF: ``[E, D, F]`` master weights (any float dtype); receives ``dw`` in its dtype.
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (guarded on the device like
            ``grouped_mm``'s: out-of-range values are clamped and flagged, see grouped_gemm/guard.py).
        w_fp8: the weight's FP8 copy (:class:`Fp8WeightCache`, once per optimizer step); quantized
            here when None.
        backend: ``"tlx" | "torch" | "reference"`` to pin one; default automatic.
        config: pin the TLX kernel's :class:`~tlx_dist.fp8.tlx_gemm.Fp8GemmConfig` for every form
            of the call (forward, dX and dW of its backward), as given; default: the host's
            per-form default (``tlx_gemm.default_config``). Read by the tlx backend only.
        x_fp8: ``x_ND``'s rows already quantized (:class:`Fp8Rows` ``[N, D]``, e.g. from
            :func:`~tlx_dist.fp8.dispatch.dispatch_fp8`): the forward reads them instead of
            quantizing ``x_ND``, which the backward still reads (the weight gradient's operand:
            a values placeholder, ``dispatch_fp8(dequantize=False)``, is a ValueError). ``q``
            needs a unit column stride (and, on the kernel path, 16-byte aligned rows).
    Returns:
        ``[N, F]`` in ``x_ND.dtype``; rows past ``offsets_E[-1]`` are zero.
    """
    _refuse_placeholder(x_ND, "x_ND")
    name, w_fp8, x_q, x_s = _resolve(x_ND, w_EDF, offsets_E, w_fp8, backend, config, x_fp8)
    return _grouped_mm_fp8_op(x_ND, w_EDF, w_fp8.q_EFD, w_fp8.s_EFbDb, w_fp8.q_EDF, w_fp8.s_EDbFb, offsets_E, name,
                              _config_json(config), x_q, x_s)


def grouped_mm_fp8_wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor, *,
                         out_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Per-expert ``x^T @ dy`` in FP8 (both quantized in 128-row tiles along each expert's rows).

    Args:
        x_ND: ``[N, D]``; dy_NF: ``[N, F]`` (bf16 / fp16 / fp32, one device); offsets_E: ``[E]``.
        out_dtype: default ``x_ND.dtype`` (bf16 / fp16 / fp32).
    Returns:
        ``[E, D, F]``; an expert with no rows gets zeros.
    """
    for name, t in (("x_ND", x_ND), ("dy_NF", dy_NF)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor")
        _refuse_placeholder(t, name)
    if x_ND.shape[0] != dy_NF.shape[0]:
        raise ValueError(f"x_ND has N={x_ND.shape[0]} rows but dy_NF has N={dy_NF.shape[0]}")
    name = select_fp8_backend(x_ND.device, x_ND.shape[1], dy_NF.shape[1], backend,
                              f"(D, F) = ({x_ND.shape[1]}, {dy_NF.shape[1]})")
    qb = _quant_backend(name)
    return wgrad_fp8(quantize_cols(x_ND, offsets_E, backend=qb), quantize_cols(dy_NF, offsets_E, backend=qb),
                     out_dtype=out_dtype or x_ND.dtype, backend=name)


class Fp8WeightCache:
    """The FP8 copy of one weight, made once per optimizer step, not per micro-batch.

    ``get(w)`` requantizes when ``w`` changed since the last call: its version counter (bumped by
    every in-place update -- optimizer steps, ``copy_`` under ``no_grad``, ``load_state_dict``),
    storage, shape, dtype or device. Updates that bypass the version counter (writes through
    ``w.data``, torch's fused AdamW kernels) are not seen: call :meth:`invalidate` after them.

    ``get(w, generation=g)`` keys on ``g`` (and shape, dtype, device) instead of the version and
    storage: for weights whose storage is rewritten with the *same* values between optimizer steps
    -- FSDP2 all-gathers the unsharded weight again for every micro-batch (a new version each
    time) -- the caller bumps ``g`` when the values change (``MoELayer(fp8_refresh="step")``).
    Call ``get`` outside torch.compile'd regions (the version counter is not traceable)."""

    def __init__(self, *, fmt: str = "e4m3fn", pow2: bool = False, backend: Optional[str] = None):
        if fmt not in FORMATS:
            raise ValueError(f"fmt={fmt!r} must be one of {sorted(FORMATS)}")
        self.fmt, self.pow2, self.backend = fmt, pow2, backend
        self._key = None
        self._w: Optional[Fp8Weight] = None
        self.quantizations = 0  # how many times get() quantized (tests, logging)

    def get(self, w_EDF: torch.Tensor, generation: Optional[int] = None) -> Fp8Weight:
        """The FP8 copy of ``w_EDF`` ``[E, D, F]`` (an :class:`Fp8Weight`), quantized if stale."""
        if generation is None:
            key = (w_EDF._version, w_EDF.data_ptr(), tuple(w_EDF.shape), w_EDF.dtype, w_EDF.device)
        else:
            key = ("generation", generation, tuple(w_EDF.shape), w_EDF.dtype, w_EDF.device)
        if key != self._key or self._w is None:
            self._w = quantize_weight(w_EDF.detach(), fmt=self.fmt, pow2=self.pow2, backend=self.backend)
            self._key = key
            self.quantizations += 1
        return self._w

    def invalidate(self) -> None:
        self._key = None
        self._w = None
