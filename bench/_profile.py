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
