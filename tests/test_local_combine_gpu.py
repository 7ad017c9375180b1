"""The fused single-rank combine kernels (tlx/common/combine.py via LocalDispatcher) on the GPU
(tier T3): forward, y and gate gradients and the dispatch backward against the torch composition
and float64 (tests/local_combine_cases.py says what is exact and what is bounded) on an OLMoE-like
layer (T = 4096, K = 8, E = 64, D = 2048, bf16) and on the adversarial shapes, with unwritten
outputs poisoned to NaN; plus CUDA-graph capture of the forward and backward.
Run: ``pytest -m gpu tests/test_local_combine_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from local_combine_cases import CASE_IDS, CASES, check_combine, check_dispatch_backward, make_case
from tlx_dist.comm.local_combine import use_combine_kernels

# Collected everywhere (so a CPU run proves the module imports and parametrizes), run only on a GPU.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"


def _poisoned(fn):
    # the caching allocator hands back the poisoned block: an element no program wrote shows as NaN
    def run(*a):
        torch.empty(1 << 26, dtype=torch.float32, device=DEV).fill_(float("nan"))
        return fn(*a)
    return run


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_olmoe_shape_bf16(gate_dtype):
    disp, h, y, gate, g = make_case(4096, 8, 64, 2048, "random", "signed", torch.bfloat16, gate_dtype, seed=0,
                                    device=DEV)
    assert use_combine_kernels(y, gate)
    check_combine(_poisoned(disp.combine_weighted), disp, h, y, gate, g, what="OLMoE")
    check_dispatch_backward(_poisoned(disp.dispatch_backward), disp, h, y)


@pytest.mark.parametrize("T,K,E,D,routing,values,why", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adversarial(T, K, E, D, routing, values, why, dtype):
    disp, h, y, gate, g = make_case(T, K, E, D, routing, values, dtype, seed=T + 7 * K + D, device=DEV)
    check_combine(_poisoned(disp.combine_weighted), disp, h, y, gate, g, what=why)
    g_N = (y.double() / K).to(dtype) if values == "huge" else y  # the ungated k-sum stays finite
    check_dispatch_backward(_poisoned(disp.dispatch_backward), disp, h, g_N)


def test_cuda_graph_capture():
    disp, h, y, gate, g = make_case(1024, 8, 64, 2048, "random", "signed", torch.bfloat16, seed=3, device=DEV)
    y_ = y.clone().requires_grad_(True)
    w_ = gate.clone().requires_grad_(True)

    def step():
        out = disp.combine_weighted(y_, h, w_)
        return (out, *torch.autograd.grad(out, [y_, w_], g), disp.dispatch_backward(y, h))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = step()  # warm-up (compiles the kernels) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "g_y", "g_gate", "dispatch_backward"), captured, eager):
        assert torch.equal(a, b), name
