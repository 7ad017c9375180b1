"""The AMD TLX grouped GEMM (tlx/amd/grouped_gemm.py) run under TRITON_INTERPRET=1 on the CPU.

No AMD GPU is available to this project, and TLX's LDS and MFMA operations do not run under the
interpreter, so the kernel is run with EMULATE=True: the LDS ring lives in a global scratch buffer
and the MMA is a broadcast-sum. Everything else is the code compiled for gfx942/gfx950 -- the
persistent tile walk of the shared scheduler, the XCD id remap, the dW atomic tile claims in
longest-expert-first order, the masked addressing of all three forms, the ring's prologue /
steady state / drain slot arithmetic and the masked epilogue. What this does not cover: the
direct-to-LDS copies, the LDS layouts, the MFMA lowering and the wave-group synchronisation
(tests/test_tlx_compile.py compiles those; they have never run on hardware).

Tolerance (STYLE.md 6, tlx_dist.testing): max|ours - ref64| <= 2 * max|torch_bf16 - ref64| + atol.
Outputs are poisoned with NaN first, so an element no tile wrote shows up.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
import tlx  # noqa: E402

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


# (counts per expert, N, D, F, why). D and F are multiples of 8, as the backend requires.
CASES = [
    ([10, 0, 35, 35, 10], 100, 48, 40, "zero-row expert; D, F not multiples of the tile; 10 padding rows"),
    ([70], 70, 72, 24, "E=1 owns every row; K = 72 runs the ring's steady state (> NB k-steps)"),
    ([0, 0, 0], 5, 16, 8, "every expert empty: the output is all padding, dW all zeros"),
    ([1, 2, 3, 0, 5, 0, 7], 18, 40, 56, "prime E=7, tiny experts, a single-row expert"),
    ([3, 90, 0, 41], 150, 24, 88, "an expert spanning several m-tiles; dW K = 90 rows > NB k-steps"),
]
# (tile config, persistent programs). Tiny tiles keep the interpreter fast; the kernel has no
# tile-size constraint of its own.
RUNS = [
    (SimpleNamespace(BM=32, BN=16, BK=16, STAGES=2, GROUP_M=1), 3),
    # 3 ring slots; GROUP_M raster with a partial last group; 10 programs > 8 XCDs and not a
    # multiple of 8: the id remap's uneven branch.
    (SimpleNamespace(BM=16, BN=32, BK=16, STAGES=3, GROUP_M=4), 10),
]


def _one_case(cfg, programs, counts, N, D, F, why):
    from tlx_dist.grouped_gemm.amd_backend import _mm_with, _wgrad_with
    from tlx_dist.grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref
    from tlx_dist.testing import assert_close_to_ref

    torch.manual_seed(len(counts) * 7 + N)
    E = len(counts)
    off = _offsets(counts)
    x = torch.randn(N, D).bfloat16()
    w = torch.randn(E, D, F).bfloat16()
    dy = torch.randn(N, F).bfloat16()
    what = f"{why} [BM={cfg.BM} BN={cfg.BN} BK={cfg.BK} NB={cfg.STAGES} GROUP_M={cfg.GROUP_M} P={programs}]"
    run = dict(emulate=True, programs=programs)

    y = torch.full((N, F), float("nan"), dtype=torch.bfloat16)
    _mm_with(cfg, "gfx942", x, w, off, y, **run)
    assert_close_to_ref(y, grouped_mm_ref(x.double(), w.double(), off), grouped_mm_ref(x, w, off), name=f"fwd {what}")
    assert (y[int(off[-1]):] == 0).all(), f"fwd {what}: padding rows are not zero"

    wt = w.transpose(1, 2)  # dX: the K-contiguous weight view
    dx = torch.full((N, D), float("nan"), dtype=torch.bfloat16)
    _mm_with(cfg, "gfx950", dy, wt, off, dx, **run)
    assert_close_to_ref(dx, grouped_mm_ref(dy.double(), wt.double(), off), grouped_mm_ref(dy, wt, off),
                        name=f"dX {what}")

    dws = {}
    for schedule in ("lpt", "static"):
        dw = torch.full((E, D, F), float("nan"), dtype=torch.bfloat16)
        _wgrad_with(SimpleNamespace(**vars(cfg), dw_order=schedule), "gfx942", x, dy, off, dw, **run)
        assert_close_to_ref(dw, grouped_mm_wgrad_ref(x.double(), dy.double(), off), grouped_mm_wgrad_ref(x, dy, off),
                            name=f"dW {schedule} {what}")
        for e, c in enumerate(counts):
            assert c or (dw[e] == 0).all(), f"dW {what}: expert {e} has no rows but a non-zero gradient"
        dws[schedule] = dw
    # Same tiles in the same K order, only the walk differs: bitwise equal.
    assert torch.equal(dws["lpt"], dws["static"]), f"dW {what}: lpt and static walks differ"


def _child_main(run: int) -> None:
    cfg, programs = RUNS[run]
    for n, case in enumerate(CASES, 1):
        _one_case(cfg, programs, *case)
        print("ok", n, case[-1], flush=True)


# one interpreter child per tile config: the first in the fast tier, the second (the GROUP_M raster and
# the XCD remap's uneven branch) in the release tier
@pytest.mark.slow
@pytest.mark.parametrize("run", [0, pytest.param(1, marks=pytest.mark.release)])
def test_amd_kernel_interpreted_all_forms(run):
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), str(run)], env=env, capture_output=True,
                       text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ok ") == len(CASES)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
