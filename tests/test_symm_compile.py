"""The symmetric dispatch/combine kernels compile to cubin for sm_90 and sm_100 without a GPU (T2).

Compiled in a child process with ``TRITON_INTERPRET`` unset: Triton picks compiled vs interpreted
when a kernel is decorated, and the CPU interpreter tests of this suite set it at collection.
Checks what each kernel exists for in the PTX: system-scope release atomics for signals and
system-scope acquire loads for the polls (Triton lowers the ``atomic_add(p, 0, acquire)`` poll to
``ld.global.sys.acquire``: no read-modify-write traffic while spinning), and global row copies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tlx

pytestmark = pytest.mark.skipif(not tlx.triton_available(), reason="triton is not importable")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _specs():
    W, E, D_WORDS = 8, 256, 1792  # a DeepSeek-V3-sized row (7168 bf16 = 1792 int64 words)
    offs = dict(OFF_STATE=0, OFF_FLAGS=256, OFF_ARRIVE=512, OFF_COUNTS=768)
    big = dict(OFF_SRC=33536, OFF_RECV=1082112)
    common = dict(W=W, WP=8, N_CAP=131072, WORDS=D_WORDS, BLOCK_M=8, BLOCK_W=256)
    return {
        "_barrier_signal_kernel": (
            dict(peers_ptr="*i64", pes_ptr="*i32", counts_E_ptr="*i64", RANK="i32"),
            dict(W=W, WP2=16, E=E, BLOCK_E=E, HAS_COUNTS=True, USE_NVSHMEM=False, **offs)),
        "_barrier_wait_kernel": (
            dict(peers_ptr="*i64", counts_WE_ptr="*i64", RANK="i32"),
            dict(W=W, E=E, BLOCK_E=E, HAS_COUNTS=True, OFF_STATE=0, OFF_FLAGS=256, OFF_COUNTS=768)),
        "_dispatch_send_kernel": (
            dict(src_ptr="*i64", stride_src="i64", order_ptr="*i64", dest_rank_ptr="*i64", dest_row_ptr="*i64",
                 peers_ptr="*i64", pes_ptr="*i32", RANK="i32", S="i32", K="i32"),
            dict(S_MAX=131072, ROW_BYTES=8 * D_WORDS, OFF_STATE=0, OFF_ARRIVE=512, SRC_IS_SLOT=False,
                 USE_NVSHMEM=False, **big, **common)),
        "_dispatch_recv_kernel": (
            dict(out_ptr="*i64", src_out_ptr="*i64", expected_ptr="*i64", peers_ptr="*i64", RANK="i32"),
            dict(OFF_STATE=0, OFF_ARRIVE=512, COPY_ROWS=True, **big, **common)),
        "_combine_send_kernel": (
            dict(y_ptr="*i64", stride_y="i64", src_ids_ptr="*i64", expected_ptr="*i64", peers_ptr="*i64",
                 pes_ptr="*i32", RANK="i32"),
            dict(S_MAX=131072, ROW_BYTES=8 * D_WORDS, OFF_ARRIVE=512, OFF_COMB=2 ** 31, USE_NVSHMEM=False,
                 **common)),
        "_combine_recv_kernel": (
            dict(out_ptr="*i64", row_S_ptr="*i64", expected_ptr="*i64", peers_ptr="*i64", RANK="i32", S="i32"),
            dict(W=W, N_CAP=131072, WORDS=D_WORDS, OFF_ARRIVE=512, OFF_COMB=2 ** 31, COPY_ROWS=True,
                 BLOCK_M=8, BLOCK_W=256)),
    }


def _compile_all(arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx import comm

    out = {}
    for name, (sig, constexprs) in _specs().items():
        sig = dict(sig, **{k: "constexpr" for k in constexprs})
        k = triton.compile(ASTSource(getattr(comm, name), sig, constexprs=constexprs),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
        ptx = k.asm["ptx"]
        out[name] = dict(cubin=len(k.asm["cubin"]), release=ptx.count("sys.release"),
                         acquire=ptx.count("sys.acquire"), st=ptx.count("st.global"), ld=ptx.count("ld.global"))
    return out


@pytest.fixture(scope="module", params=[90, 100], ids=["sm_90", "sm_100"])
def compiled(request):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(request.param)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_compile_with_signal_semantics(compiled):
    for name, info in compiled.items():
        assert info["cubin"] > 0, name
    # Producers publish with release atomics at system scope; consumers poll with acquire.
    for name in ("_barrier_signal_kernel", "_dispatch_send_kernel", "_combine_send_kernel"):
        assert compiled[name]["release"] > 0, f"{name}: no release atomic"
    for name in ("_barrier_wait_kernel", "_dispatch_recv_kernel", "_combine_recv_kernel"):
        assert compiled[name]["acquire"] > 0, f"{name}: no acquire poll"
    for name in ("_dispatch_send_kernel", "_combine_send_kernel", "_dispatch_recv_kernel"):
        assert compiled[name]["st"] > 0 and compiled[name]["ld"] > 0, f"{name}: no row copy"


if __name__ == "__main__":
    print(json.dumps(_compile_all(int(sys.argv[1]))))
