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
