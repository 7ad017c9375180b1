"""The one-launch expert-major layout kernel (tlx/common/routing.py) compiles for every target CI
checks (sm_90, sm_100, gfx942, gfx950), int64 and int32 expert ids, E up to 256 (512 histogram
bins). CPU only; the interpreter tests (tests/routing_interpreted_cases.py) check what it computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tlx

pytestmark = pytest.mark.skipif(not tlx.triton_available(), reason="needs triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tlx.common.routing import _expert_slots_kernel as k
out = {}
for arch in sys.argv[1:]:
    target = GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)
    for ids in ("i64", "i32"):
        for E in (8, 256):
            sig = {"idx_ptr": f"*{ids}", "tok_ptr": "*i32", "order_ptr": "*i64", "offsets_ptr": "*i32",
                   "sched_ptr": "*i32", "S": "i32", "K": "i32", "E": "i32", "ORDER_OFF": "i32",
                   "BM": "constexpr", "EP": "constexpr", "BLOCK": "constexpr"}
            cx = {"BM": 128, "EP": triton.next_power_of_2(E + 1), "BLOCK": 1024}
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
            c = triton.compile(ASTSource(k, sig, constexprs=cx, attrs=attrs), target=target, options={"num_warps": 4})
            out[f"{arch}/{ids}/E{E}"] = len(c.asm["hsaco" if arch.startswith("gfx") else "cubin"])
print(json.dumps(out))
"""


def test_routing_kernel_compiles_for_every_target():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    archs = ["90", "100", "gfx942", "gfx950"]
    r = subprocess.run([sys.executable, "-c", _CHILD, *archs], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    sizes = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(sizes) == len(archs) * 4 and all(v > 0 for v in sizes.values()), sizes
