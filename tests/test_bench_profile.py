"""bench/_profile.py's host profile on CPU (the benches that call it need a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _profile import host_profile  # noqa: E402


def test_host_profile_times_both_halves_and_names_the_forward():
    """Enqueue times of both halves, and the forward's own function among the profiled rows, once
    per step; the backward really ran on every step (its gradient accumulates)."""
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    syncs = []

    def my_forward():
        return (x @ w).relu()

    def my_backward(out):
        out.sum().backward()

    text = host_profile(my_forward, my_backward, 4, lambda: syncs.append(1), top=8, top_self=40)
    lines = text.splitlines()
    assert lines[0].startswith("  host enqueue per step: forward ") and "backward" in lines[0]
    heads = [i for i, ln in enumerate(lines) if ln.strip().startswith("us/step")]
    assert [lines[i].split("  ")[-1] for i in heads] == [
        "forward function (cumulative CPU time)", "forward function (self CPU time)",
        "backward function (cumulative CPU time)", "backward function (self CPU time)"]
    fwd_rows, bwd_rows = lines[heads[0]:heads[2]], lines[heads[2]:]
    row = next(ln for ln in fwd_rows if "my_forward" in ln)
    assert float(row.split()[1]) == 1.0  # one call per step
    assert not any("my_backward" in ln for ln in fwd_rows)
    row = next(ln for ln in bwd_rows if "my_backward" in ln)  # the backward half is profiled too
    assert float(row.split()[1]) == 1.0
    # 4 timed + 4 profiled steps, each one backward: d/dw sum(relu(x @ w)) = x^T (x @ w > 0), 8 times
    torch.testing.assert_close(w.grad, 8 * (x.T @ (x @ w > 0).float()))
    assert len(syncs) >= 2 * 4  # the GPU is drained before every timed and every profiled step


def test_interleaved_times_rotate_and_ratios_pair_rounds():
    """Every round times each step once, the first step rotating; the ratio is taken round by round,
    so a machine that slows down over the run (here 1% every call) barely moves it, where
    the ratio of two back-to-back blocks' medians would not."""
    from _profile import interleaved_times, round_ratios

    order, clock = [], [1.0]

    def time_one(step):
        order.append(step())
        clock[0] *= 1.01  # drift
        return {"fast": 1.0, "slow": 3.0}[order[-1]] * clock[0]

    t = interleaved_times({"fast": lambda: "fast", "slow": lambda: "slow"}, 4, time_one)
    assert order == ["fast", "slow", "slow", "fast", "fast", "slow", "slow", "fast"]
    assert len(t["fast"]) == len(t["slow"]) == 4
    med, lo, hi = round_ratios(t, "fast", "slow")
    assert lo <= med <= hi and abs(med - 3.0) < 0.05 and hi - lo < 0.07


def test_timeline_text_takes_the_median_rep_after_the_barrier():
    """``gpu_timeline``'s text (bench/exchange_tiles.py --timeline) from synthetic traces: events before
    the rep's barrier kernel dropped, times from the rep's first event, the median rep by span, and per
    stream its busy time and gaps."""
    from _profile import timeline_text

    def ev(name, ts, dur, stream, cat="kernel"):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=dict(stream=stream))

    def rep(t0, span_extra):
        return [ev("_sleep_kernel", t0 - 200, 100, 7), ev("barrier_kernel", t0 - 90, 90, 7),
                ev("ready", t0, 2, 7), ev("sum", t0 + 2, 100 + span_extra, 7),
                ev("Memcpy PtoP", t0 + 10, 40, 9, cat="gpu_memcpy"), ev("Memcpy PtoP", t0 + 55, 40, 9, cat="gpu_memcpy"),
                dict(ph="X", cat="cpu_op", name="aten::empty", ts=t0, dur=1)]

    text = timeline_text([rep(1000, 30), rep(5000, 0), rep(9000, 10)])
    lines = text.splitlines()
    assert lines[0] == "  spans of 3 reps (us): 102.0, 112.0, 132.0"
    assert lines[1] == "  median rep, span 112.0 us:"
    names = [ln.split()[-1] for ln in lines[3:7]]
    assert names == ["ready", "sum", "PtoP", "PtoP"], "the sleep and barrier before the op are not its events"
    assert lines[3].split()[:3] == ["0.0", "2.0", "2.0"]
    s9 = next(ln for ln in lines if ln.startswith("  stream 9:"))
    assert "2 events, busy 80.0 us, from 10.0 to 95.0; gaps 5.0 us (largest 5.0)" in s9
    assert timeline_text([[dict(ph="X", cat="cpu_op", name="x", ts=0, dur=1)]]) == "  (no GPU events in the trace)"
