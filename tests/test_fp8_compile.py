"""The FP8 grouped-GEMM kernels compile for their targets without a GPU (CI tier T2).

Blackwell (sm_100, tlx/blackwell/fp8_grouped_gemm.py): the MXFP8 kernel, mm and weight-gradient
forms: block-scaled ``tcgen05.mma ... kind::mxf8f6f4.block_scale.scale_vec::1X`` (UTCQMMA), the
scales copied to tensor memory (``tcgen05.cp``), 5-D TMA of the scale blocks, within shared and
tensor memory, no spills. AMD (gfx942 e4m3fnuz, gfx950 e4m3fn; tlx/amd/fp8_grouped_gemm.py): see
the AMD section.

Hopper (sm_90, tlx/hopper/fp8_grouped_gemm.py): mm (forward and dX: the same kernel, B given
K-contiguous) and the weight gradient, for each config the host can pick. Each compiled kernel
must hold: wgmma with e4m3 operands (``wgmma.mma_async...e4m3.e4m3``, fp32 accumulators), the
zero-initialised partial (``QGMMA ... RZ, !UPT``: scale-d off on the first wgmma of a k-step, so
the block scales are applied on the CUDA cores between k-steps), TMA loads and stores, the
producer / consumer register split (``setmaxnreg``), no shared-memory layout conversion of the
accumulators (shared memory = the ring + the epilogue tiles), and no register spills inside the
main loop (for the default configs: none at all).
"""

import functools
import os
import re
import subprocess
import tempfile

import pytest

import tlx

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")

SMEM_LIMIT = 227 * 1024


def _cuda(cc):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", cc, 128)


@functools.lru_cache(maxsize=None)
def _hopper(wgrad: bool, cfg):
    import triton
    from triton.compiler import ASTSource

    from tlx_dist.fp8.tlx_gemm import kernel_signature

    fn, sig, constexprs, opts = kernel_signature(wgrad, cfg)
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=_cuda(90), options=opts)


def _cuobjdump(k, *args) -> str:
    from triton import knobs

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        return subprocess.run([knobs.nvidia.cuobjdump.path, *args, path], capture_output=True, text=True,
                              check=True).stdout


def _spills_in_mma_loops(sass: str) -> list[str]:
    """Local-memory instructions inside a k-loop: the innermost loop (a backward branch's
    [target, branch] address range) around each wgmma."""
    ins = [(int(m.group(1), 16), ln.strip()) for ln in sass.splitlines()
           if (m := re.search(r"/\*([0-9a-f]{4,})\*/", ln))]
    loops = [(int(m.group(1), 16), a) for a, ln in ins if (m := re.search(r"BRA (?:`\()?0x([0-9a-f]+)", ln))
             and int(m.group(1), 16) < a]
    inner = set()
    for a, ln in ins:
        if "GMMA" in ln:
            around = [lp for lp in loops if lp[0] <= a <= lp[1]]
            assert around, "a wgmma outside every loop"
            inner.add(min(around, key=lambda lp: lp[1] - lp[0]))
    return [ln for a, ln in ins if re.search(r"\b(STL|LDL)\b", ln) and any(lo <= a <= hi for lo, hi in inner)]


def _serialized_wgmmas(sass: str) -> bool:
    """A wgmma that accumulates onto the previous one's result but waits for it first
    (``WARPGROUP.DEPBAR`` in between): what ptxas emits when it serializes a kernel's wgmmas."""
    waited = False
    for ln in sass.splitlines():
        if "WARPGROUP.DEPBAR" in ln:
            waited = True
        elif "GMMA" in ln:
            if waited and not re.search(r"gdesc\[UR\d+\], RZ", ln):
                return True
            waited = False
    return False


def _configs():
    from tlx_dist.fp8.tlx_gemm import CANDIDATES, default_config

    # (form, config, spill-free everywhere?)
    yield "mm", default_config("mm", 14336), True
    yield "dW", default_config("dW", 14336), True
    yield "mm", CANDIDATES[1], False  # 128 x 256 in 64-column slices: forward / dX only (its dW spills)


@pytest.mark.parametrize("form,cfg,no_spills", list(_configs()) if tlx.tlx_available() else [],
                         ids=lambda v: f"BN{v.BN}_SUBN{v.SUBN}_S{v.STAGES}_G{v.GROUP_M}" if hasattr(v, "BN") else str(v))
def test_hopper_fp8_compiles(form, cfg, no_spills):
    k = _hopper(form == "dW", cfg)
    ptx = k.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx), "no e4m3 wgmma"
    assert f"m64n{cfg.SUBN}k32" in ptx, f"the wgmma is not {cfg.SUBN} columns wide"
    assert "cp.async.bulk.tensor" in ptx, "no TMA"
    assert "cp.async.bulk.tensor.4d.global.shared" in ptx or form == "dW", "no ragged TMA store"
    assert "setmaxnreg" in ptx, "no register reallocation between producer and consumers"
    sass = _cuobjdump(k, "-sass")
    assert not _serialized_wgmmas(sass), "ptxas serialized the wgmmas of a k-step (C7514)"
    assert re.search(r"GMMA\.64x\d+x32\.F32\.E4M3\.E4M3 R\d+, gdesc\[UR\d+\], RZ, !UPT", sass), \
        "the k-step's first wgmma does not start from a zero partial"
    ring = cfg.STAGES * (128 + cfg.BN) * 128
    # (+2 KB: barriers and the scale vectors' small layout conversions; an accumulator's would be 16 KB+)
    assert ring <= k.metadata.shared <= cfg.smem_bytes() + 2048 <= SMEM_LIMIT + 2048, \
        f"shared {k.metadata.shared} B vs the ring {ring} + epilogue: a layout conversion through shared memory?"
    usage = _cuobjdump(k, "-res-usage")
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    assert regs * 32 * k.metadata.num_warps <= 64 * 1024 or ".reqntid 384" in ptx
    assert not _spills_in_mma_loops(sass), _spills_in_mma_loops(sass)[:8]
    if no_spills:
        assert stack == 0, f"register spills: STACK:{stack}"


def test_config_validation():
    from tlx_dist.fp8.tlx_gemm import Fp8GemmConfig

    with pytest.raises(ValueError, match="exceed the 192"):
        Fp8GemmConfig(256, 128, 3)
    with pytest.raises(ValueError, match="shared memory"):
        Fp8GemmConfig(256, 64, 4)
    with pytest.raises(ValueError, match="BN=96"):
        Fp8GemmConfig(96, 64, 3)
    assert Fp8GemmConfig(128, 128, 5).smem_bytes() <= SMEM_LIMIT


# --- Blackwell (sm_100): MXFP8 block-scaled tcgen05 -----------------------------------------------


@pytest.mark.parametrize("form", ["mm", "dW"])
def test_blackwell_mxfp8_compiles(form):
    import triton
    from triton.compiler import ASTSource

    from tlx_dist.fp8.mx import kernel_signature

    fn, sig, constexprs, opts = kernel_signature(form == "dW")
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=_cuda(100), options=opts)
    ptx = k.asm["ptx"]
    # the tensor core applies the 1 x 32 e8m0 scales itself: MX kind, block scale, one scale per 32
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.scale_vec::1X", ptx), \
        "no block-scaled MXFP8 tcgen05 MMA"
    assert "tcgen05.cp" in ptx, "the scales do not reach tensor memory"
    assert "cp.async.bulk.tensor.5d" in ptx, "no 5-D TMA of the scale blocks"
    assert "tcgen05.commit" in ptx
    assert 0 < k.metadata.shared <= SMEM_LIMIT
    assert k.metadata.tmem_size <= 512, f"tensor memory {k.metadata.tmem_size} columns > 512"
    sass = _cuobjdump(k, "-sass")
    assert "UTCQMMA" in sass and "UTCCP" in sass, "no tcgen05 FP8 MMA / scale copy in the SASS"
    usage = _cuobjdump(k, "-res-usage")
    assert re.search(r"STACK:0 .*LOCAL:0", usage), usage


# --- AMD (gfx942 e4m3fnuz, gfx950 e4m3fn) -----------------------------------------------------------

MFMA_FP8 = {"gfx942": r"v_mfma_f32_\w+_fp8_fp8", "gfx950": r"v_mfma_f32_\w+_f8f6f4"}
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}


def _amd_meta(asm: str, field: str) -> int:
    m = re.search(rf"^\s*\.{field}:\s+(\d+)", asm, re.M)
    assert m, f"no .{field} in the amdgcn metadata"
    return int(m.group(1))


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
@pytest.mark.parametrize("form", ["mm", "dW"])
def test_amd_fp8_compiles(target, form):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fp8.amd_gemm import kernel_signature

    fn, sig, constexprs, attrs, opts = kernel_signature(target, form == "dW")
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("hip", target, 64),
                       options=opts)
    asm = k.asm["amdgcn"]
    assert re.search(MFMA_FP8[target], asm), f"no FP8 MFMA ({MFMA_FP8[target]}) for {target}"
    assert not re.search(r"v_mfma_f32_\w+_(bf16|f16)\b", asm), "the FP8 operands were widened before the MFMA"
    assert 0 < k.metadata.shared <= LDS_LIMIT[target]
    waves_per_simd = -(-k.metadata.num_warps // 4)
    assert _amd_meta(asm, "vgpr_count") <= 512 // waves_per_simd
    assert _amd_meta(asm, "vgpr_spill_count") == 0 and _amd_meta(asm, "private_segment_fixed_size") == 0


# --- the FP8 dispatch's receiver: dequantization (plain Triton) ----------------------------------


@pytest.mark.parametrize("out", ["bf16", "fp16", "fp32"])
def test_dequant_rows_kernel_compiles_with_the_hardware_decode(out):
    import triton
    from triton.compiler import ASTSource

    from tlx.common.fp8_quant import _dequant_rows_kernel

    sig = {"q_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": f"*{out}", "M": "i32", "C": "i32", "stride_qm": "i32",
           "stride_sk": "i32", "stride_ym": "i32", "G": "constexpr", "BLOCK_M": "constexpr"}
    k = triton.compile(ASTSource(_dequant_rows_kernel, sig, constexprs={"G": 128, "BLOCK_M": 32}), target=_cuda(90),
                       options={"num_warps": 4})
    # e4m3 -> f16 is exact (every e4m3 value is an f16), then the fp32 product, rounded once
    assert "cvt.rn.f16x2.e4m3x2" in k.asm["ptx"]
    assert re.search(r"mul(\.rn)?\.f32", k.asm["ptx"])


# --- the SwiGLU fused with its row quantization (plain Triton) --------------------------------------


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("form", ["fwd", "bwd_paired", "bwd_straddling"])
def test_swiglu_quant_kernels_compile_with_the_hardware_encode(form, dt):
    import triton
    from triton.compiler import ASTSource

    from tlx.common.fp8_swiglu import _swiglu_bwd_quant_kernel, _swiglu_quant_kernel

    cx = {"G": 128, "BLOCK_M": 32, "FMT": 0, "POW2": False, "EMULATE": False}
    if form == "fwd":
        fn = _swiglu_quant_kernel
        sig = {"h_ptr": f"*{dt}", "a_ptr": f"*{dt}", "q_ptr": "*u8", "s_ptr": "*fp32", "M": "i32", "F": "i32",
               "stride_hm": "i32", "stride_am": "i32", "stride_qm": "i32", "stride_sk": "i32"}
    else:
        fn = _swiglu_bwd_quant_kernel
        sig = {"h_ptr": f"*{dt}", "da_ptr": f"*{dt}", "dh_ptr": f"*{dt}", "q_ptr": "*u8", "s_ptr": "*fp32", "M": "i32",
               "F": "i32", "stride_hm": "i32", "stride_dam": "i32", "stride_dhm": "i32", "stride_qm": "i32",
               "stride_sk": "i32"}
        cx["PAIRED"] = form == "bwd_paired"
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=_cuda(90), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "the e4m3 encode must be the hardware cast"
    assert re.search(r"div\.rn\.f32", ptx), "silu / sigmoid use IEEE division"


# --- both quantizations in one pass over the expert tile grid (plain Triton) -------------------------


def test_quant_both_kernel_compiles_with_the_hardware_encode():
    import triton
    from triton.compiler import ASTSource

    from tlx.common.fp8_quant import _quant_both_kernel

    cx = {"G": 128, "FMT": 0, "POW2": False, "EMULATE": False, "SEARCH_STEPS": 4}
    sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "qc_ptr": "*u8", "sc_ptr": "*fp32",
           "offsets_ptr": "*i32", "tile_cum_ptr": "*i32", "E": "i32", "M": "i32", "C": "i32", "stride_xm": "i32",
           "stride_qm": "i32", "stride_sk": "i32", "stride_qc": "i32"}
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(ASTSource(_quant_both_kernel, sig, constexprs=cx), target=_cuda(90), options={"num_warps": 8})
    ptx = k.asm["ptx"]
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "the e4m3 encode must be the hardware cast"
    assert re.search(r"div\.rn\.f32", ptx), "the scales use IEEE division"


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_quant_cols_from_rows_kernel_compiles_with_the_hardware_casts(dt):
    # the weight gradient's column form straight from the dispatched FP8 rows: hardware e4m3 decode
    # (exact through f16), fp32 product, one hardware rounding to the activation dtype (RNE), the
    # hardware e4m3 encode; nothing in local memory
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    from tlx.common.fp8_quant import _quant_cols_from_rows_kernel

    cx = {"G": 128, "BLOCK_C": 64, "IN_FMT": 0, "FMT": 0, "POW2": False,
          "DTYPE": tl.bfloat16 if dt == "bf16" else tl.float16, "EMULATE_IN": False, "EMULATE": False,
          "SEARCH_STEPS": 4}
    sig = {"q_ptr": "*u8", "s_ptr": "*fp32", "qc_ptr": "*u8", "sc_ptr": "*fp32", "offsets_ptr": "*i32",
           "tile_cum_ptr": "*i32", "E": "i32", "M": "i32", "C": "i32", "stride_qm": "i32", "stride_sm": "i32",
           "stride_sk": "i32", "stride_qc": "i32"}
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(ASTSource(_quant_cols_from_rows_kernel, sig, constexprs=cx), target=_cuda(90),
                       options={"num_warps": 4})
    ptx = k.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx, "the e4m3 decode must be the hardware cast"
    rounding = rf"cvt\.rn\.{dt.replace('fp', 'f')}(x2)?\.f32"
    assert re.search(rounding, ptx), "one round-to-nearest-even to the activation dtype"
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "the e4m3 encode must be the hardware cast"
    assert re.search(r"div\.rn\.f32", ptx), "the scales use IEEE division"
    assert not re.search(r"\b(ld|st)\.local", ptx), "no spills"


def test_quant_cols_from_rows_kernel_compiles_for_gfx942_with_the_hardware_casts():
    # e4m3fnuz rows on MI300: the hardware fp8 <-> fp32 conversions both ways (no integer decode)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx.common.fp8_quant import _quant_cols_from_rows_kernel

    cx = {"G": 128, "BLOCK_C": 64, "IN_FMT": 1, "FMT": 1, "POW2": False, "DTYPE": tl.bfloat16, "EMULATE_IN": False,
          "EMULATE": False, "SEARCH_STEPS": 4}
    sig = {"q_ptr": "*u8", "s_ptr": "*fp32", "qc_ptr": "*u8", "sc_ptr": "*fp32", "offsets_ptr": "*i32",
           "tile_cum_ptr": "*i32", "E": "i32", "M": "i32", "C": "i32", "stride_qm": "i32", "stride_sm": "i32",
           "stride_sk": "i32", "stride_qc": "i32"}
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(ASTSource(_quant_cols_from_rows_kernel, sig, constexprs=cx),
                       target=GPUTarget("hip", "gfx942", 64), options={"num_warps": 4})
    asm = k.asm["amdgcn"]
    assert re.search(r"v_cvt_pk_f32_fp8", asm), "the e4m3fnuz decode must be the hardware conversion"
    assert re.search(r"v_cvt_pk_fp8_f32", asm), "the e4m3fnuz encode must be the hardware conversion"
    assert _amd_meta(asm, "vgpr_spill_count") == 0 and _amd_meta(asm, "private_segment_fixed_size") == 0


@pytest.mark.parametrize("form,store", [("fwd", False), ("fwd", True), ("bwd_paired", False), ("bwd_straddling", True)])
def test_swiglu_tile_grid_kernels_compile_with_the_hardware_encode(form, store):
    import triton
    from triton.compiler import ASTSource

    from tlx.common.fp8_swiglu import _swiglu_bwd_quant_tiles_kernel, _swiglu_quant_tiles_kernel

    cx = {"G": 128, "STORE": store, "FMT": 0, "POW2": False, "EMULATE": False, "SEARCH_STEPS": 4}
    tail = {"qc_ptr": "*u8", "sc_ptr": "*fp32", "offsets_ptr": "*i32", "tile_cum_ptr": "*i32", "E": "i32", "M": "i32",
            "F": "i32"}
    if form == "fwd":
        fn = _swiglu_quant_tiles_kernel
        sig = {"h_ptr": "*bf16", "a_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", **tail, "stride_hm": "i32",
               "stride_am": "i32", "stride_qm": "i32", "stride_sk": "i32", "stride_qc": "i32"}
    else:
        fn = _swiglu_bwd_quant_tiles_kernel
        sig = {"h_ptr": "*bf16", "da_ptr": "*bf16", "dh_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", **tail,
               "stride_hm": "i32", "stride_dam": "i32", "stride_dhm": "i32", "stride_qm": "i32", "stride_sk": "i32",
               "stride_qc": "i32"}
        cx["PAIRED"] = form == "bwd_paired"
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=_cuda(90), options={"num_warps": 8})
    ptx = k.asm["ptx"]
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "the e4m3 encode must be the hardware cast"
    assert re.search(r"div\.rn\.f32", ptx), "silu / sigmoid use IEEE division"
    # the kept output is stored as bf16 exactly when STORE (st.global of 16-bit values)
    assert bool(re.search(r"st\.global(\.\w+)*\.b16", ptx)) == store


def test_e4m3fnuz_on_nvidia_compiles_with_the_emulated_encode():
    """Triton has no e4m3fnuz type on NVIDIA GPUs (the hardware cast raises at compile time), so the
    quantizers take the integer encoding there (``tlx_dist.fp8.quant.emulate``): the row kernel
    with FMT=1 compiles for sm_90 and uses no hardware FP8 conversion."""
    import torch
    import triton
    from triton.compiler import ASTSource

    from tlx.common.fp8_quant import _quant_rows_kernel
    from tlx_dist.fp8.quant import emulate

    if getattr(torch.version, "hip", None):
        pytest.skip("ROCm encodes e4m3fnuz in hardware")
    assert emulate("e4m3fnuz") and emulate("e4m3fn") == (os.environ.get("TRITON_INTERPRET") == "1")
    cx = {"G": 128, "BLOCK_M": 32, "FMT": 1, "POW2": False, "EMULATE": emulate("e4m3fnuz")}
    sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "M": "i32", "C": "i32", "stride_xm": "i32",
           "stride_qm": "i32", "stride_sk": "i32"}
    sig.update({k: "constexpr" for k in cx})
    k = triton.compile(ASTSource(_quant_rows_kernel, sig, constexprs=cx), target=_cuda(90), options={"num_warps": 4})
    assert not re.search(r"cvt\.[a-z.]*e4m3", k.asm["ptx"]), "no hardware e4m3 cast for e4m3fnuz on sm_90"
