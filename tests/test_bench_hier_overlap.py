"""bench/hier_overlap.py on CPU (the timed part needs a GPU): its command line's checks, the
inter-node rows its paced window is sized by (against the hierarchical exchange's reference
counts), the paced copies' schedule, the host pacer's loop (on a fake clock and a fake copy), and
the ``--dry`` path.

On one H200 (registered as ``bench-hier-overlap`` in scripts/gpu_checks.toml):

    python3 bench/hier_overlap.py --nic-gbs 25,50                # timer pacing (the default)
    python3 bench/hier_overlap.py --nic-gbs 25,50 --pace host    # host pacing beside it
"""

from __future__ import annotations

import sys
from pathlib import Path

import threading

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import hier_overlap as bench  # noqa: E402
from tlx_dist.comm.hier_reference import hier_dispatch_reference  # noqa: E402


@pytest.mark.parametrize("argv,flag", [
    (["--nic-gbs", "0"], "--nic-gbs"),
    (["--nic-gbs", "50,x"], "--nic-gbs"),
    (["--ranks-per-node", "3"], "--ranks-per-node"),      # does not divide W = 8
    (["--ranks-per-node", "8"], "--ranks-per-node"),      # one node: nothing crosses a NIC
    (["--rank", "8"], "--rank"),
    (["--experts", "12"], "--experts"),                   # not divisible by W = 8
    (["--topk", "0"], "--topk"),
    (["--side-sms", "0"], "--side-sms"),
    (["--pace", "kernel"], "--pace"),                      # only timer or host
    (["--pace", "spin"], "--pace"),
    (["--capacity", "0"], "--capacity"),
    (["--capacity", "nan"], "--capacity"),
    (["--chunks", "0"], "--chunks"),
])
def test_bad_arguments_name_their_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=flag):
        bench.parse_args(argv)
    assert bench.main(argv + ["--dry", "--no-results"]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("W,L", [(8, 4), (4, 2), (8, 2)])
def test_nic_rows_are_the_references(W, L):
    """Rows in at each relay: over all relays, the reference's NIC rows out of every sender; with
    two nodes each relay's are its one counterpart's exactly (the owner's other-node rows are checked
    against its receive plan on the GPU)."""
    args = bench.parse_args(["--world", str(W), "--ranks-per-node", str(L), "--tokens", "64", "--dim", "8",
                             "--experts", str(4 * W), "--topk", "3", "--seed", "5"])
    idxs = bench.routing(args)
    xs = [torch.zeros(64, 8) for _ in range(W)]
    ref = hier_dispatch_reference(xs, idxs, 4 * W, L)
    nic_in = bench.nic_rows_in(idxs, 4 * W, W, L)
    assert sum(nic_in) == int(ref.counts.nic_rows_W.sum())
    if W // L == 2:
        assert nic_in == [int(ref.counts.nic_rows_W[(v + L) % W]) for v in range(W)]


def test_window_is_the_busiest_relays_bytes_at_the_rate():
    args = bench.parse_args(["--tokens", "256", "--dim", "1024", "--nic-gbs", "25,50"])
    idxs = bench.routing(args)
    nic = bench.nic_rows_in(idxs, args.experts, 8, 4)
    want = max(nic[:4]) * 1024 * 2 / 50e9 * 1e3
    assert bench.window_ms(args, idxs, 50.0) == pytest.approx(want)
    assert bench.window_ms(args, idxs, 25.0) == pytest.approx(2 * want)


def test_dry_prints_the_plan(capsys):
    assert bench.main(["--dry", "--tokens", "128", "--nic-gbs", "25,50", "--no-results"]) == 0
    out = capsys.readouterr().out
    assert "W=8 as 2 x 4" in out and "paced window at 25 GB/s" in out and "paced window at 50 GB/s" in out


@pytest.mark.parametrize("rate", [25.0, 50.0, 400.0])
@pytest.mark.parametrize("far,chunks", [
    ([0, 0, 0, 0, 700, 650, 720, 690], 16),   # two nodes of four: the other node's four sources
    ([0, 0, 5, 0], 16),                      # fewer rows than chunks: one row a copy
    ([0, 3, 0, 64], 1),                      # one chunk: a copy per source
    ([0, 0, 0, 0, 64, 0, 1, 0], 4),          # a source of one row, a source of none in between
])
def test_paced_schedule_covers_the_rows_and_ends_at_the_window(far, chunks, rate):
    """The pieces tile each source's RECV rows once, in order; each is issued when a NIC at the rate
    would have delivered its last byte, so the last is at the window's end exactly."""
    T, D = 720, 2048
    win = sum(far) * D * 2 / (rate * 1e9) * 1e3
    sched = bench.paced_schedule(far, T, chunks, win)
    got = {}
    for p in sched:
        got.setdefault(p.source, []).append((p.start, p.end))
    assert got == {s: got[s] for s in sorted(got)} and list(got) == [s for s, n in enumerate(far) if n]
    for s, runs in got.items():
        assert runs[0][0] == s * T and runs[-1][1] == s * T + far[s]
        assert all(a < b for a, b in runs) and all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
    assert sum(p.end - p.start for p in sched) == sum(far)
    assert [p.last for p in sched] == [i == len(sched) - 1 or sched[i + 1].source != p.source
                                       for i, p in enumerate(sched)]
    assert len(sched) <= chunks + sum(1 for n in far if n)  # at most one short piece a source
    done = 0
    for p in sched:
        done += p.end - p.start
        assert p.t_ms == pytest.approx(win * done / sum(far), rel=1e-12)
    assert sched[-1].t_ms == win
    assert all(a.t_ms <= b.t_ms for a, b in zip(sched, sched[1:]))


def test_paced_schedule_scales_with_the_rate():
    far = [0, 0, 0, 0, 300, 310, 290, 305]
    s25 = bench.paced_schedule(far, 512, 16, 2.0)
    s50 = bench.paced_schedule(far, 512, 16, 1.0)
    assert [(p.source, p.start, p.end) for p in s25] == [(p.source, p.start, p.end) for p in s50]
    assert [p.t_ms for p in s25] == pytest.approx([2 * p.t_ms for p in s50])


@pytest.mark.parametrize("far,T,chunks,win,word", [
    ([0, 0], 8, 4, 1.0, "far"),               # nothing from another node
    ([0, 9], 8, 4, 1.0, "far"),               # more rows than a source sends
    ([0, -1, 3], 8, 4, 1.0, "far"),
    ([0, 4], 8, 0, 1.0, "chunks"),
    ([0, 4], 8, 4, 0.0, "window_ms"),
    ([0, 4], 8, 4, float("nan"), "window_ms"),
])
def test_paced_schedule_rejects_bad_input(far, T, chunks, win, word):
    with pytest.raises(ValueError, match=word):
        bench.paced_schedule(far, T, chunks, win)


class FakeClock:
    """A clock that moves only when read (by ``tick``) or slept on (by the time asked, at least a tick)."""

    def __init__(self, start=100.0, tick=1e-6):
        self.now, self.tick = start, tick
        self.sleeps = []

    def clock(self):
        self.now += self.tick
        return self.now

    def sleep(self, s):
        assert s >= 0, "the pacer never asks to sleep a negative time"
        self.sleeps.append(s)
        self.now += max(s, self.tick)


def test_host_pacer_issues_in_order_at_the_planned_times():
    sched = bench.paced_schedule([0, 0, 0, 0, 700, 650, 720, 690], 720, 16, 1.34)
    fc = FakeClock()
    calls = []
    polls = iter([False, False, False, True])
    waited, issued = bench.host_pace([p.t_ms for p in sched], lambda i: calls.append((i, fc.now)), clock=fc.clock,
                                     sleep=fc.sleep, started=lambda: next(polls))
    assert waited is True
    assert [i for i, _ in calls] == list(range(len(sched)))
    t0 = calls[0][1] - issued[0] / 1e3  # the moment the pacer saw the window start
    for (i, at), p, ms in zip(calls, sched, issued):
        assert at >= t0 + p.t_ms / 1e3, f"copy {i} issued early"
        assert at - (t0 + p.t_ms / 1e3) < 5 * fc.tick, f"copy {i} issued late on an idle host"
        assert ms == pytest.approx(p.t_ms, abs=5e-3)


def test_host_pacer_sleeps_through_long_gaps():
    """Gaps longer than its polling margin are slept (the GIL given away), all but the margin."""
    times = [5.0, 10.0, 30.0]
    fc = FakeClock()
    calls = []
    bench.host_pace(times, lambda i: calls.append(fc.now), clock=fc.clock, sleep=fc.sleep)
    long = [s for s in fc.sleeps if s > 0]
    assert len(long) == 3 and sum(long) == pytest.approx(30e-3 - 3 * bench.SPIN_S, abs=1e-4)
    assert [c - calls[0] for c in calls] == pytest.approx([0.0, 5e-3, 25e-3], abs=5 * fc.tick)


def test_host_pacer_a_late_copy_is_late_not_dropped():
    """A copy whose enqueue takes longer than the gap to the next: the next ones go at once, in order,
    each not before its own time; none is skipped."""
    times = [0.1, 0.2, 0.3, 0.4, 1.0]
    fc = FakeClock()
    calls = []

    def slow_issue(i):
        calls.append((i, fc.now))
        if i == 0:
            fc.now += 0.25e-3  # the host stalls past copies 1 and 2's times

    waited, issued = bench.host_pace(times, slow_issue, clock=fc.clock, sleep=fc.sleep)
    assert waited is False and [i for i, _ in calls] == [0, 1, 2, 3, 4]
    assert issued[1] > times[1] + 0.1 and issued[2] > times[2]  # late
    assert issued[2] - issued[1] < 0.01  # back to back
    assert issued[3] == pytest.approx(times[3], abs=5e-3) and issued[4] == pytest.approx(times[4], abs=5e-3)
    assert all(ms >= t for ms, t in zip(issued, times))


def test_host_pacer_gives_up_when_the_window_never_starts():
    fc = FakeClock(tick=0.1)
    with pytest.raises(RuntimeError, match="did not reach the window's start"):
        bench.host_pace([1.0], lambda i: None, clock=fc.clock, sleep=fc.sleep, started=lambda: False,
                        timeout_s=5.0)


def test_host_pacer_thread_runs_the_loop_and_reraises():
    done, fc = [], FakeClock()
    t = bench.HostPacer([0.0, 0.5], done.append, clock=fc.clock, sleep=fc.sleep)
    t.start()
    waited, issued = t.result()
    assert done == [0, 1] and len(issued) == 2 and not t.is_alive()

    def boom(i):
        raise OSError("copy failed")

    t = bench.HostPacer([0.0], boom, clock=FakeClock().clock, sleep=FakeClock().sleep)
    t.start()
    with pytest.raises(OSError, match="copy failed"):
        t.result()
    assert t.name != threading.current_thread().name


@pytest.mark.parametrize("pace", ["timer", "host"])
def test_dry_names_the_pacing(pace, capsys):
    assert bench.main(["--dry", "--tokens", "256", "--nic-gbs", "25", "--pace", pace, "--no-results"]) == 0
    out = capsys.readouterr().out
    assert f"({pace} pacing)" in out
    # the schedule's times are printed: the last at the window's end
    line = next(x for x in out.splitlines() if x.startswith("paced window at 25"))
    win = line.split(": ")[1].split(" ms")[0]
    assert line.rstrip().endswith(f"{win} ms ({pace} pacing)")


def test_default_pacing_is_timer():
    assert bench.parse_args([]).pace == "timer"


def test_timer_pacing_kernels_read_the_wall_clock():
    """The timer pacing's kernels compile for sm_90 (no GPU needed): the start kernel stores
    ``%globaltimer``, the wait kernel reads it in a loop until the copy's time."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = bench._timer_kernels()

    def ptx(name, sig):
        return triton.compile(ASTSource(k[name], sig, constexprs={}), target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    start = ptx("start", {"t0_ptr": "*i64"})
    assert start.count("%globaltimer") == 1 and "st.global" in start
    # a window's times below 2**31 ns specialise at_ns as i32, longer ones as i64
    for at in ("i32", "i64"):
        until = ptx("until", {"t0_ptr": "*i64", "at_ns": at})
        assert until.count("%globaltimer") == 2, at  # once before the loop, once a turn
        assert "bra" in until and "ld.volatile.global" in until, at


def test_nan_rows_names_the_sources_and_the_rows_past_their_counts():
    """The poisoned-row check's message: NaN rows by source, below or past its count; this node's
    sources apart; a finite output says so."""
    T, D = 4, 3
    far = [0, 0, 3, 1]  # sources 0, 1 this node's (rows [0, 8)); 2 sent 3 rows, 3 sent 1
    part = torch.zeros(4 * T, D)
    assert bench.nan_rows(part, T, far, (0, 8)) == "no NaN row"
    part[2 * T + 1, 0] = float("nan")  # source 2, row 1: below its count
    part[3 * T + 2, 2] = float("nan")  # source 3, row 2: past its count
    part[5, 1] = float("nan")          # source 1 (this node's), row 1
    assert bench.nan_rows(part, T, far, (0, 8)) == (
        "source 1 (this node's): 1 rows (first 1); source 2: 1 rows below its count (first 1), 0 past it; "
        "source 3: 0 rows below its count, 1 past it")
