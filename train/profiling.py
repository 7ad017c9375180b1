"""Per-category step profile from torch.profiler events (``python -m train.pretrain --profile N``).

Every unit of measured time is put in one category by :func:`categorize`, from its own name and
the names of the ops around it (innermost first):

- on GPU, a unit is a device kernel (or memcpy / memset) with its device time; its names are the
  kernel name, the op that launched it and that op's ancestors (``aten::mm`` inside
  ``autograd::engine::evaluate_function: MmBackward0`` inside ``ProfilerStep#4``);
- on CPU, a unit is an op with its self CPU time; its names are its own and its ancestors'.

Categories:

    exchange         token dispatch / combine: everything inside the ``moe.dispatch`` /
                     ``moe.combine`` scopes this module opens around each dispatcher call, their
                     autograd backward nodes (``_PermuteRows``, ``_ReplicateRows``,
                     ``_AllToAllRows``), all_to_all, the symmetric-memory dispatch/combine kernels
    communication    NCCL / gloo collectives, FSDP2's all-gather / reduce-scatter and their copies
    optimizer        ``Optimizer.step``, ``zero_grad``, gradient clipping, router-bias update
    expert GEMMs     grouped GEMMs: ``tlx_dist::grouped_mm*``, ``aten::_grouped_mm``, grouped kernels
    attention        SDPA (flash / cuDNN / memory-efficient kernels and their backward)
    other GEMMs      ``mm`` / ``addmm`` / ``bmm`` / ``linear`` and cuBLAS / CUTLASS GEMM kernels
    elementwise/casts  everything else that computes: casts and copies, pointwise ops, norms,
                     reductions, indexing, softmax/top-k, fused Triton kernels from torch.compile
    other            memcpy / memset on the device, host-side waits

Rules, in order. (1) Inside a dispatcher scope: exchange (it holds no GEMM). (2) The innermost
name that says what the time is decides: the kernel, then the op that launched it, then -- if
neither is a GEMM, a memcpy or a memset -- the enclosing ops outward. At one name the order is
exchange, communication, optimizer, expert GEMMs, attention. Innermost first matters for
recomputation: with activation checkpointing a whole MoE layer is recomputed inside the backward
node that first needs it (often the combine's), and its GEMMs must stay GEMMs. (3) An NCCL
kernel no op claims is communication; anything else is elementwise/casts.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["CATEGORIES", "categorize", "step_profile", "format_profile", "annotate_dispatchers"]

CATEGORIES = ("expert GEMMs", "exchange", "attention", "other GEMMs", "elementwise/casts",
              "optimizer", "communication", "other")

_SCOPE = re.compile(r"^moe\.(dispatch|combine)$")
_RULES = [  # (category, pattern), in priority order at one name
    ("exchange", re.compile(r"PermuteRows|ReplicateRows|AllToAllRows|all_to_all|alltoall"
                            r"|_dispatch_\w*kernel|_combine_\w*kernel|barrier_(signal|wait)_kernel", re.I)),
    ("communication", re.compile(r"^nccl:|c10d::|record_param_comms|FSDP::|all_gather|allgather|reduce_scatter"
                                 r"|reducescatter|all_reduce|allreduce|c10d_functional|^gloo:", re.I)),
    ("optimizer", re.compile(r"Optimizer\.step|Optimizer\.zero_grad|train\.clip_grad_norm|train\.router_bias"
                             r"|_fused_adamw?_|FusedAdam", re.I)),
    ("expert GEMMs", re.compile(r"grouped_mm|grouped_gemm|grouped_wgrad|GroupedMm", re.I)),
    ("attention", re.compile(r"scaled_dot_product|flash_attention|flash_fwd|flash_bwd|fmha|efficient_attention"
                             r"|cudnn_attention|sdpa|_attn_fwd|_attn_bwd", re.I)),
]
_GEMM_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm|addmv|mv)$")
_GEMM_KERNEL = re.compile(r"gemm|gemv|xmma|cutlass|nvjet|cublas|wgmma|_mm_kernel|matmul", re.I)
_OTHER = re.compile(r"^Memcpy|^Memset|cudaDeviceSynchronize|cudaStreamSynchronize|cudaMemcpy", re.I)


def _semantic(name: str) -> Optional[str]:
    for cat, pat in _RULES:
        if pat.search(name):
            return cat
    return None


def categorize(name: str, stack: Sequence[str] = ()) -> str:
    """Category (one of :data:`CATEGORIES`) of a unit of time named ``name`` (a kernel or an op)
    inside the ops ``stack`` (innermost first). See the module docstring for the rules."""
    if any(_SCOPE.match(n) for n in stack) or _SCOPE.match(name):
        return "exchange"
    inner = [name, *stack[:1]]           # the kernel (or CPU op) and the op that launched it
    for n in inner:
        cat = _semantic(n)
        if cat:
            return cat
    if _OTHER.search(name):
        return "other"
    if _GEMM_KERNEL.search(name) or any(_GEMM_OP.match(n) for n in inner):
        return "other GEMMs"
    for n in stack[1:]:
        cat = _semantic(n)
        if cat:
            return cat
    if name.lower().startswith("nccl"):
        return "communication"
    return "elementwise/casts"


def _stack(evt) -> list[str]:
    out, p = [], evt.cpu_parent
    while p is not None:
        out.append(p.name)
        p = p.cpu_parent
    return out


def step_profile(events: Iterable, steps: int, device: bool) -> dict:
    """Milliseconds per step in each category from ``prof.events()`` over ``steps`` profiled steps.

    ``device=True``: kernels (device time) attributed through the op that launched them; device
    time that no op claims is reported as ``unattributed``. ``device=False``: self CPU time of
    each op. Also returns ``"step (wall)"``: the mean duration of the ``ProfilerStep#N`` scopes.
    """
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")
    from torch.autograd import DeviceType

    ms = {c: 0.0 for c in CATEGORIES}
    wall, attributed, device_total = 0.0, 0.0, 0.0
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name.startswith("ProfilerStep"):  # "ProfilerStep#N", shown as "ProfilerStep*"
                wall += e.cpu_time_total
                continue
            if device:
                stack = None
                for k in e.kernels:
                    stack = stack if stack is not None else [e.name, *_stack(e)]
                    ms[categorize(k.name, stack)] += k.duration
                    attributed += k.duration
            elif not e.is_async:
                ms[categorize(e.name, _stack(e))] += e.self_cpu_time_total
        elif device and not e.is_user_annotation:
            device_total += e.time_range.end - e.time_range.start
    out = {c: v / steps / 1e3 for c, v in ms.items()}
    if device:
        out["unattributed"] = max(device_total - attributed, 0.0) / steps / 1e3
    out["step (wall)"] = wall / steps / 1e3
    return out


def format_profile(prof_ms: dict, device: bool) -> str:
    """The table ``--profile`` prints: ms per step and share of the measured total per category."""
    cats = [c for c in prof_ms if c != "step (wall)"]
    total = sum(prof_ms[c] for c in cats)
    what = "device (kernel) time" if device else "self CPU time"
    lines = [f"step profile: {what} per step, by category", f"{'category':<20} {'ms/step':>9} {'share':>7}"]
    for c in sorted(cats, key=lambda c: -prof_ms[c]):
        lines.append(f"{c:<20} {prof_ms[c]:9.2f} {100 * prof_ms[c] / max(total, 1e-12):6.1f}%")
    lines.append(f"{'total':<20} {total:9.2f}")
    lines.append(f"{'step (wall)':<20} {prof_ms['step (wall)']:9.2f}")
    return "\n".join(lines)


class _AnnotatedDispatcher:
    """Wraps a dispatcher so that dispatch / combine run inside ``moe.dispatch`` / ``moe.combine``
    profiler scopes; every other attribute is the wrapped dispatcher's."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name == "_inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def dispatch(self, *args, **kwargs):
        with torch.profiler.record_function("moe.dispatch"):
            return self._inner.dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        with torch.profiler.record_function("moe.combine"):
            return self._inner.combine(*args, **kwargs)


@contextlib.contextmanager
def annotate_dispatchers(moe_layers: Sequence[nn.Module]):
    """While active, every layer's ``dispatcher`` opens a profiler scope per dispatch / combine
    (their forward ops would otherwise be anonymous gathers). Restores the dispatchers on exit."""
    saved: list[tuple[nn.Module, Optional[object]]] = [(m, m.dispatcher) for m in moe_layers]
    try:
        for m, d in saved:
            m.dispatcher = _AnnotatedDispatcher(d)
        yield
    finally:
        for m, d in saved:
            m.dispatcher = d
