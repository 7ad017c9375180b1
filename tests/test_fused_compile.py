"""The Hopper TLX fused expert kernels compile to cubin for sm_90 without a GPU (CI tier T2).

Each form the fused pipeline launches is compiled with the signature and 16-divisibility the
launcher specialises on, and the PTX is checked for what the form exists for: wgmma everywhere,
16-byte ``cp.async`` row gathers (with ``cp.async.wait_group`` and a proxy fence before the
warp-barrier signal) where an operand is read by index, TMA for operands read in place, relaxed fp32
atomics in the scatter epilogue, the producer/consumer register split -- and that the shared memory
the kernel asks for fits an H100/H200 (227 KB), which a compile on CPU does not check by itself.
"""

import re

import pytest

import tlx

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")

# form -> (operand gathered by cp.async?, scatter epilogue?)
FORMS = {
    "swiglu": (True, False),     # GEMM 1: x[src] @ w13, SwiGLU epilogue
    "scatter": (False, True),    # GEMM 2: out[dst] += gate * (a @ w2)
    "scatter_t": (False, True),  # dX of GEMM 1: dx[src] += dh @ w13^T (K-major weight)
    "dswiglu": (True, False),    # dX of GEMM 2: dout[dst] @ w2^T, dSwiGLU + gate-gradient epilogue
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
