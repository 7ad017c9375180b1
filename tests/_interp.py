"""Runs interpreter-only case files (``*_interpreted_cases.py``) in a child pytest with
TRITON_INTERPRET=1, so that the parent process keeps compiling kernels (not collected: no test_ prefix).

:func:`run_interpreted_suite` runs one child and waits for it; :class:`SuitePool` runs several, two
at a time (a two-core machine's both cores; each child is one interpreter thread), and hands back
one result per suite for its own test to check."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from conftest import note

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class SuiteResult:
    case_files: tuple
    returncode: int
    output: str
    timed_out: bool
    timeout: float

    def check(self) -> None:
        """Asserts that the child passed, ran within its limit and failed nothing."""
        tail = self.output[-6000:]
        if self.timed_out:
            raise AssertionError(f"the interpreted suite {self.case_files} ran past {self.timeout} s:\n{tail}")
        assert self.returncode == 0, tail
        last = self.output.rstrip().splitlines()[-1] if self.output.strip() else ""
        assert " passed" in last and " failed" not in last, tail


def _run(case_files, timeout: float, release: bool, single_thread: bool, procs: list) -> SuiteResult:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if single_thread:  # children side by side: one thread each, no oversubscribed cores
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tier = "release and not gpu and not multigpu" if release else "not gpu and not multigpu and not release"
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", tier,
                          *(os.path.join(HERE, f) for f in case_files)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(p)
    lines: list[str] = []
    name = case_files[0].replace("_interpreted_cases.py", "")

    def read():
        for line in p.stdout:
            lines.append(line)
            if line.strip():
                note(f"child {name}: {line.strip()}")  # the parent's heartbeat shows it

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        p.kill()
        p.wait()
    reader.join(timeout=30)
    return SuiteResult(tuple(case_files), p.returncode, "".join(lines), timed_out, timeout)


def run_interpreted_suite(*case_files: str, timeout: int = 540, release: bool = False) -> None:
    """Asserts that pytest over ``case_files`` (names in tests/) passes in the child, skipping none:
    the cases of the fast tier, or with ``release`` those marked ``release`` (the big worlds).
    The child's output is read as it comes: its latest line goes to the parent's heartbeat
    (``conftest.note``), so a long child is never a silent stretch."""
    _run(case_files, timeout, release, single_thread=False, procs=[]).check()


class SuitePool:
    """Child suites two at a time, in the order submitted (submit the longest first)."""

    def __init__(self, workers: int = 2):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
        self._procs: list = []

    def submit(self, *case_files: str, timeout: int = 540, release: bool = False) -> concurrent.futures.Future:
        """A future of the suite's :class:`SuiteResult`; its time limit starts when it starts."""
        return self._pool.submit(_run, case_files, timeout, release, True, self._procs)

    def close(self) -> None:
        """Stops what is still queued or running (a test run that ended early)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
