"""The fused expert kernels compile without a GPU for every target where they are selectable (CI tier T2).

Hopper TLX kernels (sm_90, cubin): each form the fused pipeline launches is compiled with the
signature and 16-divisibility the launcher specialises on, and the PTX is checked for what the form
exists for: wgmma everywhere, 16-byte ``cp.async`` row gathers (with ``cp.async.wait_group`` and a
proxy fence before the warp-barrier signal) where an operand is read by index, TMA for operands read
in place, relaxed fp32 atomics in the scatter epilogue, the producer/consumer register split -- and
that the shared memory the kernel asks for fits an H100/H200 (227 KB), which a compile on CPU does
not check by itself.

Portable stock-Triton kernels (``tlx/portable/fused_moe.py``: the ``triton`` fused backend, the one
that runs on every GPU) for sm_90, sm_100 (cubin), gfx942 and gfx950 (hsaco): the six launches of
one forward + backward are recorded from the backend itself (``_Portable`` on meta tensors of the
``h200_1gpu`` recipe's shapes, under ``tlx.override(arch=...)``: its tiles, warps, stages and flags
for that target) and each is compiled with the specialisation Triton's JIT computes for it on that
target. Checked: the MMA Triton emits there (wgmma on sm_90, tcgen05 on sm_100, bf16 MFMA on AMD),
fp32 atomic adds exactly in the two scatter-epilogue forms (relaxed on NVIDIA) and no atomics
elsewhere, and shared memory / LDS within the target's limit (``metadata.shared``). Not asserted:
register spills -- the dSwiGLU form spills on NVIDIA at 255 registers (``cuobjdump -res-usage``:
80 B of stack on sm_90, 584 B on sm_100), a cost, not a launch failure.
"""

import functools
import os
import re

import pytest

import tlx

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")

# form -> (operand gathered by cp.async?, scatter epilogue?)
FORMS = {
    "swiglu": (True, False),     # GEMM 1: x[src] @ w13, SwiGLU epilogue
    "swiglu_copy": (False, False),  # the same from an expert-major copy of x (FusedConfig.x_rows "copy")
    "scatter": (False, True),    # GEMM 2: out[dst] += gate * (a @ w2)
    "scatter_t": (False, True),  # dX of GEMM 1: dx[src] += dh @ w13^T (K-major weight)
    "dswiglu": (True, False),    # dX of GEMM 2: dout[dst] @ w2^T, dSwiGLU + gate-gradient epilogue
    "dswiglu_copy": (False, False),  # the same from an expert-major copy of dout (dout_rows "copy")
    "wgrad_a": (True, False),    # dW13 = x[src]^T @ dh
    "wgrad_b": (True, False),    # dW2 = ag^T @ dout[dst]
}
_SMEM_LIMIT = 227 * 1024


@pytest.mark.parametrize("form", list(FORMS))
def test_fused_hopper_kernels_compile(form):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.tlx_backend import kernel_signature

    fn, sig, constexprs, attrs, opts = kernel_signature(form)
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                       options=opts)
    ptx = k.asm["ptx"]
    gathered, scatter = FORMS[form]
    assert len(k.asm["cubin"]) > 0
    assert "wgmma.mma_async" in ptx, "no wgmma"
    assert "setmaxnreg" in ptx, "no register split between producer and consumers"
    assert "cp.async.bulk.tensor" in ptx, "no TMA for the operands read in place"
    assert k.metadata.shared <= _SMEM_LIMIT, f"{k.metadata.shared} bytes of shared memory > {_SMEM_LIMIT}"
    copies = [ln for ln in ptx.splitlines() if "cp.async.cg.shared.global" in ln]
    if gathered:
        assert copies and all("0x10" in ln for ln in copies), "row gathers must be 16-byte cp.async"
        assert "cp.async.wait_group" in ptx and "fence.proxy.async" in ptx
    else:
        assert not copies, "no gathered operand in this form"
    f32_atomics = re.findall(r"(?:^|\s)(?:atom|red)\.global\.\S*f32", ptx, re.M)
    assert bool(f32_atomics) == scatter, "fp32 atomics exactly in the scatter epilogue"
    if scatter:
        assert all(".relaxed.add" in a for a in f32_atomics), "scatter epilogue: relaxed fp32 atomic adds"


def test_fused_hopper_dswiglu_early_h_compiles():
    """dSwiGLU with EARLY_H: L2 prefetches of the h tile before the main loop (prefetch.global.L2),
    no extra shared memory, the epilogue's h loads unchanged."""
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.config import FORMS
    from tlx_dist.fused.tlx_backend import kernel_signature

    def compile_(cfg):
        fn, sig, constexprs, attrs, opts = kernel_signature("dswiglu", cfg=cfg)
        return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 128), options=opts)

    assert FORMS["dswiglu"].EARLY_H == 1  # the default
    early, base = compile_(FORMS["dswiglu"]), compile_(dataclasses.replace(FORMS["dswiglu"], EARLY_H=0))

    def count(k, pat):
        return len(re.findall(pat, k.asm["ptx"]))

    assert count(early, r"prefetch\.global\.L2") > 0 and count(base, r"prefetch\.global\.L2") == 0
    assert early.metadata.shared == base.metadata.shared
    vec = r"ld\.global(?:\.\w+)*\.v\d\.b(?:16|32)\b"
    assert count(early, vec) == count(base, vec) > 0, "the epilogue still loads h (now from L2)"


@pytest.mark.parametrize("form,fields", [
    ("dswiglu", dict(EPI_WG=1, REGS=136, EPI_REGS=184, STAGES=4, LAG=2, EPI_COLS=32)),
    ("scatter", dict(EPI_WG=1, REGS=152, EPI_REGS=152, EPI_COLS=32)),
    ("scatter_t", dict(EPI_WG=1, REGS=152, EPI_REGS=152)),
    ("dswiglu", dict(EPI_WG=2, REGS=104, EPI_REGS=120, STAGES=4, LAG=2, EPI_COLS=16)),
    ("scatter", dict(EPI_WG=2, REGS=104, EPI_REGS=120, EPI_COLS=32)),
    ("dswiglu_copy", dict(EPI_WG=2, REGS=104, EPI_REGS=120, STAGES=4, LAG=2, EPI_COLS=16)),
    ("dswiglu_copy", dict(EPI_WG=2, REGS=96, EPI_REGS=128, STAGES=4, LAG=2, EPI_COLS=16)),
    ("dswiglu_copy", dict(EPI_WG=1, REGS=136, EPI_REGS=184, STAGES=4, LAG=2, EPI_COLS=32)),
])
def test_fused_hopper_epilogue_warp_group_compiles(form, fields):
    """EPI_WG: a fourth warp group (16 warps; EPI_WG=2: one per consumer, 20 warps) runs the epilogue
    from the consumers' fp32 accumulators in shared memory; the whole kernel, ring + accumulator tiles + scratch, fits in
    227 KB, and the form's epilogue (atomics or dSwiGLU's stores) is still there."""
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.config import FORMS
    from tlx_dist.fused.tlx_backend import kernel_signature

    cfg = dataclasses.replace(FORMS["scatter" if form == "scatter_t" else form], **fields)
    fn, sig, constexprs, attrs, opts = kernel_signature(form, cfg=cfg)
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                       options=opts)
    ptx = k.asm["ptx"]
    assert k.metadata.num_warps == 12 + 4 * fields["EPI_WG"], "producer + two consumers + the epilogue warp group(s)"
    assert k.metadata.shared <= _SMEM_LIMIT, f"{k.metadata.shared} bytes of shared memory > {_SMEM_LIMIT}"
    assert "wgmma.mma_async" in ptx
    f32_atomics = re.findall(r"(?:^|\s)(?:atom|red)\.global\.\S*f32", ptx, re.M)
    assert bool(f32_atomics) == form.startswith("scatter")


@pytest.mark.parametrize("fields", [dict(PINGPONG=1, REGS=232, EPI_COLS=32), dict(PINGPONG=1, REGS=240)])  # BN/4
def test_fused_hopper_dswiglu_pingpong_compiles(fields):
    """PINGPONG (dSwiGLU from the dout copy): the consumers take whole tiles in turns -- one more
    mbarrier wait each (the turn) besides the stage waits; the ring as without it."""
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.config import FORMS
    from tlx_dist.fused.tlx_backend import kernel_signature

    def compile_(cfg):
        fn, sig, constexprs, attrs, opts = kernel_signature("dswiglu_copy", cfg=cfg)
        assert constexprs["PINGPONG"] == bool(cfg.PINGPONG) and constexprs["A_GATHER"] is False
        return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                              options=opts)

    pp = compile_(dataclasses.replace(FORMS["dswiglu"], **fields))
    base = compile_(FORMS["dswiglu"])
    assert pp.metadata.shared <= _SMEM_LIMIT and pp.metadata.num_warps == 12
    waits = [len(re.findall(r"mbarrier\.try_wait", k.asm["ptx"])) for k in (pp, base)]
    assert waits[0] > waits[1], waits
    assert "wgmma.mma_async" in pp.asm["ptx"] and "cp.async.cg.shared.global" not in pp.asm["ptx"]


def test_fused_hopper_epilogue_warp_group_refuses_swiglu():
    """The handed-off epilogue has the one-accumulator forms only: a SwiGLU config built in code
    with EPI_WG (the env parser refuses it by name) fails to compile instead of computing garbage."""
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.config import FORMS
    from tlx_dist.fused.tlx_backend import kernel_signature

    cfg = dataclasses.replace(FORMS["swiglu"], EPI_WG=1, REGS=152, EPI_REGS=152)
    fn, sig, constexprs, attrs, opts = kernel_signature("swiglu", cfg=cfg)
    with pytest.raises(Exception, match="static_assert|Assertion"):
        triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                       options=opts)


# --- portable stock-Triton fused kernels ---------------------------------------------------------

# form -> the launch flags that identify it, in the order one forward + backward launches them.
PORTABLE = {
    "swiglu": dict(EPILOGUE=1, A_GATHER=True, HAS_SCALE=False),      # x[src] @ w13, SwiGLU
    "scatter": dict(EPILOGUE=2, A_GATHER=False, HAS_SCALE=True),     # out[dst] += gate * (a @ w2)
    "dswiglu": dict(EPILOGUE=3, A_GATHER=True, HAS_SCALE=True),      # dout[dst] @ w2^T, dSwiGLU, dgate
    "scatter_t": dict(EPILOGUE=2, A_GATHER=False, HAS_SCALE=False),  # dx[src] += dh @ w13^T
    "wgrad_b": dict(A_GATHER=False, B_GATHER=True),                  # dW2 = ag^T @ dout[dst]
    "wgrad_a": dict(A_GATHER=True, B_GATHER=False),                  # dW13 = x[src]^T @ dh
}  # in launch order (dW2 first: a dout copy is freed before an x copy is made)
TARGETS = {90: "sm_90", 100: "sm_100", "gfx942": "gfx94x", "gfx950": "gfx94x"}  # -> tlx.gpu_arch() there
NV_ATOMIC = re.compile(r"(?:^|\s)((?:atom|red)\.\S+)", re.M)
AMD_ATOMIC = re.compile(r"\b(?:global|buffer|flat)_atomic_\w+")


@functools.lru_cache(maxsize=None)
def _portable_launches(arch: str) -> dict:
    """form -> (kernel, args, kwargs) of each launch the portable fused backend makes on ``arch``."""
    import torch

    import tlx.portable.fused_moe as kernels
    from tlx_dist.fused import get_fused_backend
    from tlx_dist.fused.backends import _Portable

    calls = []

    class _Record:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.fn, args, kwargs))

    T, K, E, D, F = 8 * 4096, 8, 64, 2048, 1024  # configs/h200_1gpu.toml (OLMoE-shaped), one step
    meta = dict(device="meta")
    x_TD = torch.empty(T, D, dtype=torch.bfloat16, **meta)
    tok_N = torch.empty(T * K, dtype=torch.int32, **meta)
    gate_N = torch.empty(T * K, dtype=torch.float32, **meta)
    w13_EDF2 = torch.empty(E, D, 2 * F, dtype=torch.bfloat16, **meta)
    w2_EFD = torch.empty(E, F, D, dtype=torch.bfloat16, **meta)
    offsets_E = torch.empty(E, dtype=torch.int32, **meta)
    b = get_fused_backend("triton")
    with pytest.MonkeyPatch.context() as mp, tlx.override(arch=arch):
        mp.setattr(kernels, "_fused_mm_kernel", _Record(kernels._fused_mm_kernel))
        mp.setattr(kernels, "_fused_wgrad_kernel", _Record(kernels._fused_wgrad_kernel))
        # The scheduler's prep is a kernel of its own (not checked here); its [E + 1] int32 result
        # is all the fused launches take from it.
        mp.setattr(_Portable, "tile_cum", staticmethod(
            lambda off, n, x: torch.empty(off.shape[0] + 1, dtype=torch.int32, device=off.device)))
        _out, h_N2F = b.forward(x_TD, tok_N, tok_N, gate_N, w13_EDF2, w2_EFD, offsets_E, T)
        b.backward(torch.empty_like(x_TD), x_TD, tok_N, tok_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F)
    assert len(calls) == len(PORTABLE), f"{len(calls)} launches, expected {list(PORTABLE)}"
    return dict(zip(PORTABLE, calls))


@functools.lru_cache(maxsize=None)
def _compiled_portable(target, form: str):
    import triton
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from test_tlx_compile import _target

    fn, args, kwargs = _portable_launches(TARGETS[target])[form]
    flags = {k: kwargs[k] for k in PORTABLE[form]}
    assert flags == PORTABLE[form], f"launch {list(PORTABLE).index(form)} is not {form}: {flags}"
    gpu = _target(target)
    backend = make_backend(gpu)
    # What ``kernel[grid](...)`` does before it compiles, for this target's backend: None -> constexpr,
    # ints equal to 1 -> constexpr, 16-divisible ints and pointers -> tt.divisibility, and on AMD
    # tensors under 2 GB -> tt.pointer_range 32 (buffer loads / atomics).
    bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=gpu, options=options.__dict__)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="kernels decorated as interpreted")
@pytest.mark.parametrize("target", list(TARGETS), ids=lambda t: f"sm_{t}" if isinstance(t, int) else t)
@pytest.mark.parametrize("form", list(PORTABLE))
def test_fused_portable_kernels_compile(target, form):
    from test_tlx_compile import LDS_LIMIT, MFMA, SMEM_LIMIT

    k = _compiled_portable(target, form)
    scatter = PORTABLE[form].get("EPILOGUE") == 2
    if isinstance(target, int):
        ptx = k.asm["ptx"]
        assert len(k.asm["cubin"]) > 0
        mma = "wgmma.mma_async" if target == 90 else "tcgen05.mma"
        assert mma in ptx, f"no {mma} on sm_{target}"
        atomics = NV_ATOMIC.findall(ptx)
        limit = SMEM_LIMIT[target]
        if scatter:
            assert atomics and all(".relaxed.add" in a and a.endswith(".f32") for a in atomics), \
                f"scatter epilogue: relaxed fp32 atomic adds only, got {sorted(set(atomics))}"
    else:
        asm = k.asm["amdgcn"]
        assert len(k.asm["hsaco"]) > 0
        assert MFMA.search(asm), f"no bf16 MFMA on {target}"
        atomics = AMD_ATOMIC.findall(asm)
        limit = LDS_LIMIT[target]
        if scatter:
            assert atomics and all(a.endswith("_atomic_add_f32") for a in atomics), \
                f"scatter epilogue: fp32 atomic adds only, got {sorted(set(atomics))}"
    assert scatter or not atomics, f"atomics outside the scatter epilogue: {sorted(set(atomics))}"
    assert 0 < k.metadata.shared <= limit, f"{k.metadata.shared} bytes of shared memory / LDS > {limit} on {target}"


def test_fused_hopper_swiglu_virtual_experts_compiles():
    """The EP overlap's split gate/up GEMM (VIRT=3: three runs of each expert's rows as virtual
    experts, weights of expert e // 3): the same kernel -- wgmma, 16-byte row gathers, TMA weights,
    the same shared memory -- with the weight coordinate divided (an extra integer division)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.tlx_backend import kernel_signature

    fn, sig, constexprs, attrs, opts = kernel_signature("swiglu")
    ks = {}
    for virt in (1, 3):
        cx = dict(constexprs, VIRT=virt)
        ks[virt] = triton.compile(ASTSource(fn, dict(sig, VIRT="constexpr"), constexprs=cx, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 128), options=opts)
    for k in ks.values():
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
        assert any("0x10" in ln for ln in ptx.splitlines() if "cp.async.cg.shared.global" in ln)
    assert ks[3].metadata.shared == ks[1].metadata.shared
    assert ks[3].asm["ptx"] != ks[1].asm["ptx"], "VIRT must reach the weight coordinate"
