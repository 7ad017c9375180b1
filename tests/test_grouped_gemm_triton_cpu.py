"""Portable Triton grouped GEMM under TRITON_INTERPRET=1 (CPU, CI tier T0/T2).

Compares the kernel with an fp64 reference; tolerance per STYLE.md 6:
max|ours - ref64| <= 2 * max|torch_same_dtype - ref64| + atol, where torch_same_dtype is the reference loop
run in the operands' dtype (the error PyTorch itself makes), and atol covers the final rounding to
the output dtype (one ulp-scale term: 1e-5 for fp32, 2e-2 for bf16 at these magnitudes).
Note: under the interpreter the kernel's tl.dot is replaced by a broadcast-sum (NO_DOT) because
fbtriton 3.7.4's interpreter cannot run tl.dot; the GPU tests cover tl.dot itself.
"""

import os
import subprocess
import sys

import pytest
import torch

# Triton decides interpret-or-compile when a kernel is decorated, for the whole process, so the
# interpreted checks run in a child process with TRITON_INTERPRET=1 (keeping this process -- and the
# compile tests beside it -- on the real compiler).
_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _check(ours, same, ref64, dtype, what):
    assert ours.dtype == same.dtype
    # Max-abs errors, as flash-attn's tests compare them.
    assert not torch.isnan(ours).any(), f"{what}: NaN in output"
    err = (ours.double() - ref64).abs().max().item()
    bound = 2 * (same.double() - ref64).abs().max().item() + ATOL[dtype]
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g}"


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


# (counts per expert, N, D, F, why)
CASES = [
    ([10, 0, 35, 35, 10], 100, 48, 40, "zero-row expert, tails in every dim, 10 padding rows"),
    ([70], 70, 32, 24, "E=1, one expert with every row, rows not a multiple of the tile"),
    ([0, 0, 0], 5, 16, 8, "every expert empty: the whole output is padding"),
    ([1, 2, 3, 0, 5, 0, 7], 18, 40, 36, "prime E=7, tiny experts, a single-row expert"),
]


def _one_case(dtype, counts, N, D, F, why):
    from tlx_dist.grouped_gemm import backends
    from tlx_dist.grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref

    torch.manual_seed(0)
    b = backends.get_backend("triton")
    assert b.supports(torch.empty(1, D), torch.empty(1, D, F)) is None
    E = len(counts)
    off = _offsets(counts)
    x = torch.randn(N, D).to(dtype)
    w = torch.randn(E, D, F).to(dtype)
    dy = torch.randn(N, F).to(dtype)
    # Forward; padding rows must come back zero.
    y = b.mm(x, w, off)
    _check(y, grouped_mm_ref(x, w, off), grouped_mm_ref(x.double(), w.double(), off), dtype, f"fwd ({why})")
    assert (y[int(off[-1]):] == 0).all()
    # dX through the transposed (K-contiguous) weight view.
    wt = w.transpose(1, 2)
    dx = b.mm(dy, wt, off)
    _check(dx, grouped_mm_ref(dy, wt, off), grouped_mm_ref(dy.double(), wt.double(), off), dtype, f"dX ({why})")
    # Weight gradient; empty experts must be exactly zero.
    dw = b.wgrad(x, dy, off)
    _check(dw, grouped_mm_wgrad_ref(x, dy, off), grouped_mm_wgrad_ref(x.double(), dy.double(), off), dtype,
           f"dW ({why})")
    for e, c in enumerate(counts):
        if c == 0:
            assert (dw[e] == 0).all()


def _child_main() -> None:
    from tlx_dist.grouped_gemm import backends

    b = backends.get_backend("triton")
    assert "dtype" in b.supports(torch.empty(2, 2, dtype=torch.int32), torch.empty(1, 2, 2, dtype=torch.int32))
    for dtype in (torch.float32, torch.bfloat16):
        for case in CASES:
            _one_case(dtype, *case)
            print("ok", dtype, case[-1], flush=True)


def test_triton_interpret_all_forms():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ok ") == 2 * len(CASES)


def test_triton_refuses_cpu_without_interpreter():
    from tlx_dist.grouped_gemm import backends

    if _CHILD:
        pytest.skip("running inside the interpreter child")
    why = backends.get_backend("triton").supports(torch.empty(2, 2), torch.empty(1, 2, 2))
    assert why is not None and "TRITON_INTERPRET" in why


if __name__ == "__main__":
    _child_main()
