"""Checks, before DCP loads anything, that a checkpoint fits the model and optimizer of this run.

DCP notices a mismatch deep inside its load planner (a 45-line traceback, wrapped per rank in a
``CheckpointException`` on several ranks). This reads the checkpoint's metadata instead and says
what differs, naming the tensor and both shapes, as a :class:`train.config.UsageError`.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .config import UsageError

__all__ = ["check_resume_compatible"]


def _flatten(d, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"model": {"a.b": t}}`` -> ``{"model.a.b": t}`` (DCP's key scheme for nested dicts;
    lists are indexed ``key.0``). Non-tensors are dropped."""
    out: dict[str, torch.Tensor] = {}
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, (list, tuple)) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[key] = v
        else:
            out.update(_flatten(v, key))
    return out


def _shape(s) -> str:
    return "[" + ", ".join(str(int(n)) for n in s) + "]"


def check_resume_compatible(path: str, state: dict) -> None:
    """Raises :class:`UsageError` if a tensor of ``state`` (the nested dict about to be given to
    ``dcp.load``) is absent from the checkpoint at ``path`` or has another global shape there."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    mismatched, missing = [], []
    for key, t in _flatten(state).items():
        if t.dim() == 0:          # optimizer step counters etc.
            continue
        m = meta.get(key)
        if m is None:
            missing.append(key)
        elif isinstance(m, TensorStorageMetadata) and tuple(m.size) != tuple(t.shape):
            mismatched.append((key, m.size, t.shape))
    if mismatched:
        key, saved, now = mismatched[0]
        more = f" (and {len(mismatched) - 1} more tensors)" if len(mismatched) > 1 else ""
        raise UsageError(f"{key} is {_shape(saved)} in the checkpoint but {_shape(now)} in this run{more}: "
                         "the model config (e.g. model.moe.num_experts) or parallel.ep differs from the saved run's")
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"the checkpoint has no {missing[0]}{more}: it was saved by a different model "
                         "or parallel layout (parallel.ep)")
