"""Interpreter-only cases (run by tests/test_bench_fp8_kernels.py in a child with TRITON_INTERPRET=1):
the launch overrides the bench's sweep passes (``_launch=``) on the real kernels. With no override
each wrapper launches exactly its constants of before (meta-parameters and grid, recorded by a spy
around the kernel); other configs, through bench/fp8_kernels.py's own Case / run_sweep, give the
default's outputs (bit for bit; combine_bwd's g_gate within its summation-order bound), so a sweep
on the GPU that reports a mismatch points at the config, not at the plumbing. (dequantize_rows_rounded
takes its reference under the interpreter -- its kernel is compiled only -- so its configs are
checked on the GPU: tests/test_bench_fp8_kernels_gpu.py.)"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import fp8_kernels as B  # noqa: E402
import tlx.common.combine as KC  # noqa: E402
import tlx.common.fp8_quant as KQ  # noqa: E402
import tlx.common.fp8_swiglu as KS  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

META = ("BLOCK_M", "BLOCK_C", "BLOCK_R", "BLOCK_D", "num_warps", "num_stages")


class Spy:
    """Stands for a kernel: records each launch's grid and meta-parameters, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((tuple(grid), {k: kw[k] for k in META if k in kw}))
            return self.kernel[grid](*args, **kw)

        return launch


@pytest.fixture(scope="module")
def case():
    # F = 192: partial scale groups and the unpaired SwiGLU backward; D = 768: BLOCK_D 512 cuts the
    # combine's D loop into other chunks than 256 does (2 vs 3), a partial one among them
    return B.Case("tiny", 100, "zipf", dims=(768, 192, 3, 2), device="cpu")


# kernel name in the bench -> (module, kernel attribute, the wrapper's launch constants, grid of it)
BEFORE = {
    "quantize_rows": (KQ, "_quant_rows_kernel", {"BLOCK_M": 32, "num_warps": 4}, lambda c: (-(-c.T // 32), 6)),
    "quantize_cols": (KQ, "_quant_cols_kernel", {"BLOCK_C": 64, "num_warps": 2}, lambda c: (c.N // 128 + 4, 12)),
    "quantize_both": (KQ, "_quant_both_kernel", {"num_warps": 4}, lambda c: (c.N // 128 + 4, 6)),
    "quantize_cols_from_rows": (KQ, "_quant_cols_from_rows_kernel", {"BLOCK_C": 64, "num_warps": 4},
                                lambda c: (c.N // 128 + 4, 12)),
    "swiglu_quant_both": (KS, "_swiglu_quant_tiles_kernel", {"num_warps": 8}, lambda c: (c.N // 128 + 4, 2)),
    "swiglu_bwd_quant_both": (KS, "_swiglu_bwd_quant_tiles_kernel", {"num_warps": 8}, lambda c: (c.N // 128 + 4, 3)),
    "combine_fwd": (KC, "_gather_ksum_kernel", {"BLOCK_R": 4, "BLOCK_D": 256, "num_warps": 4},
                    lambda c: (25, 3)),
    "combine_bwd": (KC, "_combine_bwd_kernel", {"BLOCK_R": 4, "BLOCK_D": 256, "num_warps": 4}, lambda c: (50,)),
    "dispatch_bwd": (KC, "_gather_ksum_kernel", {"BLOCK_R": 4, "BLOCK_D": 256, "num_warps": 4},
                     lambda c: (25, 3)),
}


@pytest.mark.parametrize("kernel", list(BEFORE))
def test_no_override_launches_the_constants_of_before(case, kernel, monkeypatch):
    mod, attr, meta, grid = BEFORE[kernel]
    spy = Spy(getattr(mod, attr))
    monkeypatch.setattr(mod, attr, spy)
    case.ops()[kernel][0](None)
    assert spy.calls == [(grid(case), meta)]
    assert B.default_launch(kernel) == meta  # the sweep's default is what the wrapper launches


@pytest.mark.parametrize("kernel", list(BEFORE))
def test_an_override_reaches_the_kernel_and_its_grid(case, kernel, monkeypatch):
    mod, attr, meta, _ = BEFORE[kernel]
    spy = Spy(getattr(mod, attr))
    monkeypatch.setattr(mod, attr, spy)
    last = B.candidates(kernel)[-1]  # every axis at its largest value
    case.ops()[kernel][0](last)
    (grid, got), = spy.calls
    assert got == last
    if "BLOCK_M" in last:
        assert grid[0] == -(-case.T // last["BLOCK_M"])
    if "BLOCK_C" in last:
        assert grid[1] == -(-case.D // last["BLOCK_C"])
    if "BLOCK_R" in last:
        assert grid[0] == -(-(case.N if kernel == "combine_bwd" else case.T) // last["BLOCK_R"])


@pytest.mark.parametrize("kernel", B.KERNELS)
def test_other_configs_give_the_defaults_outputs(case, kernel):
    call, extract, bounds = case.ops()[kernel]
    cands = B.candidates(kernel)
    cands = [cands[0], cands[1], cands[-1]]  # the default, every axis at its smallest, at its largest
    timed = []
    rows = B.run_sweep(call, extract, cands, lambda fn: timed.append(fn) or 1.0, bounds())
    assert [r["error"] for r in rows] == ["", "", ""]
    assert [r["launch"] for r in rows] == cands and len(timed) == 3


def test_cols_from_rows_refuses_a_block_that_splits_a_scale_group(case):
    from tlx_dist.fp8 import quant as Q

    with pytest.raises(ValueError, match="BLOCK_C=256 must divide 128"):
        Q.quantize_cols_from_rows(case.rows, case.off, dtype=torch.bfloat16, _launch={"BLOCK_C": 256})
    with pytest.raises(ValueError, match=r"\['FMT'\] not launch parameters"):
        Q.quantize_rows(case.x_TD, _launch={"FMT": 1})
