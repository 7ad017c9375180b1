"""Runs interpreter-only case files (``*_interpreted_cases.py``) in a child pytest with
TRITON_INTERPRET=1, so that the parent process keeps compiling kernels (not collected: no test_ prefix)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_interpreted_suite(*case_files: str, timeout: int = 540) -> None:
    """Asserts that pytest over ``case_files`` (names in tests/) passes in the child, skipping none."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not multigpu",
                        *(os.path.join(HERE, f) for f in case_files)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
