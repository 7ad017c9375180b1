"""Runs tests/symm_*_interpreted_cases.py (the symmetric-memory kernels under the Triton interpreter, on
CPU), each file in a child pytest with TRITON_INTERPRET=1, so that this process keeps compiling kernels."""

from __future__ import annotations

import os

import pytest
from _interp import run_interpreted_suite

pytest.importorskip("triton")


_SKIP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                           reason="already interpreted: pytest collects the case files directly")


# one child per case file, each under its own time limit (the four in one child took 664 s on a slow
# two-core machine in session 18, past the 540 s limit; ~3 min on the usual one)
@_SKIP
def test_symm_dispatch_interpreted_suite():
    run_interpreted_suite("symm_interpreted_cases.py")


@_SKIP
@pytest.mark.release
def test_symm_dispatch_interpreted_suite_release():
    run_interpreted_suite("symm_interpreted_cases.py", release=True)  # its W >= 8 worlds, 1-row tiles


@_SKIP
def test_symm_nvshmem_route_interpreted_suite():
    run_interpreted_suite("symm_nvshmem_interpreted_cases.py")  # the emulated cross-node route


@_SKIP
def test_symm_rows_interpreted_suite():
    run_interpreted_suite("symm_rows_interpreted_cases.py")  # the fused EP exchange


@_SKIP
def test_symm_copy_engine_interpreted_suite():
    run_interpreted_suite("symm_ce_interpreted_cases.py")  # its copy-engine row form


# the release tier's cases of the other three files (their 4-rank worlds), one child for all three
@_SKIP
@pytest.mark.release
def test_symm_rows_nvshmem_copy_engine_interpreted_suites_release():
    run_interpreted_suite("symm_nvshmem_interpreted_cases.py", "symm_rows_interpreted_cases.py",
                          "symm_ce_interpreted_cases.py", release=True)
