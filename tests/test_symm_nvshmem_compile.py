"""The NVSHMEM route of the exchange kernels (``USE_NVSHMEM=True``) compiles for sm_90 and sm_100
against NVSHMEM's device bitcode, and its PTX obeys the protocol (T2; never run: no multi-node
machine).

Two compiles per kernel and architecture, in a child process with ``TRITON_INTERPRET`` unset:
  * linked: ``libnvshmem_device`` from the ``nvidia-nvshmem-cu1x`` wheel (the ``nvshmem-bitcode``
    extra), PTX -> cubin with ptxas, as a GPU run would; the module holds NVSHMEM's device state
    (what ``nvshmemx_cumodule_init`` fills), so it needs and gets module init.
  * unlinked (``ptxas -c``): the same kernel with the NVSHMEM entry points left as calls, so the PTX
    shows where each one sits. Linking only inlines their bodies at those call sites.
On the unlinked PTX the test builds the kernel's control-flow graph and checks:
  * every ``nvshmemx_signal_op``, ``nvshmem_quiet``, ``nvshmem_fence`` is reachable only through a
    branch taken when ``%tid.x == 0`` (one thread issues it; the old route ran it on all 128);
  * every block-collective ``nvshmemx_putmem_block`` is reachable whatever the thread id (every
    thread of the CTA calls it);
  * the source and destination addresses of every put derive from the peer table (this rank's
    symmetric base) and from none of the kernel's payload tensors (x, y, gates, counts): puts read
    the staged copy in symmetric memory, never the caller's tensor;
  * signal ops are NVSHMEM_SIGNAL_SET (9) or NVSHMEM_SIGNAL_ADD (10).
Kernels compiled with USE_NVSHMEM=False (or sending nothing) reference no NVSHMEM symbol even when
the library is offered, so they never need module init.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import tlx

pytestmark = [pytest.mark.skipif(not tlx.triton_available(), reason="triton is not importable"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = ("nvshmemx_signal_op", "nvshmem_quiet", "nvshmem_fence")
BLOCK = ("nvshmemx_putmem_block",)
# Tensors whose bytes a put must never read directly (the old route put straight from x and y).
PAYLOAD = ("x_ptr", "y_ptr", "gate_ptr", "counts_ptr", "out_ptr")


def _nvshmem_specs():
    """``(nvshmem, quiet, base)``: the sending kernels of tests/test_symm_compile.py (same
    DeepSeek-V3-sized constants) in their USE_NVSHMEM variant with every offset from a real
    staging layout; kernels launched with USE_NVSHMEM that send nothing over NVSHMEM; the
    peer-pointer specs."""
    import torch

    from test_symm_compile import _specs
    from tlx import comm
    from tlx_dist.comm.symm.buffers import SymmLayout

    L = SymmLayout.build(4096, 7168, 8, 256, 8, torch.bfloat16, staging=True)
    offs = {f"OFF_{n.upper()}": getattr(L, f"off_{n}") for n in
            ("state", "flags", "arrive", "counts", "meta", "gates", "recv", "comb", "dgate",
             "srows", "smeta", "sgates", "scomb", "sdgate")}
    base = _specs(False)

    def variant(name, **cx):
        fn, sig, cx0 = base[name]
        args = getattr(comm, fn).arg_names
        return fn, dict(sig, pes_ptr="*i32"), dict(cx0, USE_NVSHMEM=True, **cx,
                                                   **{k: v for k, v in offs.items() if k in args})

    nvshmem = {
        "_route_kernel": variant("_route_kernel"),  # its last block publishes the dispatch counts
        "_send_tokens_kernel": variant("_send_tokens_kernel"),
        "_send_tokens_kernel[grad]": variant("_send_tokens_kernel", WITH_META=False),  # combine's backward: dy rows
        # the row form: own rows go straight to the op's output, the rest as before
        "_send_tokens_kernel[rows]": variant("_send_tokens_kernel[rows]"),
        "_expand_kernel[grad]": variant("_expand_kernel[grad]"),
        "_reduce_send_kernel": variant("_reduce_send_kernel"),
        # the fused EP pipeline's row form: partial rows home, given gate gradients home
        "_reduce_send_kernel[rows]": variant("_reduce_send_kernel[rows]"),
        "_expand_kernel[rows_dgate]": variant("_expand_kernel[rows_dgate]"),
        # every op's last kernel raises the readiness for the next op on every peer
        "_expand_kernel[end]": variant("_expand_kernel"),
        "_reduce_recv_kernel[end]": variant("_reduce_recv_kernel"),
        "_reduce_recv_kernel[rows_end]": variant("_reduce_recv_kernel[rows]"),
        "_gate_grad_recv_kernel[end]": variant("_gate_grad_recv_kernel"),
    }
    quiet = {"_expand_kernel[dispatch]": variant("_expand_kernel", END=False)}  # FROM_META, no END: sends nothing
    return nvshmem, quiet, base


# ---------------------------------------------------------------- PTX control flow and data flow

_REG = re.compile(r"%[a-z]+\d+")
_LABEL = re.compile(r"^(\$?[\w$]+):$")


def _statements(ptx: str, entry: str) -> list[str]:
    """Statements of the ``.entry`` function ``entry``: labels (``L:``) and instructions, comments
    and call-sequence braces dropped, multi-statement lines (inline asm) split."""
    start = ptx.index(f".entry {entry}(")
    body = ptx[ptx.index("{", ptx.index(")", start)) + 1:]
    body = body[:body.index("// -- End function")]
    out, buf = [], ""
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line or line in ("{", "}") or line.startswith(".loc"):  # .loc ends without ';'
            continue
        if not buf and _LABEL.match(line):
            out.append(line)
            continue
        buf += " " + line
        while ";" in buf:
            stmt, buf = buf.split(";", 1)
            if stmt.strip():
                out.append(stmt.strip())
    return out


def analyze(ptx: str, entry: str, params: list[str]) -> dict:
    """Per NVSHMEM call site of kernel ``entry``: the called function, whether only thread 0
    reaches it (``one``), whether every thread can (``all``), the kernel parameters its address
    arguments derive from (puts) and its signal op (signals). ``params``: the names of the
    kernel's PTX parameters in order."""
    stmts = _statements(ptx, entry)
    # Basic blocks.
    blocks, labels, cur = [], {}, []
    for s in stmts:
        m = _LABEL.match(s)
        if m:
            if cur:
                blocks.append(cur)
                cur = []
            labels[m.group(1)] = len(blocks)
            continue
        cur.append(s)
        op = s.split()[0] if not s.startswith("@") else s.split()[1]
        if op.startswith("bra") or op.startswith("ret"):
            blocks.append(cur)
            cur = []
    blocks.append(cur)
    # Thread-id registers and predicates: what a predicate being true/false says about %tid.x.
    tid, pred = set(), {}
    defs: dict[str, set] = {}
    roots: dict[str, set] = {}
    for s in stmts:
        if _LABEL.match(s):
            continue
        body = re.sub(r"^@!?%p\d+\s+", "", s)
        op = body.split()[0]
        regs = _REG.findall(body)
        if op.startswith("mov") and "%tid.x" in body and regs:
            tid.add(regs[0])
        elif op.startswith("mov") and len(regs) == 2 and regs[1] in tid:
            tid.add(regs[0])
        if op.startswith("setp") and len(regs) >= 2:
            a = body.split(",")
            x, y = a[1].strip(), a[2].strip() if len(a) > 2 else ""
            if (x in tid and y == "0") or (y in tid and x == "0"):
                cmp = op.split(".")[1]
                if cmp == "eq":
                    pred[regs[0]] = ("tid0", "tidN")
                elif cmp == "ne":
                    pred[regs[0]] = ("tidN", "tid0")
        elif op == "not.pred" and regs[1] in pred:
            pred[regs[0]] = pred[regs[1]][::-1]
        elif op in ("and.pred", "or.pred"):  # and true: both true; or false: both false
            i = 0 if op == "and.pred" else 1
            facts = [pred[r][i] for r in regs[1:] if r in pred and pred[r][i]]
            if facts:
                pred[regs[0]] = (facts[0], None) if i == 0 else (None, facts[0])
        if m := re.match(r"ld\.param\.\w+\s+(%\w+),\s*\[(\w+)_param_(\d+)\]", body):
            roots.setdefault(m.group(1), set()).add(params[int(m.group(3))])
        elif regs and not (op.startswith("st") or op.startswith("bra") or op.startswith("call")
                           or op.startswith("bar") or op.startswith("red")):
            defs.setdefault(regs[0], set()).update(regs[1:])

    def param_roots(reg: str) -> set:
        seen, todo, out = set(), [reg], set()
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            out |= roots.get(r, set())
            todo.extend(defs.get(r, ()))
        return out

    # Edges, labelled with the thread-id fact their branch needs (None: any thread).
    succ = [[] for _ in blocks]
    for i, blk in enumerate(blocks):
        last = blk[-1] if blk else ""
        m = re.match(r"@(!?)(%p\d+)\s+bra(?:\.uni)?\s+(\S+)", last)
        if m:
            t, f = pred.get(m.group(2), (None, None))
            if m.group(1):
                t, f = f, t
            succ[i].append((labels[m.group(3)], t))
            if i + 1 < len(blocks):
                succ[i].append((i + 1, f))
        elif re.match(r"bra(?:\.uni)?\s+(\S+)", last):
            succ[i].append((labels[last.split()[-1]], None))
        elif not last.startswith("ret") and i + 1 < len(blocks):
            succ[i].append((i + 1, None))

    def reachable(skip: str) -> set:
        seen, todo = {0}, [0]
        while todo:
            for j, fact in succ[todo.pop()]:
                if fact != skip and j not in seen:
                    seen.add(j)
                    todo.append(j)
        return seen

    not_t0, only_t0 = reachable("tid0"), reachable("tidN")  # paths of threads != 0 / of thread 0
    calls = []
    for i, blk in enumerate(blocks):
        params_st = {}
        for s in blk:
            if m := re.match(r"st\.param\.\w+\s+\[(param\d+)\],\s*(\S+)", s):
                params_st[m.group(1)] = m.group(2)
            if m := re.match(r"call(?:\.uni)?\s+(?:\(retval0\),\s*)?(\w+)", s):
                fn = m.group(1)
                if not fn.startswith("nvshmem"):
                    continue
                c = dict(fn=fn, one=i not in not_t0, all=i in not_t0 and i in only_t0)
                if fn in BLOCK:
                    c["dst"] = sorted(param_roots(params_st["param0"]))
                    c["src"] = sorted(param_roots(params_st["param1"]))
                if fn == "nvshmemx_signal_op":
                    c["op"] = params_st.get("param2")
                calls.append(c)
    return dict(calls=calls, tid_guards=sum(1 for p in pred.values() if "tid0" in p))


def _compile_all(arch: str, lib: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx import comm

    target = GPUTarget("cuda", int(arch), 32)
    nv, quiet, base = _nvshmem_specs()

    def build(fn, sig, cx, **opts):
        full = dict(sig, **{k: "constexpr" for k in cx})
        return triton.compile(ASTSource(getattr(comm, fn), full, constexprs=cx), target=target,
                              options={"num_warps": 4, **opts})

    out = {}
    for name, (fn, sig, cx) in nv.items():
        linked = build(fn, sig, cx, extern_libs={"libnvshmem_device": lib})
        unlinked = build(fn, sig, cx, ptx_options="-c")  # relocatable: NVSHMEM calls stay calls
        params = [a for a in getattr(comm, fn).arg_names if sig.get(a, "constexpr") != "constexpr"]
        params += ["<scratch>"] * 4
        ptx = linked.asm["ptx"]
        out[name] = dict(binary=len(linked.asm["cubin"]), state="nvshmemi_device_state_d" in ptx,
                         unresolved=re.findall(r"\.extern \.func[^\n]*?(\w+)\s*\(", ptx),
                         **analyze(unlinked.asm["ptx"], getattr(comm, fn).fn.__name__, params))
    libs = {"libnvshmem_device": lib}
    for name, (fn, sig, cx) in quiet.items():  # offered the library, but no NVSHMEM call in it
        k = build(fn, sig, cx, extern_libs=libs)
        out[name] = dict(binary=len(k.asm["cubin"]), nvshmem=k.asm["ptx"].count("nvshmem"))
    for name in ("_send_tokens_kernel", "_reduce_send_kernel"):  # peer-pointer variant, library offered
        fn, sig, cx = base[name]
        k = build(fn, sig, cx, extern_libs=libs)
        out[name + "[peer]"] = dict(binary=len(k.asm["cubin"]), nvshmem=k.asm["ptx"].count("nvshmem"))
    return out


def _bitcode(arch: int) -> str:
    from tlx_dist.comm.symm.buffers import nvshmem_device_library
    try:
        return nvshmem_device_library(arch)
    except RuntimeError as err:
        if os.environ.get("CI"):  # CI installs the nvshmem-bitcode extra (scripts/setup.sh): never skip there
            raise
        pytest.skip(f"no NVSHMEM device bitcode ({err}); pip install -e '.[nvshmem-bitcode]'")


# Both targets in the release tier (a cold compile and link of every NVSHMEM kernel takes minutes);
# the PTX analysis itself is checked in the fast tier (test_ptx_analysis_catches_...), and the
# peer-pointer kernels' compile by tests/test_symm_compile.py.
@pytest.fixture(scope="module", params=[pytest.param("90", marks=pytest.mark.release),
                                        pytest.param("100", marks=pytest.mark.release)], ids=["sm_90", "sm_100"])
def compiled(request):
    lib = _bitcode(int(request.param))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, request.param, lib], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# the op's last kernels of the dispatch (FROM_META expand) and of the reductions: the readiness
# signal of _end_op and nothing to put
SIGNAL_ONLY = ("_expand_kernel[end]", "_reduce_recv_kernel[end]", "_reduce_recv_kernel[rows_end]",
               "_gate_grad_recv_kernel[end]")
SENDERS = ("_route_kernel", "_send_tokens_kernel", "_send_tokens_kernel[rows]", "_expand_kernel[end]",
           "_reduce_recv_kernel[end]", "_reduce_recv_kernel[rows_end]", "_gate_grad_recv_kernel[end]",
           "_send_tokens_kernel[grad]", "_expand_kernel[grad]", "_reduce_send_kernel", "_reduce_send_kernel[rows]",
           "_expand_kernel[rows_dgate]")


def test_nvshmem_kernels_link_and_assemble(compiled):
    for name in SENDERS:
        info = compiled[name]
        assert info["binary"] > 0, name
        # The module holds NVSHMEM's device state: it needs (and gets) nvshmemx_cumodule_init.
        assert info["state"], f"{name}: libnvshmem_device was not linked in"
        assert set(info["unresolved"]) <= {"vprintf"}, f"{name}: unresolved {info['unresolved']}"


def test_kernels_without_nvshmem_calls_need_no_module_init(compiled):
    # Offered the library, a kernel that makes no NVSHMEM call references none of it.
    for name in ("_expand_kernel[dispatch]", "_send_tokens_kernel[peer]", "_reduce_send_kernel[peer]"):
        assert compiled[name]["binary"] > 0 and compiled[name]["nvshmem"] == 0, name


def test_signals_are_issued_by_one_thread(compiled):
    for name in SENDERS:
        calls = compiled[name]["calls"]
        signals = [c for c in calls if c["fn"] in ONE_THREAD]
        # Each sender completes its puts (quiet) and raises a counter on the off-node peers.
        assert {c["fn"] for c in signals} >= {"nvshmem_quiet", "nvshmemx_signal_op"}, (name, calls)
        for c in signals:
            assert c["one"], f"{name}: {c['fn']} is reachable by threads other than thread 0"
            if c["fn"] == "nvshmemx_signal_op":
                assert c["op"] in ("9", "10"), f"{name}: signal op {c['op']} is not NVSHMEM_SIGNAL_SET/ADD"


def test_puts_are_block_collective_from_symmetric_staging(compiled):
    for name in SENDERS:
        if name in SIGNAL_ONLY:
            assert not any(c["fn"] in BLOCK for c in compiled[name]["calls"]), name  # nothing to put
            continue
        puts = [c for c in compiled[name]["calls"] if c["fn"] in BLOCK]
        assert puts, f"{name}: no put"
        for c in puts:
            assert c["all"], f"{name}: a putmem_block is reached by only some threads of the CTA"
            for arg in ("src", "dst"):
                assert "peers_ptr" in c[arg], f"{name}: put {arg} does not come from this rank's symmetric base"
                bad = set(c[arg]) & set(PAYLOAD)
                assert not bad, f"{name}: put {arg} address derives from {bad}, not from symmetric memory"


def test_ptx_analysis_catches_unguarded_signal_and_payload_put():
    """The analysis itself, on hand-written PTX: a signal outside the tid guard, a put inside it,
    and a put whose source is a payload pointer are all reported (so the checks above can fail)."""
    ptx = """
.visible .entry k(
    .param .u64 k_param_0, .param .u64 k_param_1
)
{
    ld.param.b64 %rd1, [k_param_0];
    ld.param.b64 %rd2, [k_param_1];
    ld.global.b64 %rd3, [%rd1];
    mov.u32 %r1, %tid.x;
    setp.ne.b32 %p1, %r1, 0;
    { // callseq 0, 0
    st.param.b64 [param0], %rd3;
    st.param.b64 [param1], %rd2;
    call.uni (retval0), nvshmemx_putmem_block, (param0, param1, param2, param3);
    }
    { // callseq 1, 0
    st.param.b32 [param2], 10;
    call.uni (retval0), nvshmemx_signal_op, (param0, param1, param2, param3);
    }
    .loc 1 2 3
    setp.eq.b64 %p2, %rd3, 0;
    or.pred %p3, %p2, %p1;
    @%p3 bra $L__BB0_3;
    st.param.b32 [param2], 9;
    call.uni (retval0), nvshmemx_signal_op, (param0, param1, param2, param3);
$L__BB0_3:
    @%p1 bra $L__BB0_2;
    { // callseq 2, 0
    st.param.b64 [param0], %rd3;
    st.param.b64 [param1], %rd3;
    call.uni (retval0), nvshmemx_putmem_block, (param0, param1, param2, param3);
    }
    call.uni (retval0), nvshmem_quiet, ();
$L__BB0_2:
    ret;
} // -- End function
"""
    calls = analyze(ptx, "k", ["peers_ptr", "x_ptr"])["calls"]
    put0, sig, sig_or, put1, quiet = calls
    assert put0["all"] and put0["src"] == ["x_ptr"] and put0["dst"] == ["peers_ptr"]
    assert not sig["one"] and sig["op"] == "10"
    assert sig_or["one"] and sig_or["op"] == "9"  # skipped when (base == 0) | (tid != 0): reached by thread 0 only
    assert not put1["all"] and put1["one"] and put1["src"] == ["peers_ptr"]
    assert quiet["one"]


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1], sys.argv[2])))
