"""The hierarchical exchange's kernels (tlx/comm/hier.py) compile for sm_90 and sm_100 (T2; no GPU
needed), their NVSHMEM variants link NVSHMEM's device bitcode, and their PTX obeys the protocol
that tests/test_symm_nvshmem_compile.py checks for the flat kernels (its ``analyze``): signals,
fences and quiets by one thread; every block-collective put reached by every thread of the CTA,
from addresses of this rank's symmetric region (the peer table), never from a payload tensor.

Constants: W = 16 as two nodes of 8 (EP = 16 across two 8-GPU nodes), E = 256, K = 8, D = 7168,
T_max = 4096, bf16, every offset from a real staging layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tlx

pytestmark = [pytest.mark.skipif(not tlx.triton_available(), reason="triton is not importable"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, L, E, K, D, T_MAX = 16, 8, 256, 8, 7168, 4096


def _specs():
    """name -> (kernel, signature, constexprs) of every hierarchical kernel variant the host launches."""
    import torch
    import triton.language as tl

    from tlx_dist.comm.symm.buffers import SymmLayout
    from tlx_dist.comm.symm.hier_layout import HierLayout

    base = SymmLayout.build(T_MAX, D, K, E, W, torch.bfloat16, staging=True)
    H = HierLayout.build(base.nbytes, W, T_MAX, K, D, 2, L, staging=True)
    N, e = W // L, E // W
    wait = dict(TIMEOUT_NS=30 * 10**9, CLOCK=1)
    common = dict(W=W, WP=W, K=K, KP=K, L=L, D=D, T_MAX=T_MAX, HM=H.hmeta_words)
    hoff = dict(OFF_HMETA=H.off_hmeta, OFF_HFLAG=H.off_hflag, OFF_HCNT=H.off_hcnt, OFF_HARRIVE=H.off_harrive)
    route = ("_node_route_kernel",
             dict(idx_ptr="*i64", send_row_ptr="*i32", counts_ptr="*i64", nrow_ptr="*i32", near_ptr="*i32",
                  comb_row_ptr="*i32", ncnt_ptr="*i64", comb_to_ptr="*i64", T="i32", RANK="i32"),
             dict(K=K, KP=K, E=E, E_LOCAL=e, W=W, WP=W, L=L, N=N, NP=N, BLOCK_T=256))
    send_sig = dict(x_ptr="*bf16", stride_x="i64", T="i32", nrow_ptr="*i32", send_row_ptr="*i32", idx_ptr="*i64",
                    q_ptr="*i32", start_ptr="*i64", gate_ptr="*fp32", ncnt_ptr="*i64", ctr_ptr="*i64",
                    peers_ptr="*i64", RANK="i32")
    send_cx = dict(common, E_LOCAL=e, LP=L, N=N, OFF_STATE=base.off_state, OFF_RECV=base.off_recv,
                   OFF_GATES=base.off_gates, **hoff, WITH_META=True, RAW_META=False, BLOCK_T=4, BLOCK_D=1024,
                   OFF_SROWS=0, OFF_SGATES=0, OFF_SHMETA=0, OFF_SHCNT=0, USE_NVSHMEM=False)
    far = dict(USE_NVSHMEM=True, OFF_SROWS=base.off_srows, OFF_SGATES=base.off_sgates, OFF_SHMETA=H.off_shmeta,
               OFF_SHCNT=H.off_shcnt)
    fwd_sig = dict(hmeta_ptr="*i32", hcnt_ptr="*i64", hexp_ptr="*i64", ctr_ptr="*i64", peers_ptr="*i64", RANK="i32")
    fwd_cx = dict(common, LP=L, META_W=K + 1, DT=tl.bfloat16, OFF_STATE=base.off_state, OFF_RECV=base.off_recv,
                  OFF_META=base.off_meta, OFF_GATES=base.off_gates, OFF_ARRIVE=base.off_arrive, **hoff,
                  OFF_HDONE=H.off_hdone, FROM_REGION=True, BLOCK_R=8, BLOCK_D=512, **wait)
    rs_sig = dict(y_ptr="*bf16", part_ptr="*bf16", pos_ptr="*i32", gate_ptr="*bf16", tok_ptr="*i32",
                  rows_from_ptr="*i64", ctr_ptr="*i64", peers_ptr="*i64", RANK="i32", N_EXP="i32")
    rs_cx = dict(W=W, WP=W, K=K, KP=K, L=L, D=D, T_MAX=T_MAX, OFF_HCOMB=H.off_hcomb, OFF_HCARR=H.off_hcarr,
                 GATED=True, ROWS=False, PART=False, EMULATE=False, ACC=tl.float32, BLOCK_R=8, BLOCK_D=512)
    rc_sig = dict(fwd_sig)
    rc_cx = dict(W=W, WP=W, K=K, L=L, LP=L, D=D, T_MAX=T_MAX, HM=H.hmeta_words, DT=tl.bfloat16, ACC=tl.float32,
                 OFF_STATE=base.off_state, OFF_ARRIVE=base.off_arrive, OFF_COMB=base.off_comb, OFF_HCOMB=H.off_hcomb,
                 OFF_HCARR=H.off_hcarr, OFF_HDONE=H.off_hdone, BLOCK_R=8, BLOCK_D=512, OFF_SCOMB=0,
                 USE_NVSHMEM=False, **wait)
    nvshmem = {
        "_hier_send_kernel": ("_hier_send_kernel", dict(send_sig, pes_ptr="*i32"), dict(send_cx, **far)),
        "_hier_send_kernel[raw]": ("_hier_send_kernel", dict(send_sig, pes_ptr="*i32"),
                                   dict(send_cx, RAW_META=True, **far)),
        "_relay_combine_kernel": ("_relay_combine_kernel", dict(rc_sig, pes_ptr="*i32"),
                                  dict(rc_cx, USE_NVSHMEM=True, OFF_SCOMB=base.off_scomb)),
        # the overlapped dispatch's halves: everything but the token rows in the op, the rows after it
        "_hier_send_kernel[split1]": ("_hier_send_kernel", dict(send_sig, pes_ptr="*i32"),
                                      dict(send_cx, RAW_META=True, SPLIT=1, OFF_HRROWS=H.off_hrrows, **far)),
        "_hier_send_kernel[split2]": ("_hier_send_kernel", dict(send_sig, pes_ptr="*i32"),
                                      dict(send_cx, WITH_META=False, SPLIT=2, OFF_HRROWS=H.off_hrrows, **far)),
    }
    # ... and the relays' forward of those rows, which ends the op (its readiness signals to the other node)
    ending = {"_relay_forward_kernel[split2_end]": ("_relay_forward_kernel", dict(fwd_sig, pes_ptr="*i32"),
                                                   dict(fwd_cx, FROM_REGION=False, SPLIT=2, OFF_HRROWS=H.off_hrrows,
                                                        OFF_HFROWS=H.off_hfrows, END=True, WP3=64,
                                                        OFF_FLAGS=base.off_flags, USE_NVSHMEM=True))}
    plain = {
        "_node_route_kernel": route,
        "_hier_send_kernel[peer]": ("_hier_send_kernel", send_sig, send_cx),
        "_relay_forward_kernel": ("_relay_forward_kernel", fwd_sig, fwd_cx),
        "_relay_forward_kernel[grad]": ("_relay_forward_kernel", fwd_sig, dict(fwd_cx, FROM_REGION=False)),
        "_hier_reduce_send_kernel": ("_hier_reduce_send_kernel", rs_sig, rs_cx),
        "_hier_reduce_send_kernel[rows]": ("_hier_reduce_send_kernel", rs_sig, dict(rs_cx, GATED=False, ROWS=True)),
        # the overlapped forward's early send: fp32 accumulator rows in, rounded rows out and home
        "_hier_reduce_send_kernel[part]": ("_hier_reduce_send_kernel", dict(rs_sig, y_ptr="*fp32"),
                                           dict(rs_cx, GATED=False, ROWS=True, PART=True)),
        "_relay_combine_kernel[peer]": ("_relay_combine_kernel", rc_sig, rc_cx),
        "_relay_forward_kernel[split1]": ("_relay_forward_kernel", fwd_sig,
                                          dict(fwd_cx, SPLIT=1, OFF_HRROWS=H.off_hrrows, OFF_HFROWS=H.off_hfrows)),
    }
    # the dy rows of combine's backward: rows only, no count post (the relay has the dispatch's)
    grad = {"_hier_send_kernel[grad]": ("_hier_send_kernel", dict(send_sig, pes_ptr="*i32"),
                                        dict(send_cx, WITH_META=False, **far))}
    return {**nvshmem, **ending}, grad, plain


def _compile_all(arch: str, lib: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from test_symm_compile import _ptxas_info
    from test_symm_nvshmem_compile import analyze
    from tlx.comm import hier

    target = GPUTarget("cuda", int(arch), 32)
    nvshmem, grad, plain = _specs()

    def build(fn, sig, cx, **opts):
        full = dict(sig, **{k: "constexpr" for k in cx})
        return triton.compile(ASTSource(getattr(hier, fn), full, constexprs=cx), target=target,
                              options={"num_warps": 4, **opts})

    out = {}
    for name, (fn, sig, cx) in {**nvshmem, **grad}.items():
        linked = build(fn, sig, cx, extern_libs={"libnvshmem_device": lib})
        unlinked = build(fn, sig, cx, ptx_options="-c")  # relocatable: NVSHMEM calls stay calls
        params = [a for a in getattr(hier, fn).arg_names if sig.get(a, "constexpr") != "constexpr"]
        params += ["<scratch>"] * 4
        ptx = linked.asm["ptx"]
        out[name] = dict(binary=len(linked.asm["cubin"]), state="nvshmemi_device_state_d" in ptx,
                         unresolved=[], **analyze(unlinked.asm["ptx"], getattr(hier, fn).fn.__name__, params))
    for name, (fn, sig, cx) in plain.items():  # offered the library: no NVSHMEM call in them
        k = build(fn, sig, cx, extern_libs={"libnvshmem_device": lib})
        out[name] = dict(binary=len(k.asm["cubin"]), nvshmem=k.asm["ptx"].count("nvshmem"),
                         **dict(zip(("spill_bytes", "regs"), _ptxas_info(k.asm["ptx"], arch))))
    return out


@pytest.fixture(scope="module", params=["90", "100"], ids=["sm_90", "sm_100"])
def compiled(request):
    from test_symm_nvshmem_compile import _bitcode
    lib = _bitcode(int(request.param))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, request.param, lib], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SENDERS = ("_hier_send_kernel", "_hier_send_kernel[raw]", "_hier_send_kernel[grad]", "_relay_combine_kernel",
           "_hier_send_kernel[split1]", "_hier_send_kernel[split2]", "_relay_forward_kernel[split2_end]")
PUTTERS = tuple(n for n in SENDERS if n != "_relay_forward_kernel[split2_end]")  # (it only signals readiness)
# Tensors whose bytes a put must never read directly (addresses may derive from index tensors:
# nrow, hmeta's token ids)
PAYLOAD = ("x_ptr", "gate_ptr", "ncnt_ptr")


def test_hier_kernels_compile(compiled):
    for name, info in compiled.items():
        assert info["binary"] > 0, name
    for name in SENDERS:  # linked with NVSHMEM: the module needs (and gets) nvshmemx_cumodule_init
        assert compiled[name]["state"], name
    for name in ("_node_route_kernel", "_hier_send_kernel[peer]", "_relay_forward_kernel",
                 "_relay_forward_kernel[grad]", "_hier_reduce_send_kernel", "_hier_reduce_send_kernel[rows]",
                 "_hier_reduce_send_kernel[part]", "_relay_combine_kernel[peer]", "_relay_forward_kernel[split1]"):
        assert compiled[name]["nvshmem"] == 0, f"{name} references NVSHMEM without USE_NVSHMEM"


def test_hier_signals_by_one_thread(compiled):
    for name in SENDERS:
        calls = compiled[name]["calls"]
        signals = [c for c in calls if c["fn"] in ("nvshmemx_signal_op", "nvshmem_quiet", "nvshmem_fence")]
        assert {c["fn"] for c in signals} >= {"nvshmem_quiet", "nvshmemx_signal_op"}, (name, calls)
        for c in signals:
            assert c["one"], f"{name}: {c['fn']} is reachable by threads other than thread 0"
            if c["fn"] == "nvshmemx_signal_op":
                assert c["op"] in ("9", "10"), f"{name}: signal op {c['op']}"


def test_hier_puts_block_collective_from_symmetric_memory(compiled):
    for name in PUTTERS:
        puts = [c for c in compiled[name]["calls"] if c["fn"] == "nvshmemx_putmem_block"]
        assert puts, f"{name}: no put"
        for c in puts:
            assert c["all"], f"{name}: a putmem_block is reached by only some threads of the CTA"
            for arg in ("src", "dst"):
                assert "peers_ptr" in c[arg], f"{name}: put {arg} does not come from this rank's symmetric base"
                bad = set(c[arg]) & set(PAYLOAD)
                assert not bad, f"{name}: put {arg} address derives from {bad}, not from symmetric memory"


def test_hier_kernels_do_not_spill(compiled):
    # (the flat kernels' bound, tests/test_symm_compile.py: a few registers' worth is noise)
    for name, info in compiled.items():
        if "spill_bytes" in info:
            assert info["spill_bytes"] <= 256, f"{name}: ptxas spills {info['spill_bytes']} bytes per thread"


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1], sys.argv[2])))
