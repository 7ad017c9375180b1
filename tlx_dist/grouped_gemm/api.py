"""Functional grouped GEMM with autograd, registered as torch custom ops.

Legend: N rows in expert-major order, D input features, F output features, E experts,
``offsets_E`` cumulative end row of each expert (int32 or int64, on the operands' device).

    y_NF   = grouped_mm(x_ND, w_EDF, offsets_E)          # y[rows of e] = x[rows of e] @ w[e]
    dw_EDF = grouped_mm_wgrad(x_ND, dy_NF, offsets_E)    # dw[e] = x[rows of e]^T @ dy[rows of e]

Backward of ``grouped_mm``: ``dx = grouped_mm(dy, w^T, offsets)`` and ``dw = grouped_mm_wgrad(x, dy,
offsets)`` -- the same backend family runs all three forms. Rows past ``offsets_E[-1]`` are padding:
zero in ``y`` and ``dx``, ignored by ``dw``.

``config=`` pins the TLX kernels' tile config (:class:`~tlx_dist.grouped_gemm.config.GroupedGemmConfig`)
for the call and its backward; by default each form takes :func:`~tlx_dist.grouped_gemm.config.grouped_mm_config`'s
choice for its shape. :func:`tune_grouped_mm` times the candidates on real operands and returns the
fastest, to pass back as ``config=``.

Offsets are validated on the host on CPU (always) and on a GPU with ``TLX_DIST_CHECK_OFFSETS=1``
(a sync). Otherwise they are guarded on the device (``guard.py``): every backend runs on offsets
clamped into ``[0, N]`` and made non-decreasing, so no kernel reads or writes outside its operands,
and ``check_offsets()`` raises later if any were out of range.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .backends import get_backend, select_backend
from .config import GroupedGemmConfig
from .reference import check_num_experts

__all__ = ["grouped_mm", "grouped_mm_wgrad", "tune_grouped_mm", "check_grouped_mm_args", "check_grouped_mm_wgrad_args"]

ENV_CHECK_OFFSETS = "TLX_DIST_CHECK_OFFSETS"


def _check_offsets_values(offsets_E: torch.Tensor, n_rows: int) -> None:
    # Reading offsets on the host syncs, so on an accelerator this runs only on request
    # (TLX_DIST_CHECK_OFFSETS=1); on CPU it is free and always on.
    if torch.compiler.is_compiling():
        return  # data-dependent: not traceable; the eager call of the same code checked it
    if offsets_E.device.type != "cpu" and os.environ.get(ENV_CHECK_OFFSETS, "0") != "1":
        return
    if offsets_E.numel() == 0:
        return
    o = offsets_E.detach().to("cpu", torch.int64)
    if bool((o < 0).any()) or bool((o[1:] < o[:-1]).any()):
        raise ValueError(f"offsets_E must be non-decreasing and >= 0, got {o.tolist()[:16]}")
    if int(o[-1]) > n_rows:
        raise ValueError(f"offsets_E[-1]={int(o[-1])} exceeds the number of rows N={n_rows}")


def _check_common(pairs, offsets_E: torch.Tensor, n_experts: Optional[int], n_rows: int) -> None:
    for name, t in pairs + [("offsets_E", offsets_E)]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    (a_name, a), *rest = pairs
    if not a.is_floating_point():
        raise TypeError(f"{a_name} must be a floating tensor, got {a.dtype}")
    for name, t in rest:
        if t.dtype != a.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} differs from {a_name}.dtype={a.dtype}")
    if offsets_E.dim() != 1:
        raise ValueError(f"offsets_E must be 1-D [E] (each expert's cumulative end row), got shape "
                         f"{tuple(offsets_E.shape)}")
    if n_experts is not None and offsets_E.shape[0] != n_experts:
        raise ValueError(f"offsets_E has {offsets_E.shape[0]} entries but w_EDF has E={n_experts} experts")
    check_num_experts(offsets_E.shape[0], f"offsets_E of shape {tuple(offsets_E.shape)}")
    if offsets_E.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets_E must be int32 or int64, got {offsets_E.dtype}")
    devices = {t.device for _, t in pairs} | {offsets_E.device}
    if len(devices) != 1:
        names = ", ".join(n for n, _ in pairs)
        raise ValueError(f"{names} and offsets_E must be on one device, got {sorted(map(str, devices))}")
    _check_offsets_values(offsets_E, n_rows)


def check_grouped_mm_args(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> None:
    """Checks for ``grouped_mm``; raises TypeError / ValueError naming the argument."""
    if isinstance(x_ND, torch.Tensor) and x_ND.dim() != 2:
        raise ValueError(f"x_ND must be 2-D [N, D], got shape {tuple(x_ND.shape)}")
    if isinstance(w_EDF, torch.Tensor) and w_EDF.dim() != 3:
        raise ValueError(f"w_EDF must be 3-D [E, D, F], got shape {tuple(w_EDF.shape)}")
    if isinstance(w_EDF, torch.Tensor):
        check_num_experts(w_EDF.shape[0], f"w_EDF of shape {tuple(w_EDF.shape)}")
    _check_common([("x_ND", x_ND), ("w_EDF", w_EDF)], offsets_E,
                  w_EDF.shape[0] if isinstance(w_EDF, torch.Tensor) else 0,
                  x_ND.shape[0] if isinstance(x_ND, torch.Tensor) else 0)
    if x_ND.shape[1] != w_EDF.shape[1]:
        raise ValueError(f"x_ND has D={x_ND.shape[1]} columns but w_EDF expects D={w_EDF.shape[1]}")


def check_grouped_mm_wgrad_args(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor) -> None:
    """Checks for ``grouped_mm_wgrad``; raises TypeError / ValueError naming the argument."""
    for name, t in (("x_ND", x_ND), ("dy_NF", dy_NF)):
        if isinstance(t, torch.Tensor) and t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    _check_common([("x_ND", x_ND), ("dy_NF", dy_NF)], offsets_E, None, x_ND.shape[0])
    if x_ND.shape[0] != dy_NF.shape[0]:
        raise ValueError(f"x_ND has N={x_ND.shape[0]} rows but dy_NF has N={dy_NF.shape[0]}")


# --- custom ops ----------------------------------------------------------------------------------
# The backend name and the tile config (its fields as JSON, or None for the default) travel as string
# arguments so that torch.compile / CUDA graphs see one opaque op per call with no Python-side state.


def _run(fn, a, b, offsets_E, config: Optional[str]):
    return fn(a, b, offsets_E) if config is None else fn(a, b, offsets_E, config=GroupedGemmConfig.from_json(config))


@torch.library.custom_op("tlx_dist::grouped_mm", mutates_args=())
def _grouped_mm_op(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor, backend: str,
                   config: Optional[str] = None) -> torch.Tensor:
    check_num_experts(w_EDF.shape[0], f"w_EDF of shape {tuple(w_EDF.shape)}")  # also for torch.ops callers
    return _run(get_backend(backend).mm, x_ND, w_EDF, offsets_E, config)


@_grouped_mm_op.register_fake
def _(x_ND, w_EDF, offsets_E, backend, config=None):
    return x_ND.new_empty(x_ND.shape[0], w_EDF.shape[2])


@torch.library.custom_op("tlx_dist::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor, backend: str,
                         config: Optional[str] = None) -> torch.Tensor:
    check_num_experts(offsets_E.shape[0], f"offsets_E of shape {tuple(offsets_E.shape)}")
    return _run(get_backend(backend).wgrad, x_ND, dy_NF, offsets_E, config)


@_grouped_mm_wgrad_op.register_fake
def _(x_ND, dy_NF, offsets_E, backend, config=None):
    return x_ND.new_empty(offsets_E.shape[0], x_ND.shape[1], dy_NF.shape[1])


def _setup_context(ctx, inputs, output):
    x_ND, w_EDF, offsets_E, backend, *config = inputs
    ctx.save_for_backward(x_ND, w_EDF, offsets_E)
    ctx.backend = backend
    ctx.config = config[0] if config else None


def _backward(ctx, dy_NF):
    x_ND, w_EDF, offsets_E = ctx.saved_tensors
    dx = dw = None
    dy_NF = dy_NF.contiguous()
    if ctx.needs_input_grad[0]:
        w_EFD = w_EDF.transpose(1, 2)
        dx = _grouped_mm_op(dy_NF, w_EFD, offsets_E, _pick(dy_NF, w_EFD, ctx.backend, ctx.config), ctx.config)
    if ctx.needs_input_grad[1]:
        dw = _grouped_mm_wgrad_op(x_ND, dy_NF, offsets_E, _pick_wgrad(x_ND, dy_NF, ctx.backend, ctx.config),
                                  ctx.config)
    return dx, dw, None, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def _pick(x_ND, w_EDF, backend: Optional[str], config: Optional[str] = None) -> str:
    b = select_backend(x_ND, w_EDF, backend)
    if config is not None and not b.tiled:
        raise ValueError(f"grouped_mm config= pins the TLX kernels' tile config, but backend {b.name!r} runs these "
                         f"operands{'' if backend else ' (chosen automatically)'} and has no tiles; pin "
                         "backend='tlx' or leave config=None")
    return b.name


def _pick_wgrad(x_ND, dy_NF, backend: Optional[str], config: Optional[str] = None) -> str:
    # The weight-gradient form has the same operand constraints as a forward with w = [1, D, F].
    return _pick(x_ND, dy_NF.new_empty(1, x_ND.shape[1], dy_NF.shape[1]), backend, config)


def _config_arg(config) -> Optional[str]:
    if config is None:
        return None
    if not isinstance(config, GroupedGemmConfig):
        raise TypeError(f"config must be a GroupedGemmConfig or None, got {type(config).__name__}")
    return config.to_json()


# --- public functions ----------------------------------------------------------------------------


def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
               *, backend: Optional[str] = None, config: Optional[GroupedGemmConfig] = None) -> torch.Tensor:
    """Grouped GEMM over experts, differentiable in ``x_ND`` and ``w_EDF``.

    Args:
        x_ND: ``[N, D]`` rows grouped by expert (expert-major), float dtype.
        w_EDF: ``[E, D, F]`` per-expert weights, same dtype as ``x_ND``.
        offsets_E: ``[E]`` int32/int64 cumulative end rows, non-decreasing, ``offsets_E[-1] <= N``,
            ``E >= 1``. Out-of-range values raise on CPU; on a GPU they are clamped on the device
            and flagged (see ``check_offsets``), never read out of bounds.
        backend: ``"tlx" | "triton" | "torch" | "reference"`` to pin one; default automatic.
        config: the TLX kernels' tile config for this call's forward, dX and dW (the backend that
            runs must be ``tlx``: a ValueError otherwise); default: each form's own default.
    Returns:
        ``[N, F]`` with ``x_ND.dtype``; rows past ``offsets_E[-1]`` are zero.
    """
    check_grouped_mm_args(x_ND, w_EDF, offsets_E)
    cfg = _config_arg(config)
    return _grouped_mm_op(x_ND, w_EDF, offsets_E, _pick(x_ND, w_EDF, backend, cfg), cfg)


def grouped_mm_wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor,
                     *, backend: Optional[str] = None, config: Optional[GroupedGemmConfig] = None) -> torch.Tensor:
    """Per-expert ``x^T @ dy`` over each expert's rows.

    Args:
        x_ND: ``[N, D]``; dy_NF: ``[N, F]`` (same dtype and device); offsets_E: ``[E]`` cumulative end rows.
        backend, config: as in :func:`grouped_mm`.
    Returns:
        ``[E, D, F]`` with ``x_ND.dtype``; an expert with no rows gets zeros.
    """
    check_grouped_mm_wgrad_args(x_ND, dy_NF, offsets_E)
    cfg = _config_arg(config)
    return _grouped_mm_wgrad_op(x_ND, dy_NF, offsets_E, _pick_wgrad(x_ND, dy_NF, backend, cfg), cfg)


def tune_grouped_mm(x_ND: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor, *, form: str = "fwd") -> GroupedGemmConfig:
    """The fastest of the TLX kernels' candidate tile configs for one call on this GPU, timed on these
    operands (a few hundred ms; never while a CUDA graph is captured): pass it back as ``config=``.

    Args:
        x_ND: ``[N, D]`` (``"dX"``: the ``[N, F]`` upstream gradient).
        b: ``w_EDF [E, D, F]`` for ``form="fwd"``, its transposed view ``[E, F, D]`` for ``"dX"``,
            ``dy_NF [N, F]`` for ``"dW"``.
        offsets_E: ``[E]`` cumulative end rows.
    """
    if form not in ("fwd", "dX", "dW"):
        raise ValueError(f"form={form!r} must be 'fwd', 'dX' or 'dW'")
    if form == "dW":
        check_grouped_mm_wgrad_args(x_ND, b, offsets_E)
        impl = get_backend(_pick_wgrad(x_ND, b, "tlx"))
    else:
        check_grouped_mm_args(x_ND, b, offsets_E)
        impl = get_backend(_pick(x_ND, b, "tlx"))
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("tune_grouped_mm times kernels: call it outside CUDA-graph capture")
    return impl.tune(form, x_ND, b, offsets_E)
