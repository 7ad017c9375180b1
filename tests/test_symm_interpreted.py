"""Runs tests/symm_interpreted_cases.py (the symmetric-memory kernels under the Triton interpreter, on
CPU) in a child pytest with TRITON_INTERPRET=1, so that this process keeps compiling kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted: pytest collects it directly")
def test_symm_dispatch_interpreted_suite():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not multigpu",
                        os.path.join(here, "symm_interpreted_cases.py"),
                        os.path.join(here, "symm_nvshmem_interpreted_cases.py"),  # the emulated cross-node route
                        os.path.join(here, "symm_rows_interpreted_cases.py")],  # the fused EP exchange
                       cwd=root, env=env, capture_output=True, text=True, timeout=540)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
