"""Runs tests/symm_interpreted_cases.py (the symmetric-memory kernels under the Triton interpreter, on
CPU) in a child pytest with TRITON_INTERPRET=1, so that this process keeps compiling kernels."""

from __future__ import annotations

import os

import pytest
from _interp import run_interpreted_suite

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted: pytest collects it directly")
def test_symm_dispatch_interpreted_suite():
    run_interpreted_suite("symm_interpreted_cases.py",
                          "symm_nvshmem_interpreted_cases.py",  # the emulated cross-node route
                          "symm_rows_interpreted_cases.py",  # the fused EP exchange
                          "symm_ce_interpreted_cases.py")  # its copy-engine row form
