"""The symmetric exchange kernels compile for sm_90, sm_100 (cubin) and gfx942 (hsaco) without a GPU (T2).

Compiled in a child process with ``TRITON_INTERPRET`` unset: Triton picks compiled vs interpreted
when a kernel is decorated, and the CPU interpreter tests of this suite set it at collection.
The NVSHMEM variants (``USE_NVSHMEM=True``) are checked in tests/test_symm_nvshmem_compile.py.
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


def _specs(amd: bool = False):
    import triton.language as tl
    W, E, K, D, T_MAX = 8, 256, 8, 7168, 4096  # DeepSeek-V3-sized rows, EP = 8
    offs = dict(OFF_STATE=0, OFF_FLAGS=256, OFF_ARRIVE=512, OFF_COUNTS=768, OFF_META=34048, OFF_GATES=1213696,
                OFF_RECV=1737984, OFF_COMB=2 ** 31, OFF_DGATE=2 ** 32, OFF_RBLK=2 ** 32 + 2 ** 20,
                OFF_CBLK=2 ** 32 + 2 ** 21)
    wait = dict(TIMEOUT_NS=30 * 10**9, CLOCK=2 if amd else 1)
    o = lambda *names: {n: offs[n] for n in names}  # noqa: E731
    tiles = dict(BLOCK_D=512)
    exp_sig = dict(out_ptr="*bf16", src_map_ptr="*i32", pos_ptr="*i32", gate_ptr="*bf16", tok_ptr="*i32",
                   rows_from_ptr="*i64", y_ptr="*bf16", peers_ptr="*i64", RANK="i32", N_EXP="i32", x_ptr="*bf16",
                   stride_x="i64")
    # every constexpr with a default is given: ASTSource does not apply Python defaults
    exp_cx = dict(W=W, WP=8, K=K, KP=8, D=D, T_MAX=T_MAX, META_W=K + 1, ACC=tl.float32, BLOCK_R=8, **tiles, **wait,
                  COPY=True, GATE_N=False, DGATE_GIVEN=False, WAIT_ROWS=True, END=False, WP3=32, RECV_COPY=False,
                  SRC_ROW=False, LOCAL_X=False, LAYOUT=False, E=E, EP=E, E_LOCAL=E // W, NC=E + W, OFFS_CAP=-1,
                  OFF_COUNTS=768, BLK=False, RB=64, NRB=T_MAX // 64, NEAR_L=0,
                  **o("OFF_STATE", "OFF_ARRIVE", "OFF_META", "OFF_GATES", "OFF_RECV", "OFF_DGATE", "OFF_FLAGS",
                      "OFF_RBLK"))
    send_sig = dict(x_ptr="*bf16", stride_x="i64", T="i32", send_row_ptr="*i32", idx_ptr="*i64", q_ptr="*i32",
                    start_ptr="*i64", gate_ptr="*fp32", peers_ptr="*i64", RANK="i32", offs_ptr="*i32", OWN_ADDR="i64",
                    N_SEND="i32", rows_from_ptr="*i64", ROWS_OFF="i64", RCNT_OFF="i64")
    send_cx = dict(W=W, WP=8, K=K, KP=8, E_LOCAL=E // W, D=D, T_MAX=T_MAX, META_W=K + 1, WITH_META=True, BLOCK_T=8,
                   BARRIER=True, E=E, EP=E, NC=E + W, USE_NVSHMEM=False, OFFS_CAP=W * T_MAX * K, LOCAL_ROWS=False,
                   LOCAL_X=True,  # the expanded form: this rank's own rows stay in x
                   RAW_META=False, BLK_SIGNAL=False, RECV_ROLE=False, RB=64, NRB=T_MAX // 64, RCV_R=64, RCV_D=256,
                   ROWS_REGION=False, SPLIT=0, DENSE=False,
                   **tiles, **wait,
                   **o("OFF_ARRIVE", "OFF_META", "OFF_GATES", "OFF_RECV", "OFF_STATE", "OFF_FLAGS", "OFF_COUNTS",
                       "OFF_RBLK"))
    rsend_sig = dict(y_ptr="*bf16", pos_ptr="*i32", gate_ptr="*bf16", tok_ptr="*i32", rows_from_ptr="*i64",
                     peers_ptr="*i64", RANK="i32", N_EXP="i32")
    rsend_cx = dict(W=W, WP=8, K=K, KP=8, D=D, T_MAX=T_MAX, ACC=tl.float32, BLOCK_R=8, **tiles, BARRIER=True,
                    USE_NVSHMEM=False, CBLK_SIGNAL=False, CB=32, NCB=T_MAX // 32, RECV_ROLE=False,
                    RR_T=8, RR_D=512, END=False, WP3=32, DENSE=False,
                    **wait, **o("OFF_ARRIVE", "OFF_COMB", "OFF_STATE", "OFF_FLAGS", "OFF_CBLK"))
    # the one-launch combine (policy.comb_mode "overlap"): per-token-block counters, and summing
    # programs that read this rank's partial rows where they are (row form) or from COMB
    rsend_recv_sig = dict(rsend_sig, N_RECV="i32", out_ptr="*bf16", send_row_ptr="*i32", T="i32", PART_ADDR="i64")
    rsend_recv_cx = dict(rsend_cx, CBLK_SIGNAL=True, RECV_ROLE=True, END=True, RR_T=1, RR_D=512)  # W = 8
    rrecv_sig = dict(out_ptr="*bf16", send_row_ptr="*i32", rows_to_ptr="*i64", peers_ptr="*i64", RANK="i32", T="i32",
                     PART_ADDR="i64")
    rrecv_cx = dict(W=W, WP=8, D=D, ACC=tl.float32, BLOCK_T=8, END=True, WP3=32, USE_NVSHMEM=False, T_MAX=T_MAX,
                    LOCAL_ROWS=False, BLK=False, CB=32, NCB=T_MAX // 32, DENSE=False, **tiles, **wait,
                    **o("OFF_STATE", "OFF_ARRIVE", "OFF_COMB", "OFF_FLAGS", "OFF_CBLK"))
    return {
        "_route_kernel": ("_route_kernel",
            dict(idx_ptr="*i64", scratch_ptr="*i64", q_ptr="*i32", dest_ptr="*i32", send_row_ptr="*i32",
                 counts_ptr="*i64", T="i32", NB_MAX="i32", peers_ptr="*i64", RANK="i32"),
            dict(K=K, KP=8, E=E, EP=E, W=W, WP=8, E_LOCAL=E // W, NC=E + W, NCP=512, BLOCK_T=128,  # launch._route's
                 USE_NVSHMEM=False, AGG_ONLY=False, DENSE=False, **wait, **o("OFF_STATE", "OFF_FLAGS", "OFF_COUNTS"))),
        # the copy-engine row form (policy.ce_mode): the dense layout's route, send (META, gates, own rows;
        # SPLIT=1), combine-backward send with per-block receive copies, block sums; the copies' kernels
        "_route_kernel[dense]": ("_route_kernel",
            dict(idx_ptr="*i64", scratch_ptr="*i64", q_ptr="*i32", dest_ptr="*i32", send_row_ptr="*i32",
                 counts_ptr="*i64", T="i32", NB_MAX="i32", peers_ptr="*i64", RANK="i32"),
            dict(K=K, KP=8, E=E, EP=E, W=W, WP=8, E_LOCAL=E // W, NC=E + W, NCP=512, BLOCK_T=128,
                 USE_NVSHMEM=False, AGG_ONLY=False, DENSE=True, **wait, **o("OFF_STATE", "OFF_FLAGS", "OFF_COUNTS"))),
        "_send_tokens_kernel[split1_dense]": ("_send_tokens_kernel", send_sig,
                                              dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, RAW_META=True,
                                                   ROWS_REGION=True, SPLIT=1, DENSE=True)),
        "_send_tokens_kernel[rows_overlap_dense]": ("_send_tokens_kernel", send_sig,
                                                    dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, WITH_META=False,
                                                         BLK_SIGNAL=True, RECV_ROLE=True, DENSE=True)),
        "_reduce_recv_kernel[rows_blk_dense]": ("_reduce_recv_kernel", rrecv_sig,
                                                dict(rrecv_cx, LOCAL_ROWS=True, BLK=True, DENSE=True)),
        # what "auto" runs (W = 2): its summing programs wait for signal kernels that need room on the SMs
        "_reduce_recv_kernel[rows_blk_dense_w2]": ("_reduce_recv_kernel", rrecv_sig,
                                                   dict(rrecv_cx, W=2, WP=2, LOCAL_ROWS=True, BLK=True, DENSE=True)),
        "_ce_ready_kernel": ("_ce_ready_kernel", dict(peers_ptr="*i64", RANK="i32"),
                             dict(W=W, WP=8, **wait, **o("OFF_STATE", "OFF_FLAGS"))),
        "_ce_signal_kernel[rows]": ("_ce_signal_kernel",
                                    dict(rows_from_ptr="*i64", peers_ptr="*i64", RANK="i32", LO="i32", HI="i32",
                                         CNT_OFF="i64"),
                                    dict(W=W, MODE=0, OFF_CBLK=offs["OFF_CBLK"], CB=32, NCB=T_MAX // 32, NBP=1)),
        "_ce_signal_kernel[comb]": ("_ce_signal_kernel",
                                    dict(rows_from_ptr="*i64", peers_ptr="*i64", RANK="i32", LO="i32", HI="i32",
                                         CNT_OFF="i64"),
                                    dict(W=W, MODE=1, OFF_CBLK=offs["OFF_CBLK"], CB=32, NCB=T_MAX // 32, NBP=64)),
        "_ce_fixup_kernel": ("_ce_fixup_kernel",
                             dict(part_ptr="*bf16", rows_from_ptr="*i64", peers_ptr="*i64", RANK="i32", H="i32"),
                             dict(W=W, T_MAX=T_MAX, D=D, OFF_COMB=offs["OFF_COMB"], OFF_CBLK=offs["OFF_CBLK"], CB=32,
                                  NCB=T_MAX // 32, BLOCK_D=256, CBP=32)),
        "_send_tokens_kernel": ("_send_tokens_kernel", send_sig, send_cx),
        # the row form: this rank's own rows go straight to the op's output (OWN_ADDR)
        "_send_tokens_kernel[rows]": ("_send_tokens_kernel", send_sig, dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False)),
        # ... on real ranks over peer pointers: per-block arrival counters, and receiving programs that
        # copy the other sources' rows out as they land (policy.recv_mode "overlap")
        "_send_tokens_kernel[rows_overlap]": ("_send_tokens_kernel", send_sig,
                                              dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, BLK_SIGNAL=True,
                                                   RECV_ROLE=True, RAW_META=True)),
        # ... into a per-layer receive region (ROWS, a runtime offset): no receive-side copy at all
        "_send_tokens_kernel[rows_region]": ("_send_tokens_kernel", send_sig,
                                             dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, RAW_META=True,
                                                  ROWS_REGION=True)),
        "_send_tokens_kernel[rows_overlap_wide]": ("_send_tokens_kernel", send_sig,
                                                   dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, BLK_SIGNAL=True,
                                                        RECV_ROLE=True, BLOCK_T=2, BLOCK_D=2048)),
        "_expand_kernel": ("_expand_kernel", exp_sig, dict(exp_cx, FROM_META=True, GATE_GRAD=False, END=True,
                                                           LOCAL_X=True)),
        # static capacity: the send waits only for readiness and sends raw slot codes; the expand
        # kernel waits for the counts, computes the layout and decodes (both forms)
        "_send_tokens_kernel[raw]": ("_send_tokens_kernel", send_sig, dict(send_cx, RAW_META=True)),
        "_send_tokens_kernel[rows_raw]": ("_send_tokens_kernel", send_sig,
                                          dict(send_cx, RAW_META=True, LOCAL_ROWS=True, LOCAL_X=False)),
        "_expand_kernel[layout]": ("_expand_kernel", dict(exp_sig, lay_ptr="*i64", offs_ptr="*i32", starts_ptr="*i64"),
                                   dict(exp_cx, FROM_META=True, GATE_GRAD=False, END=True, LOCAL_X=True, LAYOUT=True,
                                        OFFS_CAP=W * T_MAX * K)),
        "_expand_kernel[rows_layout]": ("_expand_kernel", dict(exp_sig, gate_n_ptr="*fp32", src_row_ptr="*i32",
                                                               lay_ptr="*i64", offs_ptr="*i32", starts_ptr="*i64"),
                                        dict(exp_cx, FROM_META=True, GATE_GRAD=False, COPY=False, GATE_N=True, END=True,
                                             RECV_COPY=True, SRC_ROW=True, LAYOUT=True, OFFS_CAP=W * T_MAX * K)),
        # ... the overlapped hierarchical dispatch's: only this node's rows copied, the op not ended
        "_expand_kernel[rows_layout_near]": ("_expand_kernel", dict(exp_sig, gate_n_ptr="*fp32", src_row_ptr="*i32",
                                                                    lay_ptr="*i64", offs_ptr="*i32", starts_ptr="*i64"),
                                             dict(exp_cx, FROM_META=True, GATE_GRAD=False, COPY=False, GATE_N=True,
                                                  END=False, RECV_COPY=True, SRC_ROW=True, LAYOUT=True,
                                                  OFFS_CAP=W * T_MAX * K, NEAR_L=4)),
        "_expand_kernel[grad]": ("_expand_kernel", exp_sig, dict(exp_cx, FROM_META=False, GATE_GRAD=True, LOCAL_X=True)),
        # the fused EP pipeline's row form: index maps + gates only; given gate gradients, no wait
        "_expand_kernel[rows]": ("_expand_kernel", dict(exp_sig, gate_n_ptr="*fp32", src_row_ptr="*i32"),
                                 dict(exp_cx, FROM_META=True, GATE_GRAD=False, COPY=False, GATE_N=True, END=True,
                                      RECV_COPY=True, SRC_ROW=True)),
        # ... the emulated world's form: the same block-by-block copy in the expand kernel
        "_expand_kernel[rows_blocks]": ("_expand_kernel", dict(exp_sig, gate_n_ptr="*fp32", src_row_ptr="*i32"),
                                        dict(exp_cx, FROM_META=True, GATE_GRAD=False, COPY=False, GATE_N=True,
                                             END=True, RECV_COPY=True, SRC_ROW=True, BLK=True)),
        "_expand_kernel[rows_dgate]": ("_expand_kernel", dict(exp_sig, y_ptr="*fp32"),
                                       dict(exp_cx, FROM_META=False, GATE_GRAD=True, COPY=False, DGATE_GIVEN=True,
                                            WAIT_ROWS=False)),
        "_reduce_send_kernel[rows]": ("_reduce_send_kernel", rsend_sig,
                                      dict(rsend_cx, GATED=False, ROWS=True)),
        "_reduce_send_kernel": ("_reduce_send_kernel", rsend_sig, dict(rsend_cx, GATED=True, ROWS=False)),
        "_reduce_send_kernel[rows_recv]": ("_reduce_send_kernel", rsend_recv_sig,
                                           dict(rsend_recv_cx, GATED=False, ROWS=True)),
        # ... at the summing tile tuning._comb_recv_shape gives each W (~4096 / W elements a rank)
        **{f"_reduce_send_kernel[rows_recv_w{w}]": ("_reduce_send_kernel", rsend_recv_sig,
                                                    dict(rsend_recv_cx, GATED=False, ROWS=True, W=w, WP=w,
                                                         RR_T=max(1, 4096 // w // 512), RR_D=512))
           for w in (2, 4, 8)},
        "_reduce_send_kernel[rows_recv_fp16]": ("_reduce_send_kernel",
                                                dict(rsend_recv_sig, y_ptr="*fp16", out_ptr="*fp16"),
                                                dict(rsend_recv_cx, GATED=False, ROWS=True, W=2, WP=2, RR_T=4,
                                                     RR_D=512)),
        # the emulated world's form: counters only, summed by the reduce-receive kernel (BLK)
        "_reduce_send_kernel[blk]": ("_reduce_send_kernel", rsend_sig,
                                     dict(rsend_cx, GATED=False, ROWS=True, CBLK_SIGNAL=True)),
        "_reduce_recv_kernel[rows_blk]": ("_reduce_recv_kernel", rrecv_sig, dict(rrecv_cx, LOCAL_ROWS=True, BLK=True)),
        # the overlapped row form (symm.RowsOverlap): META + gates + own rows in the op (SPLIT=1), the
        # peers' rows after it with region-counter adds and no barrier (SPLIT=2), the arrival wait and
        # the gate/up GEMM's virtual-expert offsets
        "_send_tokens_kernel[split1]": ("_send_tokens_kernel", send_sig,
                                        dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, RAW_META=True,
                                             ROWS_REGION=True, SPLIT=1)),
        "_send_tokens_kernel[split2]": ("_send_tokens_kernel", send_sig,
                                        dict(send_cx, LOCAL_ROWS=True, LOCAL_X=False, WITH_META=False,
                                             BARRIER=False, ROWS_REGION=True, SPLIT=2)),
        "_rows_wait_kernel": ("_rows_wait_kernel",
                              dict(want_ptr="*i64", peers_ptr="*i64", RANK="i32", RCNT_OFF="i64"),
                              dict(W=W, OFF_STATE=0, **wait)),
        # the hierarchical plan's copy of the landed rows out of RECV (the rows each source sent)
        "_landed_rows_copy_kernel": ("_landed_rows_copy_kernel",
                                     dict(src_ptr="*bf16", dst_ptr="*bf16", rows_from_ptr="*i64", LO="i32", HI="i32",
                                          R="i32", T_MAX="i32", D="i32", stride_s="i32", stride_d="i32"),
                                     dict(BLOCK_R=16, BLOCK_D=256)),
        "_phase_offsets_kernel": ("_phase_offsets_kernel",
                                  dict(starts_ptr="*i64", counts_ptr="*i64", offs_ptr="*i32", out_ptr="*i32",
                                       LO="i32", HI="i32", CAP="i32"),
                                  dict(W=W, E_LOCAL=E // W, EP=E // W)),
        "_reduce_recv_kernel": ("_reduce_recv_kernel", rrecv_sig, rrecv_cx),
        # the row form: this rank's own partial rows are read from the reduce-send's input (PART_ADDR)
        "_reduce_recv_kernel[rows]": ("_reduce_recv_kernel", rrecv_sig, dict(rrecv_cx, LOCAL_ROWS=True)),
        # few rows (tuning._tiles): 2 x 2048 tiles, so that T = 128 still spreads over many programs
        "_send_tokens_kernel[wide]": ("_send_tokens_kernel", send_sig, dict(send_cx, BLOCK_T=2, BLOCK_D=2048)),
        "_expand_kernel[wide]": ("_expand_kernel", exp_sig, dict(exp_cx, FROM_META=True, GATE_GRAD=False, END=True,
                                                                BLOCK_R=2, BLOCK_D=2048, LOCAL_X=True)),
        "_expand_kernel[grad_wide]": ("_expand_kernel", exp_sig, dict(exp_cx, FROM_META=False, GATE_GRAD=True,
                                                                     BLOCK_R=2, BLOCK_D=2048, LOCAL_X=True)),
        "_reduce_send_kernel[wide]": ("_reduce_send_kernel", rsend_sig,
                                      dict(rsend_cx, GATED=True, ROWS=False, BLOCK_R=2,
                                           BLOCK_D=2048)),
        "_reduce_recv_kernel[wide]": ("_reduce_recv_kernel", rrecv_sig,
                                      dict(rrecv_cx, LOCAL_ROWS=True, BLOCK_T=2, BLOCK_D=2048)),
        "_gate_grad_recv_kernel": ("_gate_grad_recv_kernel",
            dict(out_ptr="*fp32", rows_to_ptr="*i64", peers_ptr="*i64", RANK="i32", S="i32"),
            dict(W=W, BLOCK=1024, END=True, WP3=32, USE_NVSHMEM=False, **wait,
                 **o("OFF_STATE", "OFF_ARRIVE", "OFF_DGATE", "OFF_FLAGS"))),
    }


def _ptxas_info(ptx: str, arch: str) -> tuple[int, int]:
    """Spill stores + loads (bytes per thread) and registers per thread that ptxas reports for ``ptx``
    (Triton's bundled ptxas)."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(int(arch)).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
    regs = re.findall(r"Used (\d+) registers", r.stdout + r.stderr)
    assert r.returncode == 0 and found and regs, r.stderr[-2000:]
    return sum(int(a) + int(b) for a, b in found), max(int(v) for v in regs)


def _compile_all(arch: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx import comm

    amd = arch.startswith("gfx")
    target = GPUTarget("hip", arch, 64) if amd else GPUTarget("cuda", int(arch), 32)
    out = {}
    for name, (fn, sig, constexprs) in _specs(amd).items():
        jit = getattr(comm, fn)
        # What the JIT specialises on at a launch with aligned tensors: 16-byte-aligned pointer
        # arguments and 16-divisible strides carry tt.divisibility = 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(jit.arg_names)
                 if sig.get(a, "").startswith("*") or a.startswith("stride")}
        sig = dict(sig, **{k: "constexpr" for k in constexprs})
        k = triton.compile(ASTSource(jit, sig, constexprs=constexprs, attrs=attrs), target=target,
                           options={"num_warps": 4})
        if amd:  # AMDGCN: release = L2 write-back before the atomic, acquire = cache invalidate after
            asm = k.asm["amdgcn"]
            out[name] = dict(binary=len(k.asm["hsaco"]), release=asm.count("buffer_wbl2"),
                             acquire=asm.count("buffer_inv"), atomic=asm.count("_atomic_"),
                             st=asm.count("global_store"), ld=asm.count("global_load"),
                             timer=asm.count("s_memrealtime"))
        else:
            ptx = k.asm["ptx"]
            out[name] = dict(binary=len(k.asm["cubin"]), release=ptx.count("sys.release"),
                             acquire=ptx.count("sys.acquire"), atomic=ptx.count("atom."),
                             st=ptx.count("st.global"), ld=ptx.count("ld.global"),
                             timer=ptx.count("%globaltimer"), nvshmem=ptx.count("nvshmem"),
                             ld16=ptx.count("ld.global.b16"), st16=ptx.count("st.global.b16"),
                             ld_v4=ptx.count("ld.global.v4"), st_v4=ptx.count("st.global.v4"),
                             shared=k.metadata.shared,
                             **dict(zip(("spill_bytes", "regs"), _ptxas_info(ptx, arch))))
    return out


# sm_90 in the fast tier; the other targets (the same kernels and checks) in the release tier: a cold
# compile of every exchange kernel for one target takes most of a minute
@pytest.fixture(scope="module", params=["90", pytest.param("100", marks=pytest.mark.release),
                                        pytest.param("gfx942", marks=pytest.mark.release)],
                ids=["sm_90", "sm_100", "gfx942"])
def compiled(request):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, request.param], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_compile_with_signal_semantics(compiled):
    for name, info in compiled.items():
        assert info["binary"] > 0, name
    # Producers publish with release atomics at system scope; consumers poll with acquire, and
    # every poll is bounded by the device clock (%globaltimer; s_memrealtime on AMD).
    # the route kernel posts the counts; every op's last kernel raises the readiness for the next
    for name in ("_route_kernel", "_send_tokens_kernel", "_reduce_send_kernel", "_expand_kernel[grad]",
                 "_expand_kernel", "_reduce_recv_kernel", "_gate_grad_recv_kernel"):
        assert compiled[name]["release"] > 0 and compiled[name]["atomic"] > 0, f"{name}: no release atomic"
    # the barrier's waits open the op's first data kernel (send_tokens, reduce_send); the route
    # kernel's look-back polls are bounded too
    for name in ("_route_kernel", "_send_tokens_kernel", "_reduce_send_kernel", "_expand_kernel",
                 "_reduce_recv_kernel", "_gate_grad_recv_kernel"):
        assert compiled[name]["acquire"] > 0, f"{name}: no acquire poll"
        assert compiled[name]["timer"] > 0, f"{name}: wait not bounded by the device clock"
    for name in ("_send_tokens_kernel", "_expand_kernel", "_reduce_send_kernel", "_reduce_recv_kernel"):
        assert compiled[name]["st"] > 0 and compiled[name]["ld"] > 0, f"{name}: no row copy"
    # No heavy register spills at DeepSeek-V3 sizes (E = 256): the layout pass of the barrier wait
    # (then a one-CTA kernel of its own) once built an [E, E] tile and spilled tens of KB per thread, a slow op
    # on the GPU. A few registers' worth (the expand kernel's, on sm_90) is noise.
    for name, info in compiled.items():
        assert info.get("spill_bytes", 0) <= 256, f"{name}: ptxas spills {info['spill_bytes']} bytes per thread"
    # Row form: the receive rows stay put (no row copy in the index pass), partial rows still go home,
    # the gate gradients are released to their sources without waiting for token rows.
    assert compiled["_expand_kernel[rows]"]["acquire"] > 0, "rows: the index pass must wait for its rows"
    assert compiled["_expand_kernel[rows_dgate]"]["timer"] == 0, "rows_dgate waits for nothing"
    assert compiled["_expand_kernel[rows_dgate]"]["release"] > 0, "rows_dgate: no release of the answers"
    assert compiled["_reduce_send_kernel[rows]"]["release"] > 0 and compiled["_reduce_send_kernel[rows]"]["st"] > 0
    # Static capacity: the send still opens with a bounded barrier (readiness), the expand kernel
    # now waits for the counts too (more bounded polls than the plain dispatch expand).
    for name in ("_send_tokens_kernel[raw]", "_send_tokens_kernel[rows_raw]"):
        assert compiled[name]["acquire"] > 0 and compiled[name]["timer"] > 0 and compiled[name]["release"] > 0, name
    assert compiled["_expand_kernel[layout]"]["acquire"] > compiled["_expand_kernel"]["acquire"]
    assert compiled["_expand_kernel[rows_layout]"]["acquire"] > compiled["_expand_kernel[rows]"]["acquire"]
    # The row form's per-block arrival: the senders release more counters (one add per block and
    # destination besides the op's total), the receiving programs poll them with bounded waits.
    for name in ("_send_tokens_kernel[rows_overlap]", "_send_tokens_kernel[rows_overlap_wide]"):
        assert compiled[name]["release"] > compiled["_send_tokens_kernel[rows]"]["release"], name
        assert compiled[name]["acquire"] > compiled["_send_tokens_kernel[rows]"]["acquire"], name
    assert compiled["_expand_kernel[rows_blocks]"]["acquire"] > compiled["_expand_kernel[rows]"]["acquire"]
    # The combine's per-token-block counters: the senders release them (more release atomics than the
    # one ARRIVE add per source), the one-launch form also polls them (bounded) and ends the op, and
    # the reduce-receive kernel of the emulated world's form polls them instead of ARRIVE.
    for name, plain in (("_reduce_send_kernel[rows_recv]", "_reduce_send_kernel[rows]"),):
        r, p = compiled[name], compiled[plain]
        assert r["release"] > p["release"] and r["acquire"] > p["acquire"] and r["timer"] > p["timer"], name
        assert r["st"] > p["st"] and r["ld"] > p["ld"], f"{name}: no summing of the arrived rows"
    assert compiled["_reduce_send_kernel[blk]"]["release"] > 0
    # Its summing programs (up to 4 an SM, tuning._comb_recv_shape) wait for senders of the same launch:
    # at <= 64 registers a thread 8 CTAs of 4 warps fit an SM, so senders always find room beside them.
    if "regs" in compiled["_reduce_send_kernel[rows_recv]"]:
        for name in ("_reduce_send_kernel[rows_recv_w2]", "_reduce_send_kernel[rows_recv_w4]",
                     "_reduce_send_kernel[rows_recv_w8]", "_reduce_send_kernel[rows_recv_fp16]"):
            regs = compiled[name]["regs"]
            assert regs <= 64, f"one-launch combine {name}: {regs} registers a thread (<= 64 keeps 8 CTAs an SM)"
    # The copy-engine combine's summing programs (tuning.CE_SUM_PER_SM = 4 an SM, 4 warps) wait for the
    # chunks' one-warp signal kernels: at W = 2 (where "auto" turns the copy engines on) they must leave
    # room for them. <= 120 registers a thread: 4 x 4 warps x 32 x 120 = 61,440 of an SM's 65,536.
    if "regs" in compiled["_reduce_recv_kernel[rows_blk_dense_w2]"]:
        regs = compiled["_reduce_recv_kernel[rows_blk_dense_w2]"]["regs"]
        assert regs <= 120, f"copy-engine combine sum at W=2: {regs} registers a thread (<= 120 leaves room)"
    rb = compiled["_reduce_recv_kernel[rows_blk]"]
    assert rb["acquire"] > 0 and rb["timer"] > 0, "the per-block sum must wait (bounded) for its rows"
    # The overlapped row form: its first half opens the op with the bounded barrier and publishes
    # ARRIVE; its second half waits for nothing (outside the op) and releases the region counters;
    # the arrival wait is a bounded acquire poll that takes the rows off the counter.
    s1, s2 = compiled["_send_tokens_kernel[split1]"], compiled["_send_tokens_kernel[split2]"]
    assert s1["acquire"] > 0 and s1["timer"] > 0 and s1["release"] > 0 and s1["st"] > 0
    assert s2["acquire"] == 0 and s2["timer"] == 0, "the row half must not wait"
    assert s2["release"] > 0 and s2["st"] > 0 and s2["ld"] > 0
    wk = compiled["_rows_wait_kernel"]
    assert wk["acquire"] > 0 and wk["timer"] > 0 and wk["atomic"] > 1
    assert compiled["_phase_offsets_kernel"]["st"] > 0
    lc = compiled["_landed_rows_copy_kernel"]
    assert lc["ld"] > 0 and lc["st"] > 0 and lc["acquire"] == 0, "a plain copy: the wait before it orders it"
    # Rows move as 16-byte vectors, also through the symmetric regions, whose pointers are made
    # from integer addresses (peer table + layout offset): without tl.multiple_of on them every bf16
    # of a row went by its own 2-byte load or store (send_tokens: 33 2-byte peer stores in the PTX,
    # expand: 33 2-byte loads, reduce_send: 32 2-byte peer stores, reduce_recv: 32 2-byte loads).
    # A lone 2-byte access left is a per-row scalar (a gate).
    if "ld16" in compiled["_expand_kernel"]:  # NVIDIA PTX
        for name, ld_max, st_max in (("_send_tokens_kernel", 1, 1), ("_expand_kernel", 1, 1),
                                     ("_expand_kernel[rows]", 1, 1), ("_reduce_send_kernel", 0, 0),
                                     ("_reduce_send_kernel[rows]", 0, 0), ("_reduce_recv_kernel", 0, 0),
                                     ("_send_tokens_kernel[rows]", 1, 1), ("_reduce_recv_kernel[rows]", 0, 0),
                                     ("_send_tokens_kernel[wide]", 1, 1), ("_expand_kernel[wide]", 1, 1),
                                     ("_send_tokens_kernel[raw]", 1, 1), ("_send_tokens_kernel[rows_raw]", 1, 1),
                                     ("_expand_kernel[layout]", 1, 1), ("_expand_kernel[rows_layout]", 1, 1),
                                     ("_send_tokens_kernel[rows_overlap]", 1, 1),
                                     ("_send_tokens_kernel[rows_region]", 1, 1),
                                     ("_send_tokens_kernel[rows_overlap_wide]", 1, 1),
                                     ("_expand_kernel[rows_blocks]", 1, 1),
                                     ("_reduce_send_kernel[wide]", 0, 0), ("_reduce_recv_kernel[wide]", 0, 0),
                                     ("_reduce_send_kernel[rows_recv]", 0, 0),
                                     ("_reduce_recv_kernel[rows_blk]", 0, 0)):
            info = compiled[name]
            assert info["ld_v4"] > 0 and info["st_v4"] > 0, f"{name}: rows not moved as 16-byte vectors"
            assert info["ld16"] <= ld_max and info["st16"] <= st_max, \
                f"{name}: {info['ld16']} 2-byte loads, {info['st16']} 2-byte stores (rows moved element by element)"
    # The peer-pointer build (USE_NVSHMEM=False, the default) has no NVSHMEM in it: no module init.
    for name, info in compiled.items():
        assert info.get("nvshmem", 0) == 0, f"{name}: references NVSHMEM with USE_NVSHMEM=False"


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1])))
