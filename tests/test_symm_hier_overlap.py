"""Runs tests/symm_hier_overlap_interpreted_cases.py (the overlapped hierarchical dispatch under the
Triton interpreter, on CPU) in a child pytest with TRITON_INTERPRET=1, so that this process keeps
compiling kernels."""

from __future__ import annotations

import os

import pytest
from _interp import run_interpreted_suite

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="already interpreted: pytest collects the case file directly")
def test_symm_hier_overlap_interpreted_suite():
    run_interpreted_suite("symm_hier_overlap_interpreted_cases.py")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="already interpreted: pytest collects the case file directly")
@pytest.mark.release
def test_symm_hier_overlap_interpreted_suite_release():
    run_interpreted_suite("symm_hier_overlap_interpreted_cases.py", release=True)  # its larger adversarial worlds
