"""The SwiGLU fused with its FP8 row quantization on the GPU (tier T3), and the fused FP8 experts.

Kernels (compiled: hardware ``cvt.rn.satfinite`` e4m3 encode, fp32 -> bf16 / fp16 rounding): against
float64 within the bound of tests/fp8_swiglu_cases.py, and their quantized outputs equal to
``quantize_rows_ref`` of their rounded outputs bit for bit. The fused experts (TLX GEMMs, sm_90) on
an OLMoE-like layer (D = 2048, F = 1024, E = 64, Zipf-imbalanced rows with empty experts): output
and every gradient against float64 (``swiglu_experts_ref``) bounded by the unfused path on the same
backend (STYLE.md 6), plus CUDA-graph capture of the fused forward and backward.
Run: ``pytest -m gpu tests/test_fp8_swiglu_gpu.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tlx
from fp8_swiglu_cases import adversarial_h, check_swiglu_bwd_quant, check_swiglu_quant
from tlx_dist import fp8
from tlx_dist.fp8 import swiglu as S
from tlx_dist.testing import assert_close_to_ref

# Collected everywhere (so a CPU run proves the module imports and parametrizes), run only on a GPU.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
needs_tlx = pytest.mark.skipif(not (tlx.tlx_available() and tlx.gpu_arch() == "sm_90"),
                               reason="the TLX FP8 kernels need sm_90 with fbtriton")


def _fwd(h, fmt, pow2):
    return S.swiglu_quant(h, fmt=fmt, pow2=pow2, backend="triton")


def _bwd(h, dA, fmt, pow2):
    return S.swiglu_bwd_quant(h, dA, fmt=fmt, pow2=pow2, backend="triton")


def _poisoned(fn):
    # the caching allocator hands back the poisoned block: an element no program wrote shows as NaN
    torch.empty(1 << 26, dtype=torch.float32, device=DEV).fill_(float("nan"))
    return fn()


# (M, F, why)
SHAPES = [
    (4096, 1024, "OLMoE's F: paired backward tiles, many row blocks"),
    (1000, 768, "F = 768 (6 groups), M not a multiple of the 32-row block"),
    (333, 200, "F = 200: partial group; backward tiles straddle gate and up"),
    (1, 128, "a single row"),
    (0, 256, "no rows"),
]


@pytest.mark.parametrize("M,F_,why", SHAPES, ids=[s[2].split(":")[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_kernels_vs_references(M, F_, why, dtype, pow2):
    h, dA = adversarial_h(M, F_, dtype, seed=M + F_, device=DEV)
    check_swiglu_quant(lambda *a: _poisoned(lambda: _fwd(*a)), h, pow2=pow2, what=why)
    check_swiglu_bwd_quant(lambda *a: _poisoned(lambda: _bwd(*a)), h, dA, pow2=pow2, what=why)


def _zipf(total, E, s=1.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    p = p[torch.randperm(E, generator=g)]
    c = torch.floor(p / p.sum() * total).long()
    c[0] += total - int(c.sum())
    c[3], c[5] = c[3] + c[5], 0  # a zero-token expert
    return c.tolist()


def _olmoe_like(N=8192, D=2048, Fi=1024, E=64, pad=64, seed=0):
    counts = _zipf(N - pad, E)
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(N, D, device=DEV, generator=g)
    x[:, 7] = 1e4  # an outlier per row
    x[:3, :128] = 0.0  # all-zero tiles
    w13 = torch.randn(E, D, 2 * Fi, device=DEV, generator=g) / D ** 0.5
    w2 = torch.randn(E, Fi, D, device=DEV, generator=g) / Fi ** 0.5
    dy = torch.randn(N, D, device=DEV, generator=g)
    off = torch.tensor(counts, dtype=torch.int64, device=DEV).cumsum(0).to(torch.int32)
    return x.bfloat16(), w13.bfloat16(), w2.bfloat16(), dy.bfloat16(), off


def _unfused(x, w13, w2, off, backend):
    # the path the fused experts replace: two differentiable FP8 GEMMs, bf16 silu(gate) * up between
    h = fp8.grouped_mm_fp8(x, w13, off, backend=backend)
    g, u = h.chunk(2, dim=-1)
    return fp8.grouped_mm_fp8(F.silu(g) * u, w2, off, backend=backend)


def _run(fn, tensors, dy, dt=torch.bfloat16):
    ts = [t.detach().clone().to(dt).requires_grad_(True) for t in tensors]
    y = fn(*ts)
    return [y.detach()] + list(torch.autograd.grad((y.to(dt) * dy.to(dt)).sum(), ts))


@needs_tlx
def test_fused_experts_olmoe_like_vs_float64_bounded_by_the_unfused_path():
    x, w13, w2, dy, off = _olmoe_like()
    ours = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="tlx"), (x, w13, w2), dy)
    theirs = _run(lambda *t: _unfused(*t, off, "tlx"), (x, w13, w2), dy)
    ref = _run(lambda *t: fp8.swiglu_experts_ref(*t, off), (x, w13, w2), dy, torch.float64)
    n_rows = int(off[-1])
    for n, o, t, r in zip(("y", "dx", "dw13", "dw2"), ours, theirs, ref):
        assert not torch.isnan(o).any(), n
        assert_close_to_ref(o.cpu(), r.cpu(), t.cpu(), dtype=torch.bfloat16, name=f"olmoe-like: {n}")
    assert (ours[0][n_rows:] == 0).all() and (ours[1][n_rows:] == 0).all(), "padding rows must be zero"
    empty = [e for e, c in enumerate(torch.diff(off, prepend=off.new_zeros(1)).tolist()) if c == 0]
    assert empty and all((ours[2][e] == 0).all() and (ours[3][e] == 0).all() for e in empty)


@needs_tlx
def test_fused_experts_auto_backend_and_cuda_graph():
    # the automatic choice is the TLX path; forward + backward capture in a CUDA graph (no host
    # sync, no data-dependent shape) and replay to the eager result
    x, w13, w2, dy, off = _olmoe_like(N=2048, E=16, pad=32)
    q13, q2 = fp8.quantize_weight(w13), fp8.quantize_weight(w2)
    eager = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, w13_fp8=q13, w2_fp8=q2), (x, w13, w2), dy)
    pinned = _run(lambda *t: fp8.swiglu_experts_fp8(*t, off, w13_fp8=q13, w2_fp8=q2, backend="tlx"), (x, w13, w2), dy)
    for a, b in zip(eager, pinned):
        assert torch.equal(a, b)
    ts = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2)]
    fn = lambda: torch.autograd.grad((fp8.swiglu_experts_fp8(*ts, off, w13_fp8=q13, w2_fp8=q2) * dy).sum(), ts)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    for n, o, e in zip(("dx", "dw13", "dw2"), out, eager[1:]):
        assert torch.equal(o, e), n
