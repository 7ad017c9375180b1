"""scripts/memcheck_fused.py (the fused kernels' memcheck driver, run on a GPU under
compute-sanitizer) works: its --device cpu dry run drives every case through the portable fused
kernels under TRITON_INTERPRET=1 and compares the output and every gradient with the fp64 reference."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.release  # every case through six launches in the interpreter; the GPU check runs it for real
def test_memcheck_fused_dry_run_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "memcheck_fused.py"), "--device", "cpu"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ran triton") == 10, r.stdout
    assert r.stdout.rstrip().endswith("memcheck fused cases: all ok")


def test_memcheck_fused_refuses_the_caching_allocator():
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NO_CUDA_MEMORY_CACHING"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "memcheck_fused.py")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in r.stderr


def test_memcheck_mismatch_bound():
    import torch

    from tlx_dist.testing import memcheck_mismatch

    ref = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    assert memcheck_mismatch(ref + 0.1, ref) is None                     # within 5% of max|ref| = 4
    assert "max error 0.5" in memcheck_mismatch(ref + 0.5, ref)          # beyond it
    assert memcheck_mismatch(torch.tensor([1.0, float("nan"), 4.0]), ref) is not None  # garbage fails
    assert memcheck_mismatch(torch.empty(0), torch.empty(0)) is None
