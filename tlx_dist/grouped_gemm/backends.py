"""Grouped-GEMM backends and the automatic choice between them.

A backend provides two device functions with one contract (see ``reference.py`` for the semantics):

* ``mm(x_ND, w_EDF, offsets_E) -> y_NF`` -- forward, and dX with a transposed weight view;
* ``wgrad(x_ND, dy_NF, offsets_E) -> dw_EDF`` -- the varlen-K weight gradient;

and ``supports(x_ND, w_EDF) -> str | None`` -- ``None`` when it can run these operands, else the
reason it cannot (used in error messages when a backend is forced). The TLX backends (``tiled``)
also take ``config=``, a tile config (``config.py``).

Order of preference: ``tlx`` (TLX kernels: sm_90 / sm_100 in ``tlx_backend.py``, gfx942 / gfx950 in
``amd_backend.py``) -> ``torch`` (``torch._grouped_mm``, sm_90+ bf16, not on ROCm) -> ``triton``
(stock-Triton kernel: AMD without TLX and older GPUs, where ``torch._grouped_mm`` cannot run; slower
than it on Hopper) -> ``reference`` (the loop; any device and dtype). Kernel backends register
themselves (``registry.py``) when this module first imports them; a name may have one implementation
per GPU generation (``Backend.archs``), and the one for ``tlx.gpu_arch()`` -- detected, or forced with
``TLX_DIST_FORCE_ARCH`` -- is looked up at each call. The ``backend=`` argument pins one, and pinning
one that cannot run the operands is an error, not a silent fallback.

Every backend runs on the guarded offsets (``guard.py``): clamped into ``[0, N]`` and made
non-decreasing on the device, with a device flag recording out-of-range ones.
"""

from __future__ import annotations

from typing import Optional

import torch

import tlx

from .host import guard_offsets
from .reference import grouped_mm_ref, grouped_mm_wgrad_ref
from .registry import Backend, current, register_backend, register_unavailable, registered, unavailable_reason

__all__ = ["Backend", "register_backend", "register_unavailable", "get_backend", "available_backends",
           "select_backend"]

def _load_kernel_backends() -> None:
    # Imported lazily so that `import tlx_dist` never compiles or touches a GPU. Each module
    # registers its backend (registry.py) only when its compiler is importable.
    from . import amd_backend, tlx_backend, triton_backend  # noqa: F401


_loaded = False


def _load_once() -> bool:
    global _loaded
    if not _loaded:
        _loaded = True
        _load_kernel_backends()
    return True


# Run eagerly even while torch.compile traces the first grouped_mm of a process (dynamo cannot
# trace an import); the registry it fills is then read like any other global. This is what
# torch.compiler.assume_constant_result(_load_once) does -- it sets this one attribute -- without
# importing torch._dynamo (and triton with it) at `import tlx_dist` (tests/test_moe_compile.py
# fails if a torch release changes the mechanism).
_load_once._dynamo_marked_constant = True


def _ensure_loaded() -> None:
    if not _loaded:
        _load_once()


def available_backends() -> list[str]:
    _ensure_loaded()
    return [b.name for b in current()]


def get_backend(name: str) -> Backend:
    _ensure_loaded()
    for b in current():
        if b.name == name:
            return b
    if registered(name):
        archs = sorted({a for b in registered(name) for a in b.archs or ()})
        arch = tlx.gpu_arch()
        raise ValueError(f"grouped_mm backend={name!r} cannot run on this machine: it has no implementation for "
                         f"gpu_arch()={arch!r}{' (no GPU found)' if arch == 'none' else ''} (it has them for {archs})")
    if unavailable_reason(name) is not None:
        raise ValueError(f"grouped_mm backend={name!r} cannot run on this machine: {unavailable_reason(name)} "
                         f"(available here: {available_backends()})")
    raise ValueError(f"backend={name!r} is not one of {available_backends()}")


def select_backend(x_ND: torch.Tensor, w_EDF: torch.Tensor, backend: Optional[str] = None) -> Backend:
    """The backend that runs these operands: the pinned one (``backend``) or the first of the
    preference order that supports them."""
    name = backend or None
    if name is not None:
        b = get_backend(name)
        why = b.supports(x_ND, w_EDF)
        if why is not None:
            raise ValueError(f"grouped_mm backend={name!r} cannot run these operands: {why}")
        return b
    _ensure_loaded()
    on_cpu = x_ND.device.type == "cpu"
    for b in current():
        if on_cpu and not b.auto_on_cpu:
            continue
        if b.supports(x_ND, w_EDF) is None:
            return b
    raise AssertionError("the reference backend supports every input")  # pragma: no cover


# --- torch._grouped_mm ------------------------------------------------------------------------


def _torch_supports(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> Optional[str]:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if x_ND.dtype not in (torch.bfloat16, torch.float32) or w_EDF.dtype != x_ND.dtype:
        return f"dtype {x_ND.dtype} (needs bfloat16, or float32 on CPU)"
    if x_ND.is_cuda:
        arch = tlx.gpu_arch()
        if arch == "gfx94x" or getattr(torch.version, "hip", None):
            return "torch._grouped_mm is not used on ROCm (the TLX or the portable Triton kernel is)"
        old = arch not in ("sm_90", "sm_100") and torch.cuda.get_device_capability(x_ND.device)[0] < 9
        if old or x_ND.dtype != torch.bfloat16:
            return "torch._grouped_mm on CUDA needs sm_90+ and bfloat16"
    elif x_ND.device.type != "cpu":
        return f"device {x_ND.device}"
    # Its kernels need 16-byte aligned leading strides for every operand it sees, in both the
    # forward (x, w) and the weight-gradient (x^T, dy) forms.
    esz = x_ND.element_size()
    D, F = w_EDF.shape[1], w_EDF.shape[2]
    if (D * esz) % 16 or (F * esz) % 16:
        return f"D={D} and F={F} must be multiples of {16 // esz} for 16-byte aligned rows"
    if x_ND.stride(1) != 1 or (x_ND.stride(0) * esz) % 16:
        return "x must be row-major with a 16-byte aligned row stride"
    if w_EDF.stride(1) != 1 and w_EDF.stride(2) != 1:
        return "w must be contiguous in its last or second-to-last dimension"
    return None


def _rows_past_end(n_rows: int, offsets_E: torch.Tensor, device: torch.device) -> torch.Tensor:
    # [N, 1] bool mask without a host sync (no slicing by offsets[-1]).
    return (torch.arange(n_rows, device=device) >= offsets_E[-1]).unsqueeze(1)


def _torch_mm(x_ND, w_EDF, offsets_E):
    # torch._grouped_mm trusts its offsets: it gets the guarded ones (in [0, N], non-decreasing).
    safe = guard_offsets(offsets_E, x_ND.shape[0])
    y_NF = torch._grouped_mm(x_ND, w_EDF, safe)
    # torch._grouped_mm leaves rows past the last offset uninitialised; our contract says zero.
    return y_NF.masked_fill_(_rows_past_end(x_ND.shape[0], safe, x_ND.device), 0)


def _torch_wgrad(x_ND, dy_NF, offsets_E):
    # Rows past the last offset are already outside every expert's K range.
    return torch._grouped_mm(x_ND.t(), dy_NF, guard_offsets(offsets_E, x_ND.shape[0]))


def _ref_mm(x_ND, w_EDF, offsets_E):
    return grouped_mm_ref(x_ND, w_EDF, guard_offsets(offsets_E, x_ND.shape[0]))


def _ref_wgrad(x_ND, dy_NF, offsets_E):
    return grouped_mm_wgrad_ref(x_ND, dy_NF, guard_offsets(offsets_E, x_ND.shape[0]))


register_backend(Backend("torch", _torch_mm, _torch_wgrad, _torch_supports, priority=30, auto_on_cpu=True))
register_backend(Backend("reference", _ref_mm, _ref_wgrad, lambda x, w: None, priority=100, auto_on_cpu=True))
