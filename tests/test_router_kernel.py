"""The one-launch router (tlx/portable/router.py): runs tests/router_interpreted_cases.py (against the
torch ops and fp64 definitions, under the Triton interpreter) in a TRITON_INTERPRET=1 child, and
compiles the forward and backward kernels for every target CI checks (sm_90, sm_100, gfx942,
gfx950) at E = 8, 64 and 256 with and without the bias / normalisation / loss gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _interp import run_interpreted_suite

import tlx

pytestmark = pytest.mark.skipif(not tlx.triton_available(), reason="needs triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted: pytest collects it directly")
def test_router_kernel_interpreted():
    run_interpreted_suite("router_interpreted_cases.py", timeout=300)


_CHILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tlx.portable.router import _router_bwd_kernel, _router_fwd_kernel, _router_sums_kernel
from tlx_dist.router import _router_block
out = {}
for arch in sys.argv[1:]:
    target = GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)
    for E, K, soft, flag in ((8, 2, True, True), (64, 8, True, False), (256, 8, False, True)):
        EP, bt = triton.next_power_of_2(E), _router_block(E)
        sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i64", "gate_ptr": "*fp32",
               "part_ptr": "*fp32", "T": "i32", "scale": "fp32", "E": "constexpr", "EP": "constexpr",
               "K": "constexpr", "KP": "constexpr", "SOFTMAX": "constexpr", "HAS_BIAS": "constexpr",
               "ROUTE_NORM": "constexpr", "BT": "constexpr"}
        cx = dict(E=E, EP=EP, K=K, KP=triton.next_power_of_2(K), SOFTMAX=soft, HAS_BIAS=flag, ROUTE_NORM=flag, BT=bt)
        c = triton.compile(ASTSource(_router_fwd_kernel, sig, constexprs=cx), target=target, options={"num_warps": 4})
        out[f"{arch}/fwd/E{E}"] = len(c.asm["hsaco" if arch.startswith("gfx") else "cubin"])
        sig = {"logits_ptr": "*fp32", "idx_ptr": "*i64", "g_gate_ptr": "*fp32", "g_q_ptr": "*fp32",
               "g_z_ptr": "*fp32", "dl_ptr": "*fp32", "T": "i32", "scale": "fp32", "E": "constexpr",
               "EP": "constexpr", "K": "constexpr", "KP": "constexpr", "SOFTMAX": "constexpr",
               "ROUTE_NORM": "constexpr", "HAS_GGATE": "constexpr", "HAS_GQ": "constexpr", "HAS_GZ": "constexpr",
               "BT": "constexpr"}
        cx = dict(E=E, EP=EP, K=K, KP=triton.next_power_of_2(K), SOFTMAX=soft, ROUTE_NORM=flag, HAS_GGATE=True,
                  HAS_GQ=flag, HAS_GZ=flag, BT=bt)
        c = triton.compile(ASTSource(_router_bwd_kernel, sig, constexprs=cx), target=target, options={"num_warps": 4})
        out[f"{arch}/bwd/E{E}"] = len(c.asm["hsaco" if arch.startswith("gfx") else "cubin"])
        bc = min(256, triton.next_power_of_2(3 * E + 2))
        sig = {"part_ptr": "*fp32", "NB": "i32", "q_ptr": "*fp32", "fin_ptr": "*fp32", "slots_ptr": "*i64",
               "nfin_ptr": "*fp32", "zsum_ptr": "*fp32", "E": "constexpr", "BC": "constexpr", "BR": "constexpr"}
        c = triton.compile(ASTSource(_router_sums_kernel, sig, constexprs=dict(E=E, BC=bc, BR=max(1, 4096 // bc))),
                           target=target, options={"num_warps": 4})
        out[f"{arch}/sums/E{E}"] = len(c.asm["hsaco" if arch.startswith("gfx") else "cubin"])
print(json.dumps(out))
"""


def test_router_kernels_compile_for_every_target():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    archs = ["90", "100", "gfx942", "gfx950"]
    r = subprocess.run([sys.executable, "-c", _CHILD, *archs], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    sizes = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(sizes) == len(archs) * 9 and all(v > 0 for v in sizes.values()), sizes
