"""The Blackwell TLX fused expert kernels (``tlx/blackwell/fused_moe.py``) compile for sm_100 without a
GPU, with the arguments the real launcher passes (CI tier T2).

The six launches of one forward + backward are recorded from the ``tlx`` fused backend's own entry
points (``tlx_backend._tlx_forward`` / ``_tlx_backward``) on meta tensors of the ``h200_1gpu`` recipe's
shapes under ``tlx.override(arch="sm_100")`` -- so the recording also checks that the backend runs
the Blackwell primitives there -- and each is compiled with the specialisation Triton's JIT computes
for those arguments (descriptors, None operands, 16-divisible integers). Checked in the PTX / cubin:
tcgen05 MMAs with a TMEM allocation of the config's width (<= 512 columns), TMA for the operands read
in place, 16-byte ``cp.async`` row gathers (with ``cp.async.wait_group`` and a proxy fence before the
warp-barrier signal) exactly where an operand is read by index, relaxed fp32 atomic adds exactly in
the two scatter-epilogue forms, shared memory holding the config's ring and within 227 KB, and the
registers of all partitions within the SM's 64K with no local memory.
"""

import functools
import os
import re
import subprocess
import tempfile

import pytest

import tlx
from test_fused_compile import _SMEM_LIMIT, FORMS, PORTABLE

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")

_NUM_SMS = 148  # B200
LAUNCHES = PORTABLE  # the launch flags that identify each form, in launch order


def _base(form: str) -> str:
    return "scatter" if form == "scatter_t" else form


@functools.lru_cache(maxsize=None)
def _blackwell_launches() -> dict:
    """form -> (kernel, args, kwargs) of each launch the tlx fused backend makes on sm_100."""
    import torch

    import tlx.blackwell.fused_moe as kernels
    from tlx_dist.fused import FusedConfig
    from tlx_dist.fused import tlx_backend as tb

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
    # the gathered forms (LAUNCHES); the copies' forms are compiled in test_copy_forms_compile
    gathered = FusedConfig(x_rows="gather", dout_rows="gather")
    with pytest.MonkeyPatch.context() as mp, tlx.override(arch="sm_100", tlx=True):
        assert tb._tlx_prims() is tb._Blackwell
        mp.setattr(kernels, "_fused_mm_blackwell_kernel", _Record(kernels._fused_mm_blackwell_kernel))
        mp.setattr(kernels, "_fused_wgrad_blackwell_kernel", _Record(kernels._fused_wgrad_blackwell_kernel))
        # The scheduler's prep and the dW order are kernels of their own (compiled in test_tlx_compile);
        # the fused launches take only their [E + 1] / [E] int32 results. No GPU to ask for its SM count.
        mp.setattr(tb._Blackwell, "tile_cum", staticmethod(
            lambda off, n, x=None: torch.empty(off.shape[0] + 1, dtype=torch.int32, device=off.device)))
        mp.setattr(tb._Blackwell, "wgrad_order", staticmethod(lambda off: torch.empty_like(off)))
        mp.setattr(tb, "_grid", lambda device, bound: max(1, min(_NUM_SMS, bound)))
        _out, h_N2F = tb._tlx_forward(x_TD, tok_N, tok_N, gate_N, w13_EDF2, w2_EFD, offsets_E, T, config=gathered)
        tb._tlx_backward(torch.empty_like(x_TD), x_TD, tok_N, tok_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F,
                         config=gathered)
    assert len(calls) == len(LAUNCHES), f"{len(calls)} launches, expected {list(LAUNCHES)}"
    out = {}
    for form, (fn, args, kwargs) in zip(LAUNCHES, calls):
        flags = {k: kwargs[k] for k in LAUNCHES[form]}
        assert flags == LAUNCHES[form], f"launch {list(LAUNCHES).index(form)} is not {form}: {flags}"
        out[form] = (fn, args, kwargs)
    return out


@functools.lru_cache(maxsize=None)
def _compiled(form: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, args, kwargs = _blackwell_launches()[form]
    gpu = GPUTarget("cuda", 100, 64)
    backend = make_backend(gpu)
    # What ``kernel[grid](...)`` does before it compiles: None -> constexpr, descriptors -> tensordesc
    # types, 16-divisible ints and pointers -> tt.divisibility (the launcher passes every constexpr).
    bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=gpu, options=options.__dict__)


def test_tlx_primitives_follow_the_arch():
    """sm_90 runs the Hopper kernels, sm_100 the Blackwell ones; elsewhere the backend declines."""
    import torch

    from tlx_dist.fused import tlx_backend as tb

    x = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    w13, w2 = torch.empty(2, 64, 128, dtype=torch.bfloat16), torch.empty(2, 64, 64, dtype=torch.bfloat16)
    with tlx.override(arch="sm_90", tlx=True):
        assert tb._tlx_prims() is tb._Hopper
    with tlx.override(arch="sm_100", tlx=True):
        assert tb._tlx_prims() is tb._Blackwell
        assert "not a CUDA GPU" in tb._supports(x, w13, w2)  # past the arch check
    with tlx.override(arch="gfx94x", tlx=True):
        with pytest.raises(ValueError, match=r"target sm_90 and sm_100, not gpu_arch\(\)='gfx94x'"):
            tb._tlx_prims()
        assert "target sm_90 and sm_100" in tb._supports(x, w13, w2)


def test_blackwell_configs_fit():
    """Every default sm_100 config fits shared memory and TMEM and passes its form's checks (the
    fields' own errors: tests/test_fused_config.py)."""
    from tlx_dist.fused.config import BLACKWELL_FORMS

    for form, cfg in BLACKWELL_FORMS.items():
        assert cfg.smem_bytes(form) <= _SMEM_LIMIT and cfg.tmem_cols(form) <= 512, (form, cfg)
        cfg.check_form(form, form)


@pytest.mark.parametrize("form", list(LAUNCHES))
def test_kernel_signature_matches_the_launcher(form):
    """The hand-written compile spec (``kernel_signature(arch="sm_100")``) passes the constexprs the
    launcher passes, so compiling from it tests the launched kernel."""
    from tlx_dist.fused.tlx_backend import kernel_signature

    fn, args, kwargs = _blackwell_launches()[form]
    kfn, _sig, constexprs, _attrs, _opts = kernel_signature(form, arch="sm_100")
    assert kfn is fn
    launched = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    launched.update({n: None for n, a in zip(fn.arg_names, args) if a is None})
    shape_dependent = ("NUM_SMS", "SEARCH_STEPS", "GROUP_M")  # grid, E, and the raster of wide outputs
    assert {k: v for k, v in constexprs.items() if k not in shape_dependent} == \
        {k: v for k, v in launched.items() if k not in shape_dependent}


def _resources(k):
    from triton import knobs

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert m, usage
    return map(int, m.groups())


@pytest.mark.parametrize("form", list(LAUNCHES))
def test_fused_blackwell_kernels_compile(form):
    from tlx_dist.fused.config import BLACKWELL_FORMS

    k = _compiled(form)
    ptx = k.asm["ptx"]
    gathered, scatter = FORMS[form]
    assert len(k.asm["cubin"]) > 0
    assert "tcgen05.mma" in ptx, "no tcgen05 MMA"
    assert "tcgen05.commit" in ptx, "no tcgen05 commit (stage release / accumulator ready)"
    assert "cp.async.bulk.tensor" in ptx, "no TMA for the operands read in place"
    _fn, args, kwargs = _blackwell_launches()[form]
    cfg = BLACKWELL_FORMS[_base(form)]
    assert (cfg.BN, cfg.BK, cfg.STAGES) == (kwargs["BN"], kwargs["BK"], kwargs["NUM_STAGES"])
    alloc = re.findall(r"tcgen05\.alloc\.\S+\s+\[[^\]]+\],\s*(\d+);", ptx)
    assert alloc == [str(cfg.tmem_cols(_base(form)))], f"TMEM allocation {alloc} != {cfg.tmem_cols(_base(form))}"
    assert cfg.smem_bytes(_base(form)) <= k.metadata.shared <= _SMEM_LIMIT, \
        f"shared memory {k.metadata.shared} B: the ring needs {cfg.smem_bytes(_base(form))}, the limit is {_SMEM_LIMIT}"
    copies = [ln for ln in ptx.splitlines() if "cp.async.cg.shared.global" in ln]
    if gathered:
        assert copies and all("0x10" in ln for ln in copies), "row gathers must be 16-byte cp.async"
        assert "cp.async.wait_group" in ptx and "fence.proxy.async" in ptx
    else:
        assert not copies, "no gathered operand in this form"
    atomics = re.findall(r"(?:^|\s)((?:atom|red)\.global\.\S+)", ptx, re.M)
    if scatter:
        assert atomics and all(".relaxed.add" in a and a.endswith(".f32") for a in atomics), \
            f"scatter epilogue: relaxed fp32 atomic adds only, got {sorted(set(atomics))}"
    else:
        assert not atomics, f"atomics outside the scatter epilogue: {sorted(set(atomics))}"
    regs, stack, local = _resources(k)
    threads = int(re.search(r"\.reqntid (\d+)", ptx).group(1))
    assert regs * threads <= 64 * 1024, f"{regs} registers x {threads} threads exceed the SM's 64K"
    # ptxas copies one 64-bit driver constant (c[0x0][0x348], below the kernel parameters) to the
    # stack at entry and reloads it once per partition in the dW forms (8 B, seen in the SASS); a
    # register-pressure spill would be larger and would also show as local memory.
    assert local == 0 and stack <= 8, f"register spills: STACK:{stack} LOCAL:{local}"


def test_fused_blackwell_virtual_experts_compile():
    """The EP overlap's phased launches on sm_100 (VIRT=3: runs of each expert's rows as virtual
    experts, weights of expert e // 3), gate/up and down forms: the same kernel (tcgen05, TMA
    weights, the same shared memory and TMEM) with the weight coordinate divided."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    gpu = GPUTarget("cuda", 100, 64)
    backend = make_backend(gpu)
    for form in ("swiglu", "scatter"):
        fn, args, kwargs = _blackwell_launches()[form]
        assert kwargs["VIRT"] == 1  # the launcher always binds it (a c_launch kernel keeps no defaults)
        k1 = _compiled(form)
        kw = dict(kwargs, VIRT=3)
        bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kw)
        options, sig, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
        k3 = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=gpu, options=options.__dict__)
        assert "tcgen05.mma" in k3.asm["ptx"] and "cp.async.bulk.tensor" in k3.asm["ptx"]
        assert k3.metadata.shared == k1.metadata.shared
        assert k3.asm["ptx"] != k1.asm["ptx"], f"{form}: VIRT must reach the weight coordinate"


@pytest.mark.parametrize("form", ["dswiglu_copy", "swiglu_copy"])
def test_copy_forms_compile(form):
    """FusedConfig dout_rows / x_rows "copy": dSwiGLU / SwiGLU read their A operand (the expert-major
    copy of dout / x) in place by TMA -- no row gathers -- within the shared-memory limit."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx_dist.fused.tlx_backend import kernel_signature

    fn, sig, constexprs, attrs, opts = kernel_signature(form, arch="sm_100")
    assert constexprs["A_GATHER"] is False
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 100, 128),
                       options=opts)
    ptx = k.asm["ptx"]
    assert "tcgen05.mma" in ptx and "cp.async.bulk.tensor" in ptx
    assert "cp.async.cg.shared.global" not in ptx, "no gathered operand"
    assert k.metadata.shared <= _SMEM_LIMIT
