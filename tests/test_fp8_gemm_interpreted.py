"""The plain-Triton FP8 grouped GEMM (tlx/amd/fp8_grouped_gemm.py) run on CPU under the interpreter,
in a child process (fp8_gemm_interpreted_cases.py says what it covers)."""

import pytest

from _interp import run_interpreted_suite


@pytest.mark.slow
def test_fp8_grouped_gemm_interpreted():
    pytest.importorskip("triton")
    run_interpreted_suite("fp8_gemm_interpreted_cases.py")
