"""The grouped-GEMM backend registry: what a backend is, and the table the kernel modules fill.

The bottom of the grouped-GEMM package: the kernel modules (``tlx_backend.py``, ``amd_backend.py``,
``triton_backend.py``) register into it when they import; ``backends.py`` imports them and chooses.
A name may have one implementation per GPU generation (``Backend.archs``); :func:`current` gives the
one for ``tlx.gpu_arch()`` at each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

import tlx

__all__ = ["Backend", "register_backend", "register_unavailable", "current", "registered", "unavailable_reason"]


@dataclass(frozen=True)
class Backend:
    """One grouped-GEMM implementation (the contract: ``backends.py``): ``mm(x_ND, w_EDF,
    offsets_E) -> y_NF``, ``wgrad(x_ND, dy_NF, offsets_E) -> dw_EDF``, ``supports(x_ND, w_EDF)``
    (None when it runs these operands, else why not). A ``tiled`` backend (the TLX kernels) also
    takes ``config=`` (a :class:`~tlx_dist.grouped_gemm.config.GroupedGemmConfig`, None: the
    default for the call) in ``mm`` and ``wgrad``, and ``tune(form, a, b, offsets_E) -> config``
    times its candidates."""

    name: str
    mm: Callable[..., torch.Tensor]
    wgrad: Callable[..., torch.Tensor]
    supports: Callable[[torch.Tensor, torch.Tensor], Optional[str]]
    priority: int  # lower is preferred
    # Chosen automatically for CPU tensors? Kernel backends can run on CPU only interpreted
    # (TRITON_INTERPRET=1), which is for tests: they run there when pinned, never by default.
    auto_on_cpu: bool = False
    # The GPU generations (``tlx.ARCHS``) this implementation is for; None: any (or none).
    archs: Optional[tuple[str, ...]] = None
    tiled: bool = False
    tune: Optional[Callable[..., object]] = None


_BACKENDS: dict[str, list[Backend]] = {}
_UNAVAILABLE: dict[str, str] = {}  # known backend name -> why it cannot run on this machine


def register_backend(backend: Backend) -> None:
    """Adds an implementation, replacing one of the same name whose ``archs`` overlap."""
    def overlap(a: Backend) -> bool:
        return a.archs is None or backend.archs is None or bool(set(a.archs) & set(backend.archs))

    _BACKENDS[backend.name] = [b for b in _BACKENDS.get(backend.name, []) if not overlap(b)] + [backend]
    _UNAVAILABLE.pop(backend.name, None)


def register_unavailable(name: str, reason: str) -> None:
    """Records that backend ``name`` exists but cannot run here (pinning it then says ``reason``)."""
    if name not in _BACKENDS:
        _UNAVAILABLE[name] = reason


def current() -> list[Backend]:
    """One implementation per name: the one for the current ``tlx.gpu_arch()``, by priority."""
    arch = tlx.gpu_arch()
    found = (next((b for b in impls if b.archs is None or arch in b.archs), None) for impls in _BACKENDS.values())
    return sorted((b for b in found if b is not None), key=lambda b: b.priority)


def registered(name: str) -> list[Backend]:
    """Every implementation registered under ``name`` (any generation)."""
    return list(_BACKENDS.get(name, ()))


def unavailable_reason(name: str) -> Optional[str]:
    return _UNAVAILABLE.get(name)
