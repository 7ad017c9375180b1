"""bench/fp8_kernels.py on the GPU (tier T3): the worker-process precompile (bench/_precompile.py)
really fills Triton's cache so that the launch compiles nothing more, with the right answer, and a
short run of the bench (every kernel, the sweep, two shapes) finds every launch config equal to its
default and exits 0. Run: ``pytest -m gpu tests/test_bench_fp8_kernels_gpu.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fp8_kernels as B  # noqa: E402
from _precompile import Precompiler  # noqa: E402

# Collected everywhere (so a CPU run proves the module imports), run only on a GPU.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_precompiled_kernels_load_from_the_cache(tmp_path, monkeypatch):
    from tlx_dist.fp8 import quant as Q

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh cache: nothing compiled before
    x = torch.randn(1000, 384, device="cuda", dtype=torch.bfloat16)
    launch = {"BLOCK_M": 8, "num_warps": 1}  # a config nothing else launches
    pre = Precompiler(2)
    try:
        specs = pre.record(lambda: Q.quantize_rows(x, _launch=launch))
        assert len(specs) == 1 and list(specs.values()) == [("tlx.common.fp8_quant", "_quant_rows_kernel")]
        assert pre.compile(specs) == 0, pre.errors
    finally:
        pre.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert any(p.suffix == ".cubin" for p in files)
    got = Q.quantize_rows(x, _launch=launch)  # loads the worker's kernel: no new file in the cache
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files
    want = Q.quantize_rows_ref(x)
    assert torch.equal(got.q_MC.view(torch.uint8), want.q_MC.view(torch.uint8)) and torch.equal(got.s_MCb, want.s_MCb)


def test_a_short_sweep_matches_every_default(capsys):
    rc = B.main(["--shapes", "olmoe,mixtral", "--tokens", "1024", "--routings", "zipf", "--sweep", "--rep", "5",
                 "--warmup", "2", "--sweep-rep", "2", "--no-results"])
    out = capsys.readouterr().out
    assert rc == 0, out[-4000:]
    assert "MISMATCH" not in out and "ERROR" not in out
    for k in B.KERNELS:
        assert f"### sweep {k}: olmoe T=1024 zipf" in out and f"### sweep {k}: mixtral T=1024 zipf" in out
