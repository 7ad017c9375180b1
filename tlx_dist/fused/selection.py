"""Choosing a backend of the fused expert pipeline.

The top of the fused package's backend stack: ``backends.py`` defines :class:`FusedBackend`, the
registry and the ``triton`` / ``reference`` backends; ``tlx_backend.py`` registers ``tlx`` where
the TLX kernels run. This module imports both (``tlx_backend`` on first use, so that ``import
tlx_dist`` compiles nothing) and picks one.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends import FusedBackend, registered_fused_backends

__all__ = ["get_fused_backend", "select_fused_backend"]

_loaded = False


def _backends() -> dict[str, FusedBackend]:
    global _loaded
    if not _loaded:
        _loaded = True
        from . import tlx_backend  # noqa: F401  (registers "tlx" where TLX runs on sm_90 / sm_100)
    return registered_fused_backends()


def get_fused_backend(name: str) -> FusedBackend:
    backends = _backends()
    if name not in backends:
        raise ValueError(f"backend={name!r} is not one of {sorted(backends)}")
    return backends[name]


def select_fused_backend(x_RD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor,
                         backend: Optional[str] = None) -> FusedBackend:
    """The pinned ``backend`` -- an error if it cannot run these operands -- or the first in
    preference order that can."""
    name = backend or None
    if name is not None:
        b = get_fused_backend(name)
        why = b.supports(x_RD, w13_EDF2, w2_EFD)
        if why is not None:
            raise ValueError(f"fused backend={name!r} cannot run these operands: {why}")
        return b
    for b in sorted(_backends().values(), key=lambda b: b.priority):
        if x_RD.device.type == "cpu" and not b.auto_on_cpu:
            continue
        if b.supports(x_RD, w13_EDF2, w2_EFD) is None:
            return b
    raise AssertionError("the reference backend supports every input")  # pragma: no cover
