"""Per-category step profile from torch.profiler events (``python -m train.pretrain --profile N``).

Every unit of measured time is put in one category by :func:`categorize`, from its own name and
the names of the ops around it (innermost first):

- on GPU, a unit is one device record (kernel, memcpy or memset) with its device time, counted
  once; its names are the kernel name, the op that launched it (the innermost op or
  ``record_function`` scope open at the launch, through the record's correlation id) and that
  op's ancestors (``aten::mm`` inside ``autograd::engine::evaluate_function: MmBackward0``).
  Host events never contribute device time themselves: neither an op's total (which holds its
  children's kernels again) nor the ``kernels`` torch attaches to non-op records. Where streams
  overlap, each instant is split evenly among the records running, so the categories sum to the
  device's busy time, never more; the table also gives the wall step time and the busy fraction;
- on CPU, a unit is an op inside a ``ProfilerStep`` scope with its self CPU time; its names are
  its own and its ancestors'.

Categories:

    exchange         token dispatch / combine: everything inside the ``moe.dispatch`` /
                     ``moe.combine`` scopes this module opens around each dispatcher call, their
                     autograd backward nodes (``_PermuteRows``, ``_ReplicateRows``,
                     ``_AllToAllRows``), all_to_all, the symmetric-memory exchange kernels (route,
                     send, expand, reduce-send / -recv, gate-grad-recv) wherever they run
    communication    NCCL / gloo collectives, FSDP2's all-gather / reduce-scatter and their copies
    optimizer        ``Optimizer.step``, ``zero_grad``, gradient clipping, router-bias update
    expert GEMMs     grouped GEMMs: ``tlx_dist::grouped_mm*``, ``aten::_grouped_mm``, grouped kernels;
                     the fused expert pipeline's ``_fused_mm_*`` / ``_fused_wgrad_*`` kernels (their
                     epilogues hold the SwiGLU and the gate scaling; the op's fills and casts stay
                     elementwise)
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
from torch.autograd import DeviceType

__all__ = ["CATEGORIES", "categorize", "step_profile", "format_profile", "annotate_dispatchers"]

CATEGORIES = ("expert GEMMs", "exchange", "attention", "other GEMMs", "elementwise/casts",
              "optimizer", "communication", "other")

_SCOPE = re.compile(r"^moe\.(dispatch|combine)$")
_RULES = [  # (category, pattern), in priority order at one name
    ("exchange", re.compile(r"PermuteRows|ReplicateRows|AllToAllRows|all_to_all|alltoall"
                            r"|_dispatch_\w*kernel|_combine_\w*kernel|barrier_(signal|wait)_kernel"
                            r"|^_(route|send_tokens|expand|reduce_send|reduce_recv|gate_grad_recv)_kernel", re.I)),
    ("communication", re.compile(r"^nccl:|c10d::|record_param_comms|FSDP::|all_gather|allgather|reduce_scatter"
                                 r"|reducescatter|all_reduce|allreduce|c10d_functional|^gloo:", re.I)),
    ("optimizer", re.compile(r"Optimizer\.step|Optimizer\.zero_grad|train\.clip_grad_norm|train\.router_bias"
                             r"|_fused_adamw?_|FusedAdam|^_adamw_kernel$", re.I)),
    ("expert GEMMs", re.compile(r"grouped_mm|grouped_gemm|grouped_wgrad|GroupedMm"
                                r"|^_fused_(mm|wgrad)_\w*kernel", re.I)),
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


# What kineto reports, by ``FunctionEvent.activity_type``. Only these device records are device work;
# the other device-side records are spans (``gpu_user_annotation``: a ``record_function`` scope
# drawn on the GPU timeline, e.g. ``ProfilerStep#N`` over a whole step) or waits (``cuda_sync``).
_DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# Host records that are torch ops or ``record_function`` scopes, i.e. can launch a kernel. Not ops:
# ``cuda_runtime`` / ``cuda_driver`` calls and CUPTI ``overhead`` records such as "Command Buffer
# Full" (the host blocked on a full launch queue). torch attaches kernels to such records too (by
# the look of it, those of the op that shares their correlation number), so summing every host
# event's ``kernels`` counts them again: on a real trace the "Command Buffer Full" records carried
# several times the step's own device time, and a table summing them read several times the step.
_HOST_OPS = frozenset({"cpu_op", "user_annotation"})
# Fallbacks for a torch whose events carry no ``activity_type``.
_DEVICE_WAIT = re.compile(r"^(Event|Stream|Context|Device) Sync|^Stream Wait Event|^cudaEvent", re.I)
_NOT_AN_OP = re.compile(r"^(Command Buffer Full|Buffer Flush|Driver Compiler|Instrumentation|Resource"
                        r"|Activity Buffer Request|Runtime Triggered Module Loading|Lazy Function Loading"
                        r"|Unknown)$|^cuda[A-Z]|^cu[A-Z]")  # CUPTI overhead kinds; runtime / driver calls


def _kind(evt) -> Optional[str]:
    return getattr(evt, "activity_type", None)


def _is_device_work(evt) -> bool:
    if evt.device_type == DeviceType.CPU or evt.is_user_annotation:
        return False
    kind = _kind(evt)
    return kind in _DEVICE_WORK if kind is not None else not _DEVICE_WAIT.search(evt.name)


def _is_host_op(evt) -> bool:
    if evt.device_type != DeviceType.CPU or evt.is_async:
        return False
    kind = _kind(evt)
    return kind in _HOST_OPS if kind is not None else not _NOT_AN_OP.search(evt.name)


def _is_step(name: str) -> bool:
    return name.startswith("ProfilerStep")  # "ProfilerStep#N", shown as "ProfilerStep*"


def _launchers(ops: list, work: list) -> list:
    """The op that launched each device record in ``work`` (None: launched by no op in the trace,
    e.g. queued in a warm-up step and run in the first profiled one). A device record's
    ``linked_correlation_id`` is the correlation number of the innermost op or ``record_function``
    scope open when it was launched. A torch whose events lack that field: the match is made
    through each op's ``kernels`` list (torch's own correlation), by kernel name and duration."""
    if all(hasattr(w, "linked_correlation_id") for w in work):
        by_id = {}
        for op in ops:
            by_id.setdefault(op.id, op)
        return [by_id.get(w.linked_correlation_id) if w.linked_correlation_id > 0 else None  # 0: no link
                for w in work]
    pool: dict[tuple, list] = {}
    for op in ops:
        for k in op.kernels:
            pool.setdefault((k.name, k.duration), []).append(op)
    out = []
    for w in work:
        cands = pool.get((w.name, w.time_range.end - w.time_range.start))
        out.append(cands.pop() if cands else None)
    return out


def _share_concurrent(spans: list[tuple[float, float, object, str]]) -> tuple[dict, float]:
    """Device time per category from ``spans`` = (start_us, end_us, device, category): every
    instant a device is busy is counted once, split evenly among the records running on it then
    (two streams overlapping for 10 us give each 5 us). Returns (us per category, busy us summed
    over devices); the categories sum to the busy time."""
    out: dict[str, float] = {}
    busy = 0.0
    per_dev: dict[object, list] = {}
    for s, e, d, c in spans:
        if e > s:  # a zero-length record owns no time (and would end before it starts below)
            per_dev.setdefault(d, []).append((s, e, c))
    for recs in per_dev.values():
        # Ends sort before starts at one instant: back-to-back records never count as concurrent.
        points = sorted([(s, 1, c) for s, _, c in recs] + [(e, 0, c) for _, e, c in recs])
        running: dict[str, int] = {}
        n, t_prev = 0, 0.0
        for t, starts, c in points:
            if n and t > t_prev:
                for cat, k in running.items():
                    if k:
                        out[cat] = out.get(cat, 0.0) + (t - t_prev) * k / n
                busy += t - t_prev
            t_prev = t
            running[c] = running.get(c, 0) + (1 if starts else -1)
            n += 1 if starts else -1
    return out, busy


def _step_windows(events: list) -> dict:
    """Per device, the ``[start, end)`` intervals that hold the device side of the profiled steps.
    Torch draws each host step scope on the device timeline as a GPU-side ``ProfilerStep#N`` span,
    from the first to the last record *linked* to an op inside it; a record no op is linked to
    (CUPTI drops the link now and then -- the fused AdamW update at a step's end, on a real H200
    trace) can start after its step's span. So each span is stretched to the next span's start, and
    the last to the end of the last host step scope: device work that starts between two spans was
    launched in the earlier step. Work queued before the profiled steps starts before the first span
    and stays out. Empty where the trace has none (an older torch, or a CPU-only trace)."""
    spans: dict = {}
    host_end = None
    for e in events:
        if not _is_step(e.name):
            continue
        if e.device_type == DeviceType.CPU:
            if _is_host_op(e) or e.is_user_annotation:
                host_end = e.time_range.end if host_end is None else max(host_end, e.time_range.end)
            continue
        kind = _kind(e)
        if kind == "gpu_user_annotation" or (kind is None and e.is_user_annotation):
            spans.setdefault(e.device_index, []).append((e.time_range.start, e.time_range.end))
    out: dict = {}
    for dev, ss in spans.items():
        ss.sort()
        wins = []
        for i, (s0, e0) in enumerate(ss):
            nxt = ss[i + 1][0] if i + 1 < len(ss) else (max(e0, host_end) if host_end is not None else e0)
            wins.append((s0, max(e0, nxt)))
        out[dev] = wins
    return out


def step_profile(events: Iterable, steps: int, device: bool) -> dict:
    """Milliseconds per step in each of :data:`CATEGORIES` from ``prof.events()`` over ``steps``
    profiled steps, plus ``"step (wall)"``: the mean duration of the ``ProfilerStep#N`` scopes.

    ``device=True``: device work only (kernels, memcpy, memset; not the GPU-side annotation spans
    nor sync records), each record counted once and categorised by its own name and the op that
    launched it (:func:`_launchers`) with that op's enclosing ops and scopes. Which records count:
    those that start inside the device side of the profiled steps (the GPU ``ProfilerStep#N``
    spans); without such spans in the trace, those some op in the trace launched. A record in the
    window that no op in the trace launched is categorised by its name alone and its time is also
    reported as ``"unlinked"`` (on a real trace the AdamW update among them, most likely launched
    while the host sat in CUPTI's "Command Buffer Full" with the GPU a step behind; dropping every
    record no op launched would lose that time from the table). Time when records overlap on one
    device (several streams) is split evenly among them, so the categories sum to ``"device busy"``: the time the device ran
    anything. Also ``"kernel time"`` (the records' summed durations, >= busy) and ``"left out"``:
    device time of the records that do not count (work queued before the profiled steps), in no
    category.

    ``device=False``: self CPU time of each op inside a ``ProfilerStep`` scope (so the categories
    sum to at most the step time); ``"left out"``: self CPU time of ops outside those scopes.
    """
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")
    events = list(events)
    ops = [e for e in events if _is_host_op(e)]
    wall = sum(e.time_range.end - e.time_range.start for e in ops if _is_step(e.name))
    us = {c: 0.0 for c in CATEGORIES}
    left_out = 0.0
    out: dict[str, float] = {}
    if device:
        work = [e for e in events if _is_device_work(e)]
        windows = _step_windows(events)
        cat_of: dict[tuple, str] = {}
        spans = []
        unlinked = 0.0
        for w, op in zip(work, _launchers(ops, work)):
            dur = w.time_range.end - w.time_range.start
            win = windows.get(w.device_index)
            if win is not None:  # the device side of the profiled steps is known: it decides
                if not any(s <= w.time_range.start < e for s, e in win):
                    left_out += dur
                    continue
            elif op is None:
                left_out += dur
                continue
            if op is None:  # in the steps' device window, launched by no op the trace holds: by name
                unlinked += dur
            key = (id(op) if op is not None else None, w.name)
            if key not in cat_of:
                cat_of[key] = categorize(w.name, [op.name, *_stack(op)] if op is not None else ())
            spans.append((w.time_range.start, w.time_range.end, w.device_index, cat_of[key]))
        out["unlinked"] = unlinked
        shares, busy = _share_concurrent(spans)
        for c, v in shares.items():
            us[c] += v
        out["device busy"] = busy
        out["kernel time"] = sum(e - s for s, e, _, _ in spans)
    else:
        for e in ops:
            if _is_step(e.name):
                continue
            stack = _stack(e)
            if any(_is_step(n) for n in stack):
                us[categorize(e.name, stack)] += e.self_cpu_time_total
            else:
                left_out += e.self_cpu_time_total
    out["step (wall)"] = wall
    out["left out"] = left_out
    return {**{c: us[c] / steps / 1e3 for c in CATEGORIES}, **{k: v / steps / 1e3 for k, v in out.items()}}


def format_profile(prof_ms: dict, device: bool) -> str:
    """The table ``--profile`` prints: ms per step and share of the total per category, then the
    step's wall time and how much of it the table covers."""
    total = sum(prof_ms[c] for c in CATEGORIES)
    wall = prof_ms["step (wall)"]
    what = ("device time per step, by category (kernels, memcpy, memset: each once, by the op that launched it)"
            if device else "self CPU time per step, by category (the ops inside the profiled steps)")
    lines = [f"step profile: {what}", f"{'category':<20} {'ms/step':>9} {'share':>7}"]
    for c in sorted(CATEGORIES, key=lambda c: -prof_ms[c]):
        lines.append(f"{c:<20} {prof_ms[c]:9.2f} {100 * prof_ms[c] / max(total, 1e-12):6.1f}%")
    lines.append(f"{'total':<20} {total:9.2f}")
    lines.append(f"{'step (wall)':<20} {wall:9.2f}")
    pct = f"{100 * total / wall:.1f}%" if wall > 0 else "n/a"
    if device:
        overlap = prof_ms["kernel time"] - prof_ms["device busy"]
        lines.append(f"device busy {prof_ms['device busy']:.2f} ms/step = {pct} of the wall step time; kernels ran "
                     f"{prof_ms['kernel time']:.2f} ms/step ({overlap:.2f} ms on concurrent streams, split evenly)")
        if prof_ms.get("unlinked", 0) > 0:
            lines.append(f"of which {prof_ms['unlinked']:.2f} ms/step launched by no op in the trace (the host blocked "
                         f"on a full launch queue): categorised by kernel name alone")
        if prof_ms["left out"] > 0:
            lines.append(f"left out: {prof_ms['left out']:.2f} ms/step of device work outside the profiled steps "
                         f"(queued before them)")
    else:
        lines.append(f"ops cover {pct} of the wall step time (the rest: Python between ops)")
        if prof_ms["left out"] > 0:
            lines.append(f"left out: {prof_ms['left out']:.2f} ms/step of self CPU time outside the profiled steps")
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

    def combine_weighted(self, *args, **kwargs):
        with torch.profiler.record_function("moe.combine"):
            return self._inner.combine_weighted(*args, **kwargs)

    def dispatch_rows(self, *args, **kwargs):  # the fused EP pipeline's exchange
        with torch.profiler.record_function("moe.dispatch"):
            return self._inner.dispatch_rows(*args, **kwargs)

    def combine_rows(self, *args, **kwargs):
        with torch.profiler.record_function("moe.combine"):
            return self._inner.combine_rows(*args, **kwargs)


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
