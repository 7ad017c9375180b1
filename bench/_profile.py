"""Per-kernel GPU time of a benchmark step (torch.profiler, CUDA activity), shared by the benches."""

from __future__ import annotations

import torch


def kernel_profile(step, iters: int, sync, top: int = 16, per: str = "step") -> str:
    """The ``top`` kernels by CUDA time of ``iters`` calls of ``step()``, per call, as text."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / iters, ev.count / iters, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    out = [f"  {'us/' + per:>9} {'calls':>6}  kernel (total {total:.1f} us of GPU time per {per})"]
    out += [f"  {t:9.1f} {c:6.1f}  {k[:90]}" for t, c, k in rows[:top]]
    return "\n".join(out)



def _stats_rows(pr, iters: int) -> tuple[list, list]:
    """(cumulative, self) rows ``(us per step, calls per step, where)`` of a cProfile run."""
    import pstats

    cum, own = [], []
    for (fname, line, func), (_cc, nc, tt, ct, _callers) in pstats.Stats(pr).stats.items():
        where = fname.split("site-packages/")[-1].split("/work/main/")[-1]
        key = f"{where}:{line}({func})"
        cum.append((ct / iters, nc / iters, key))
        own.append((tt / iters, nc / iters, key))
    cum.sort(reverse=True)
    own.sort(reverse=True)
    return cum, own


def host_profile(fwd, bwd, iters: int, sync, top: int = 20, top_self: int = 12) -> str:
    """The host side of one eager step, the GPU drained before each: median time to enqueue the
    forward (``out = fwd()``) and the backward (``bwd(out)``); then, for each half, its ``top``
    functions by cumulative CPU time and its ``top_self`` by self time (cProfile, per step). The
    profiled backward runs with autograd's device threads off
    (``torch.autograd.set_multithreading_enabled(False)``), so it runs on this thread, where
    cProfile sees it. Enqueue time close to the step's eager time means a host-bound step."""
    import cProfile
    import statistics
    import time

    import torch

    tf, tb = [], []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        bwd(out)
        t2 = time.perf_counter()
        del out
        tf.append(t1 - t0)
        tb.append(t2 - t1)
    sync()
    pf, pb = cProfile.Profile(), cProfile.Profile()
    for _ in range(iters):
        sync()
        pf.enable()
        out = fwd()
        pf.disable()
        with torch.autograd.set_multithreading_enabled(False):
            pb.enable()
            bwd(out)
            pb.disable()
        del out
    sync()
    out = [f"  host enqueue per step: forward {statistics.median(tf) * 1e6:.0f} us, "
           f"backward {statistics.median(tb) * 1e6:.0f} us (median of {iters})"]
    for half, pr in (("forward", pf), ("backward", pb)):
        cum, own = _stats_rows(pr, iters)
        out.append(f"  {'us/step':>9} {'calls':>7}  {half} function (cumulative CPU time)")
        out += [f"  {t * 1e6:9.1f} {c:7.1f}  {k[:100]}" for t, c, k in cum[:top]]
        out.append(f"  {'us/step':>9} {'calls':>7}  {half} function (self CPU time)")
        out += [f"  {t * 1e6:9.1f} {c:7.1f}  {k[:100]}" for t, c, k in own[:top_self]]
    return "\n".join(out)


def _trace_events(prof) -> list:
    """The chrome-trace events (``traceEvents``) of a finished ``torch.profiler`` run."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def gap_profile(step, sync, min_gap_us: float = 10.0, top: int = 12) -> str:
    """Where the GPU waits for the host in one eager ``step()`` started on an idle GPU: the time from
    the step's start (host) to its first kernel, then every idle interval of at least ``min_gap_us``
    between consecutive kernels, each with the kernel that ended it and the innermost host ops
    (``torch.profiler`` CPU ops, Python stack off) that were running when that kernel was launched.
    The step's wall time = lead-in + kernel time + idle time."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("## step ##"):
            step()
        sync()
    events = _trace_events(prof)
    xs = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e for e in xs if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in xs
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation") is not None}
    ops = [e for e in xs if e.get("cat") in ("cpu_op", "user_annotation")]
    marks = [e for e in ops if e["name"] == "## step ##"]
    if not kernels or not marks:
        return "  (no kernels or no step mark in the trace)"
    t_start = marks[0]["ts"]

    def host_stack(launch):  # the ops open on the launching thread (the backward runs on autograd's)
        ts, tid = launch["ts"], launch.get("tid")
        live = [e for e in ops if e.get("tid") == tid and e["ts"] <= ts <= e["ts"] + e["dur"]
                and e["name"] != "## step ##"]
        live.sort(key=lambda e: e["ts"])
        names = [e["name"] for e in live]
        return " > ".join(names[-3:]) if names else "(no op)"

    # busy: the union of the kernels' intervals (kernels on other streams may overlap)
    rows, idle, busy, prev_end = [], 0.0, 0.0, None
    for k in kernels:
        end = k["ts"] + k["dur"]
        if prev_end is None:
            busy += k["dur"]
        else:
            busy += max(0.0, end - max(k["ts"], prev_end))
            gap = k["ts"] - prev_end
            if gap >= min_gap_us:
                launch = launches.get(k.get("args", {}).get("correlation"))
                rows.append((gap, k["name"], host_stack(launch) if launch else "(launch not found)"))
            if gap > 0:
                idle += gap
        prev_end = max(prev_end or 0.0, end)
    lead = kernels[0]["ts"] - t_start
    first = launches.get(kernels[0].get("args", {}).get("correlation"))
    out = [f"  step: lead-in {lead:.0f} us (host start -> first kernel: {kernels[0]['name'][:40]}, launched in "
           f"{host_stack(first) if first else '?'}), kernels {busy:.0f} us, idle between kernels "
           f"{idle:.0f} us ({len(rows)} gaps >= {min_gap_us:.0f} us), first kernel -> last end "
           f"{prev_end - kernels[0]['ts']:.0f} us"]
    out.append(f"  {'gap us':>8}  next kernel | host ops running at its launch (innermost last)")
    for gap, name, stack in sorted(rows, reverse=True)[:top]:
        out.append(f"  {gap:8.1f}  {name[:48]} | {stack[:150]}")
    return "\n".join(out)


def interleaved_times(steps: dict, rounds: int, time_one) -> dict:
    """``{name: [ms per round]}``: every round times one call of each step, the order rotated each
    round (so no provider always runs first, after the same neighbour, or as the clocks drift),
    ``time_one(step) -> ms``. Ratios taken round by round (:func:`round_ratios`) see the same
    machine state on both sides, where medians of back-to-back blocks of reps drift apart on a
    shared machine (different runs of the same code read different ratios)."""
    names = list(steps)
    out = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(time_one(steps[n]))
    return out


def round_ratios(times: dict, num: str, den: str) -> tuple[float, float, float]:
    """(median, min, max) over rounds of ``times[den][i] / times[num][i]``: how many times faster
    ``num`` ran than ``den`` in the same round."""
    import statistics

    r = [b / a for a, b in zip(times[num], times[den])]
    return statistics.median(r), min(r), max(r)


def gpu_timeline(step, reps: int, sync, top: int = 40) -> str:
    """The GPU's timeline of ``step()`` (kernels, copies, memsets on every stream), ``reps`` times, each
    after ``sync()`` (profiled too: where it ends in a device-side barrier kernel, the step's events are
    those after it, so the ranks start together on the device as in the timed runs): for the median
    rep by span, each event's start and end in us from the rep's first event, its stream and name; then,
    for every stream, its busy time and the idle gaps between its events inside the span. Shows where
    an op's time goes when its parts run on several streams (a per-kernel total does not: waits overlap
    work). The text comes from :func:`timeline_text`."""
    from torch.profiler import ProfilerActivity, profile

    reps_ev = []
    for _ in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sync()
            step()
            torch.cuda.synchronize()
        reps_ev.append(_trace_events(prof))
    return timeline_text(reps_ev, top)


def timeline_text(reps_events: list, top: int = 40) -> str:
    """:func:`gpu_timeline`'s text from each rep's chrome-trace events (``traceEvents``): the GPU
    events (``cat`` kernel / gpu_memcpy / gpu_memset) after the last barrier kernel of the rep."""
    reps_ev = []
    for events in reps_events:
        gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
        bars = [e["ts"] + e["dur"] for e in gpu if "barrier" in e["name"].lower()]
        if bars:
            gpu = [e for e in gpu if e["ts"] >= max(bars)]
        if gpu:
            reps_ev.append(gpu)
    if not reps_ev:
        return "  (no GPU events in the trace)"
    spans = [max(e["ts"] + e["dur"] for e in g) - g[0]["ts"] for g in reps_ev]
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    g = reps_ev[order[len(order) // 2]]
    t0 = g[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in g) - t0
    out = [f"  spans of {len(spans)} reps (us): " + ", ".join(f"{s:.1f}" for s in sorted(spans)),
           f"  median rep, span {span:.1f} us:", f"  {'start':>8} {'end':>8} {'dur':>7} stream  event"]
    for e in g[:top]:
        st = e.get("args", {}).get("stream", "?")
        out.append(f"  {e['ts'] - t0:8.1f} {e['ts'] + e['dur'] - t0:8.1f} {e['dur']:7.1f} {st!s:>6}  {e['name'][:70]}")
    if len(g) > top:
        out.append(f"  ... {len(g) - top} more events")
    by_stream = {}
    for e in g:
        by_stream.setdefault(e.get("args", {}).get("stream", "?"), []).append(e)
    for st, es in by_stream.items():
        busy = sum(e["dur"] for e in es)
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(es, es[1:])]
        gaps = [x for x in gaps if x > 0]
        out.append(f"  stream {st}: {len(es)} events, busy {busy:.1f} us, from {es[0]['ts'] - t0:.1f} to "
                   f"{es[-1]['ts'] + es[-1]['dur'] - t0:.1f}; gaps {sum(gaps):.1f} us "
                   f"(largest {max(gaps) if gaps else 0:.1f})")
    return "\n".join(out)
