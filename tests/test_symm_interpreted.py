"""Runs tests/symm_*_interpreted_cases.py (the symmetric-memory kernels under the Triton interpreter, on
CPU), each file in a child pytest with TRITON_INTERPRET=1, so that this process keeps compiling kernels."""

from __future__ import annotations

import os

import pytest
from _interp import run_interpreted_suite

pytest.importorskip("triton")


_SKIP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                           reason="already interpreted: pytest collects the case files directly")


# one child per case file, each under its own time limit (the four in one child could run past a
# single child's limit on a slow two-core machine)
@_SKIP
def test_symm_dispatch_interpreted_suite():
    run_interpreted_suite("symm_interpreted_cases.py")


@_SKIP
def test_symm_nvshmem_route_interpreted_suite():
    run_interpreted_suite("symm_nvshmem_interpreted_cases.py")  # the emulated cross-node route


@_SKIP
def test_symm_rows_interpreted_suite():
    run_interpreted_suite("symm_rows_interpreted_cases.py")  # the fused EP exchange


@_SKIP
def test_symm_copy_engine_interpreted_suite():
    run_interpreted_suite("symm_ce_interpreted_cases.py")  # its copy-engine row form


@_SKIP
def test_symm_fp8_dispatch_interpreted_suite():
    run_interpreted_suite("symm_fp8_interpreted_cases.py")  # packed FP8 rows on both routes
