"""MoELayer under ``torch.compile(fullgraph=True)`` on CPU (tier T0), and the bf16 forward+backward
check of tests/test_moe_gpu.py run on CPU.

The compile runs in a fresh process on purpose: the first grouped GEMM of a process loads the
kernel backends, and that must not break the graph when it happens inside the trace (it did: an
import is untraceable). ``aot_eager`` traces exactly what inductor would get (dynamo + AOT
autograd, forward and backward graphs) without a C++ compile; the GPU tier runs inductor.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import torch
torch.set_num_threads(1)
from test_moe_gpu import check_bf16_fwd_bwd_vs_fp64
compiled = {}
def run(layer, x):
    f = compiled.setdefault("f", torch.compile(lambda t: layer(t), fullgraph=True, backend="aot_eager"))
    return f(x)
check_bf16_fwd_bwd_vs_fp64("torch", device="cpu", run=run)   # compiled before any eager grouped_mm
print("ok compiled", flush=True)
check_bf16_fwd_bwd_vs_fp64("reference", device="cpu")
print("ok eager", flush=True)
"""


def test_compile_fullgraph_fwd_bwd_first_call_and_bf16_grads_cpu():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests") + os.pathsep + ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "ok compiled" in r.stdout and "ok eager" in r.stdout
