"""Every grouped-GEMM kernel compiles for every target it claims, without a GPU (CI tier T2).

``triton.compile`` with an explicit ``GPUTarget`` runs the whole pipeline on the CPU (TLX warp
specialization / warp pipelining, TMA, wgmma / tcgen05 / MFMA lowering, ptxas or the AMDGPU
backend). Targets:

  TLX Hopper (sm_90), TLX Blackwell (sm_100), TLX AMD (gfx942, gfx950): forward (N-contiguous
  weight), dX (K-contiguous weight) and the weight gradient;
  portable Triton (sm_90, gfx942): the ragged-M kernel (fwd, dX) and the weight-gradient kernel.

Each check asserts on the output, not just that compilation returned: the MMA instruction the form
exists for (wgmma, tcgen05.mma, v_mfma), the data movement it is built on (TMA, direct-to-LDS or
16-byte loads, the warp pipeline's priorities, dW's atomic tile claims), and resources within the
target's limits from the compiled code -- registers (NVIDIA: ``cuobjdump -res-usage`` REG x threads
<= 64K and no local memory; AMD: VGPRs + AGPRs per lane <= 512 / waves per SIMD, no spills, no
scratch) and shared memory / LDS (``metadata.shared``). Each kernel is compiled once per module
(``_compiled`` is cached).
"""

import functools
import os
import re
import subprocess
import tempfile

import pytest

import tlx

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")

FORMS = {"fwd": (False, False), "dX": (False, True), "dW": (True, False)}
SMEM_LIMIT = {90: 227 * 1024, 100: 227 * 1024}  # opt-in dynamic shared memory per block
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
MFMA = re.compile(r"\bv_mfma_f32_\w+_bf16\b")


def _target(target):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", target, 128) if isinstance(target, int) else GPUTarget("hip", target, 64)


@functools.lru_cache(maxsize=None)
def _compiled(kernel: str, target, form: str, cfg=None, dynamic=None):
    """kernel: "tlx" (Hopper / Blackwell by target), "amd" or "portable"; cfg: a GroupedGemmConfig."""
    import triton
    from triton.compiler import ASTSource

    wgrad, b_kmajor = FORMS[form]
    attrs = None
    if kernel == "tlx":
        from tlx_dist.grouped_gemm.tlx_backend import kernel_signature

        fn, sig, constexprs, opts = kernel_signature(target, wgrad, b_kmajor, cfg, dynamic=dynamic)
    elif kernel == "amd":
        from tlx_dist.grouped_gemm.amd_backend import kernel_signature

        fn, sig, constexprs, attrs, opts = kernel_signature(target, wgrad, b_kmajor, cfg, dynamic=dynamic)
    else:
        fn, sig, constexprs, attrs, opts = _portable_signature(form)
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=_target(target),
                          options=opts)


def _portable_signature(form: str):
    # The tile config the portable backend launches on a GPU for bf16 (triton_backend._blocks), and
    # the specialization the JIT gives operands of the MoE layer (D, F multiples of 16): unit strides
    # as constexpr 1, 16-byte aligned pointers, every other integer divisible by 16. (Without the
    # divisibility the loads cannot be vectorized and the sm_90 ragged-M kernel spills 240-470 B.)
    import torch

    from tlx.portable.grouped_gemm import _grouped_mm_kernel, _grouped_wgrad_kernel
    from tlx_dist.grouped_gemm.triton_backend import _blocks

    BM, BN, BK, warps, stages = _blocks(torch.empty(0, dtype=torch.bfloat16, device="meta"))
    constexprs = {"BM": BM, "BN": BN, "BK": BK, "IEEE": False, "NO_DOT": False}
    if form == "dW":
        fn, ptrs, ints = _grouped_wgrad_kernel, ("x_ptr", "dy_ptr", "dw_ptr"), "N_ROWS E D F".split()
        ints += "stride_xn stride_dyn stride_we stride_wd".split()
        constexprs.update(stride_xd=1, stride_dyf=1, stride_wf=1)
    else:  # fwd: w [E, D, F] N-contiguous; dX: w^T [E, F, D] K-contiguous
        fn, ptrs, ints = _grouped_mm_kernel, ("x_ptr", "w_ptr", "y_ptr"), "N_ROWS E K NN".split()
        ints += "stride_xn stride_we stride_yn".split() + (["stride_wn"] if form == "dX" else ["stride_wk"])
        constexprs.update({"stride_xk": 1, "stride_yf": 1, "stride_wk" if form == "dX" else "stride_wn": 1,
                           "SEARCH_STEPS": 8})
    types = {p: "*bf16" for p in ptrs} | {"offsets_ptr": "*i32", "tile_cum_ptr": "*i32"}
    types |= {n: "i32" for n in ints} | {k: "constexpr" for k in constexprs}
    sig = {n: types[n] for n in fn.arg_names}  # in the kernel's argument order
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr"}
    return fn, sig, constexprs, attrs, {"num_warps": warps, "num_stages": stages}


def _check_nvidia_resources(k, cc: int) -> None:
    from triton import knobs

    assert 0 < k.metadata.shared <= SMEM_LIMIT[cc], f"shared memory {k.metadata.shared} B > {SMEM_LIMIT[cc]}"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert m, usage
    regs, stack, local = map(int, m.groups())
    threads = int(re.search(r"\.reqntid (\d+)", k.asm["ptx"]).group(1)) if ".reqntid" in k.asm["ptx"] \
        else 32 * k.metadata.num_warps
    assert regs <= 255 and regs * threads <= 64 * 1024, f"{regs} registers x {threads} threads exceed the SM's 64K"
    assert stack == 0 and local == 0, f"register spills: STACK:{stack} LOCAL:{local}"


def _amd_meta(asm: str, field: str) -> int:
    m = re.search(rf"^\s*\.{field}:\s+(\d+)", asm, re.M)
    assert m, f"no .{field} in the amdgcn metadata"
    return int(m.group(1))


def _check_amd_resources(k, target: str) -> None:
    asm = k.asm["amdgcn"]
    assert 0 < k.metadata.shared <= LDS_LIMIT[target], f"LDS {k.metadata.shared} B > {LDS_LIMIT[target]} on {target}"
    # gfx9 CDNA: 512 VGPRs+AGPRs per lane per SIMD; a workgroup of W waves puts ceil(W / 4) on each SIMD.
    waves_per_simd = -(-k.metadata.num_warps // 4)
    vgprs = _amd_meta(asm, "vgpr_count")  # arch VGPRs + AGPRs (unified file)
    assert vgprs <= 512 // waves_per_simd, f"{vgprs} VGPRs > {512 // waves_per_simd} with {waves_per_simd} waves/SIMD"
    # (SGPR spills go to VGPR lanes, not memory.)
    for field in ("vgpr_spill_count", "private_segment_fixed_size"):
        assert _amd_meta(asm, field) == 0, f"{field} = {_amd_meta(asm, field)} (spills to scratch)"


# --- TLX Hopper / Blackwell -------------------------------------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
def test_hopper_compiles(form):
    k = _compiled("tlx", 90, form)
    ptx = k.asm["ptx"]
    assert len(k.asm["cubin"]) > 0
    assert "wgmma.mma_async" in ptx, "no wgmma in the Hopper kernel"
    assert "cp.async.bulk.tensor" in ptx, "no TMA in the Hopper kernel"
    assert "setmaxnreg" in ptx, "no register reallocation between producer and consumers"
    # dW claims its tiles longest-expert-first from an atomic counter; fwd/dX walk them statically.
    assert ("atom.global" in ptx) == (form == "dW"), "dynamic tile claims only in dW"
    _check_nvidia_resources(k, 90)


@pytest.mark.parametrize("form,dynamic", [("fwd", None), ("dX", None), ("dW", None), ("dW", False)])
def test_hopper_group_raster_and_static_dw_compile(form, dynamic):
    # GROUP_M=8 is the default for wide outputs (Mixtral); the static dW walk stays selectable
    # (GroupedGemmConfig.dw_order="static": faster on balanced routing with short tiles).
    from tlx_dist.grouped_gemm.config import GroupedGemmConfig

    k = _compiled("tlx", 90, form, GroupedGemmConfig(128, 256, 64, 3, 8), dynamic=dynamic)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert ("atom.global" in ptx) == (form == "dW" and dynamic is None)
    _check_nvidia_resources(k, 90)


@pytest.mark.parametrize("form", list(FORMS))
def test_blackwell_compiles(form):
    k = _compiled("tlx", 100, form)
    ptx = k.asm["ptx"]
    assert len(k.asm["cubin"]) > 0
    assert "tcgen05.mma" in ptx, "no tcgen05 MMA in the Blackwell kernel"
    assert "cp.async.bulk.tensor" in ptx, "no TMA in the Blackwell kernel"
    _check_nvidia_resources(k, 100)


# --- TLX AMD ----------------------------------------------------------------------------------------


def _amd_cases():
    from tlx_dist.grouped_gemm.config import CANDIDATES

    # The default (first) candidate in every form; the others in the form that needs most registers.
    for target, cfgs in ((t, CANDIDATES[t]) for t in ("gfx942", "gfx950")):
        for form in FORMS:
            yield target, form, cfgs[0]
        for cfg in cfgs[1:]:
            yield target, "dW", cfg


@pytest.mark.parametrize("target,form,cfg", list(_amd_cases()) if tlx.tlx_available() else [],
                         ids=lambda v: f"{v.BM}x{v.BN}x{v.BK}s{v.STAGES}g{v.GROUP_M}" if hasattr(v, "BM") else str(v))
def test_amd_compiles(target, form, cfg):
    from tlx_dist.grouped_gemm.config import lds_bytes

    k = _compiled("amd", target, form, cfg)
    asm = k.asm["amdgcn"]
    assert len(k.asm["hsaco"]) > 0
    assert MFMA.search(asm), f"no bf16 MFMA in the {target} kernel"
    assert "s_setprio 1" in asm, "no warp-pipeline stage priorities (the wave groups are not pipelined)"
    if target == "gfx950":
        assert re.search(r"global_load_lds_dwordx4|buffer_load_dwordx4[^\n]* lds", asm), "no 16-byte direct-to-LDS"
    else:
        assert re.search(r"(global|buffer)_load_dwordx4", asm), "no 16-byte global loads"
    # The K-contiguous LDS layouts make the MFMA operand reads vectorized (no 2-byte LDS reads).
    assert "ds_read_u16" not in asm, "scalar 2-byte LDS reads feed the MFMAs"
    assert bool(re.search(r"(global|buffer)_atomic_add", asm)) == (form == "dW"), "dynamic tile claims only in dW"
    ring = cfg.STAGES * (cfg.BM * cfg.BK + cfg.BK * cfg.BN) * 2
    # The ring really is NB slots in LDS, and the host's budget (config.lds_bytes) matches the compiler's.
    assert ring <= k.metadata.shared <= lds_bytes(cfg, target) + 256, (k.metadata.shared, ring)
    _check_amd_resources(k, target)


# --- portable Triton --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [90, "gfx942"])
@pytest.mark.parametrize("form", list(FORMS))
def test_portable_compiles(target, form):
    k = _compiled("portable", target, form)
    if target == 90:
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx or "mma.sync" in ptx, "no tensor-core MMA in the portable kernel"
        _check_nvidia_resources(k, 90)
    else:
        assert MFMA.search(k.asm["amdgcn"]), "no bf16 MFMA in the portable kernel"
        _check_amd_resources(k, target)
