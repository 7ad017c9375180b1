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



def host_profile(fwd, bwd, iters: int, sync, top: int = 20) -> str:
    """The host side of one eager step, the GPU drained before each: median time to enqueue the
    forward (``out = fwd()``) and the backward (``bwd(out)``), then the forward's ``top`` functions by
    cumulative CPU time (cProfile, per call; the backward runs on autograd's device thread, which
    cProfile does not see). Enqueue time close to the step's eager time means a host-bound step."""
    import cProfile
    import pstats
    import statistics
    import time

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
    pr = cProfile.Profile()
    for _ in range(iters):
        sync()
        pr.enable()
        out = fwd()
        pr.disable()
        bwd(out)
        del out
    sync()
    rows = []
    for (fname, line, func), (_cc, nc, _tt, ct, _callers) in pstats.Stats(pr).stats.items():
        where = fname.split("site-packages/")[-1].split("/work/main/")[-1]
        rows.append((ct / iters, nc / iters, f"{where}:{line}({func})"))
    rows.sort(reverse=True)
    out = [f"  host enqueue per step: forward {statistics.median(tf) * 1e6:.0f} us, "
           f"backward {statistics.median(tb) * 1e6:.0f} us (median of {iters})",
           f"  {'us/step':>9} {'calls':>7}  forward function (cumulative CPU time)"]
    out += [f"  {t * 1e6:9.1f} {c:7.1f}  {k[:100]}" for t, c, k in rows[:top]]
    return "\n".join(out)
