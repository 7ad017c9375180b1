"""Runs tests/symm_*_interpreted_cases.py (the symmetric-memory kernels under the Triton interpreter, on
CPU), each file in a child pytest with TRITON_INTERPRET=1, so that this process keeps compiling kernels.
The fast tier's eight children run two at a time (tests/_interp.py's SuitePool), each under its own
time limit, and each test checks its own child."""

from __future__ import annotations

import os

import pytest
from _interp import SuitePool, run_interpreted_suite

pytest.importorskip("triton")


_SKIP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                           reason="already interpreted: pytest collects the case files directly")

# test -> its case file, the longest first (the pool starts them in this order)
_FAST = {
    "test_symm_hier_overlap_interpreted_suite": "symm_hier_overlap_interpreted_cases.py",  # the overlap across nodes
    "test_symm_rows_interpreted_suite": "symm_rows_interpreted_cases.py",       # the fused EP exchange
    "test_symm_hier_worlds_interpreted_suite": "symm_hier_interpreted_cases.py",  # the hierarchical exchange
    "test_symm_dispatch_interpreted_suite": "symm_interpreted_cases.py",
    "test_symm_hier_more_interpreted_suite": "symm_hier_more_interpreted_cases.py",  # its row form, waits, route
    "test_symm_copy_engine_interpreted_suite": "symm_ce_interpreted_cases.py",  # the row form by copy engines
    "test_symm_nvshmem_route_interpreted_suite": "symm_nvshmem_interpreted_cases.py",  # emulated cross-node route
    "test_symm_fp8_dispatch_interpreted_suite": "symm_fp8_interpreted_cases.py",  # packed FP8 rows, both routes
}


@pytest.fixture(scope="module")
def fast_suites(request):
    """Starts the children of the selected fast tests (only those) when the first of them runs."""
    selected = {item.name for item in request.session.items}
    pool = SuitePool(workers=2)
    futures = {name: pool.submit(f) for name, f in _FAST.items() if name in selected}
    yield futures
    pool.close()


def _check(fast_suites, request):
    fast_suites[request.node.name].result().check()


@_SKIP
def test_symm_rows_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
def test_symm_dispatch_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
def test_symm_nvshmem_route_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
def test_symm_copy_engine_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
@pytest.mark.release
def test_symm_dispatch_interpreted_suite_release():
    run_interpreted_suite("symm_interpreted_cases.py", release=True)  # its W >= 8 worlds, 1-row tiles


# the release tier's cases of the other three files (their 4-rank worlds), one child for all three
@_SKIP
@pytest.mark.release
def test_symm_rows_nvshmem_copy_engine_interpreted_suites_release():
    run_interpreted_suite("symm_nvshmem_interpreted_cases.py", "symm_rows_interpreted_cases.py",
                          "symm_ce_interpreted_cases.py", release=True)


@_SKIP
def test_symm_fp8_dispatch_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
def test_symm_hier_worlds_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
def test_symm_hier_more_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
def test_symm_hier_overlap_interpreted_suite(fast_suites, request):
    _check(fast_suites, request)


@_SKIP
@pytest.mark.release
def test_symm_hier_overlap_interpreted_suite_release():
    run_interpreted_suite("symm_hier_overlap_interpreted_cases.py", release=True)  # its 8-rank worlds
