"""Runs interpreter-only case files (``*_interpreted_cases.py``) in a child pytest with
TRITON_INTERPRET=1, so that the parent process keeps compiling kernels (not collected: no test_ prefix)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from conftest import note

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_interpreted_suite(*case_files: str, timeout: int = 540, release: bool = False) -> None:
    """Asserts that pytest over ``case_files`` (names in tests/) passes in the child, skipping none:
    the cases of the fast tier, or with ``release`` those marked ``release`` (the big worlds).
    The child's output is read as it comes: its latest line goes to the parent's heartbeat
    (``conftest.note``), so a long child is never a silent stretch."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    tier = "release and not gpu and not multigpu" if release else "not gpu and not multigpu and not release"
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", tier,
                          *(os.path.join(HERE, f) for f in case_files)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read():
        for line in p.stdout:
            lines.append(line)
            if line.strip():
                note(f"child: {line.strip()}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        reader.join(timeout=10)
        raise AssertionError(f"the interpreted suite {case_files} ran past {timeout} s:\n" + "".join(lines)[-4000:])
    reader.join(timeout=30)
    out = "".join(lines)
    tail = out[-6000:]
    assert p.returncode == 0, tail
    last = out.rstrip().splitlines()[-1] if out.strip() else ""
    assert " passed" in last and " failed" not in last, tail
