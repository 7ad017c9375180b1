"""Suite-wide pytest hooks: per-test durations in the verbose progress, and a heartbeat.

* With ``-v`` each test's result word carries its time (setup + call), e.g. ``PASSED 12.3s``.
* A heartbeat thread prints ``... <what> still running (40 s) | <note>`` on the terminal whenever
  collection or one test has run for :data:`HEARTBEAT_S` seconds without finishing, and again every
  :data:`HEARTBEAT_S` after, so a long test (a compile, a child process) is never a silent stretch.
  It writes to the terminal's own file descriptor, taken before any test runs, so it never
  touches pytest's output capture. A test that waits on a child process calls :func:`note` with
  the child's latest line (``tests/_interp.py`` does), and the heartbeat shows it.
* The ``release`` marker (pyproject.toml) holds the heavy soaks and compile matrices; the default
  selection leaves them out and ``scripts/test.sh --release`` runs them.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

HEARTBEAT_S = 20.0

_state = {"what": None, "since": 0.0, "note": "", "fd": None}
_lock = threading.Lock()
_setup_s: dict = {}


def note(text: str) -> None:
    """Shows ``text`` (one line, e.g. a child process's latest output) in the next heartbeat."""
    _state["note"] = " ".join(text.split())[:140]


def _set(what) -> None:
    with _lock:
        _state["what"], _state["since"], _state["note"] = what, time.monotonic(), ""


def _beat(stop: threading.Event) -> None:
    since_seen, due = None, 0.0
    while not stop.wait(1.0):
        with _lock:
            what, since, fd, extra = _state["what"], _state["since"], _state["fd"], _state["note"]
        if what is None or fd is None:
            continue
        if since != since_seen:  # a new activity: its first heartbeat after HEARTBEAT_S
            since_seen, due = since, since + HEARTBEAT_S
        now = time.monotonic()
        if now >= due:
            due = now + HEARTBEAT_S
            line = f"\n    ... {what} still running ({now - since:.0f} s)" + (f" | {extra}" if extra else "") + "\n"
            try:
                os.write(fd, line.encode("utf-8", "replace"))
            except OSError:
                return


def pytest_configure(config):
    try:
        _state["fd"] = os.dup(1)  # capture is suspended here: fd 1 is the terminal (or CI's log)
    except OSError:
        return
    stop = threading.Event()
    t = threading.Thread(target=_beat, args=(stop,), name="test-heartbeat", daemon=True)
    t.start()
    config._tlx_heartbeat = (stop, t)


def pytest_unconfigure(config):
    hb = getattr(config, "_tlx_heartbeat", None)
    if hb is not None:
        hb[0].set()
        hb[1].join(timeout=5)
    if _state["fd"] is not None:
        os.close(_state["fd"])
        _state["fd"] = None


def pytest_collection(session):
    _set("collection")


def pytest_collection_finish(session):
    _set(None)


def pytest_runtest_logstart(nodeid, location):
    _set(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _set(None)


def pytest_runtest_logreport(report):
    if report.when == "setup":
        _setup_s[report.nodeid] = report.duration


def pytest_report_teststatus(report, config):
    """The verbose word with the test's time: ``PASSED 3.2s`` (setup + call)."""
    if report.when != "call" or config.option.verbose <= 0 or hasattr(report, "wasxfail"):
        return None  # (xfail / xpass: pytest's own words)
    secs = _setup_s.pop(report.nodeid, 0.0) + report.duration
    if report.passed:
        return "passed", ".", (f"PASSED {secs:.1f}s", {"green": True})
    if report.failed:
        return "failed", "F", (f"FAILED {secs:.1f}s", {"red": True})
    return None
