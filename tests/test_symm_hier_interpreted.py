"""Runs tests/symm_hier_interpreted_cases.py (the hierarchical exchange's kernels under the Triton
interpreter, on CPU) in a child pytest with TRITON_INTERPRET=1, so that this process keeps compiling
kernels."""

from __future__ import annotations

import os

import pytest
from _interp import run_interpreted_suite

pytest.importorskip("triton")


_SKIP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                           reason="already interpreted: pytest collects the case files directly")


# one child per case file, each under its own limit (W = 8 worlds of every op, each rank's kernels
# interpreted: minutes on a two-core machine)
@_SKIP
def test_symm_hier_worlds_interpreted_suite():
    run_interpreted_suite("symm_hier_interpreted_cases.py")


@_SKIP
def test_symm_hier_more_interpreted_suite():
    run_interpreted_suite("symm_hier_more_interpreted_cases.py")
