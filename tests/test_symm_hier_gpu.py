"""The hierarchical exchange on one GPU (tiers T3/T4): an emulated world of N "nodes" of L virtual
ranks whose inter-node leg goes by pointer stores (every virtual rank has a pointer on one GPU),
running the compiled kernels of tlx/comm/hier.py with the flat ones, against the flat oracle and the
pure-PyTorch reference of the hierarchical exchange -- rows, sums (bf16 included: the GPU rounds
to nearest, as the reference does) and per-leg device counters, exactly.

    pytest -m gpu tests/test_symm_hier_gpu.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]


@pytest.mark.parametrize("W,L,kind", [
    (8, 4, "random"), (8, 2, "random"), (4, 2, "random"),           # 2 x 4, 4 x 2, 2 x 2
    (8, 4, "one_node"), (8, 2, "empty_node"), (8, 2, "one_rank_per_node"),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hier_world_on_gpu(W, L, kind, dtype):
    from symm_hier_interpreted_cases import check_hier_world
    E, K, D = 8 * W, 4, 512
    Ts = [64 + 37 * s for s in range(W)]
    Ts[1] = 0  # a rank with no tokens
    check_hier_world(W, L, E, K, Ts, D, kind, dtype, nvshmem=False, device="cuda")


def test_hier_world_on_gpu_deepseek_rows():
    """DeepSeek-V3-sized rows (D = 7168, E = 64 over W = 8 as 2 x 4, K = 8; every token to all 8
    experts), K = E with W = 4 as 2 x 2, and capacity="exact"."""
    from symm_hier_interpreted_cases import check_hier_world
    check_hier_world(8, 4, 64, 8, [256] * 8, 7168, "random", torch.bfloat16, nvshmem=False, device="cuda")
    check_hier_world(4, 2, 4, 4, [100, 3, 50, 0], 256, "all_experts", torch.bfloat16, nvshmem=False, device="cuda")
    check_hier_world(4, 2, 16, 4, [100, 80, 1, 60], 256, "random", torch.bfloat16, nvshmem=False, device="cuda",
                     capacity="exact")


def test_hier_one_node_is_flat_on_gpu():
    """One node of 4 (L = W): the hierarchical ops are the flat ones, bit for bit."""
    from symm_hier_interpreted_cases import HierWorld, _inputs

    from tlx_dist.comm.emulated import EmulatedWorld
    W, E, K, D = 4, 32, 4, 512
    Ts = [120, 64, 0, 90]
    xs, idxs, gates = _inputs(W, W, E, K, Ts, D, "random", torch.bfloat16)
    dev = torch.device("cuda")
    xs, idxs, gates = [x.to(dev) for x in xs], [i.to(dev) for i in idxs], [g.to(dev) for g in gates]
    hw = HierWorld(W, max(Ts), D, K, E, torch.bfloat16, W, nvshmem=False, device="cuda")
    fw = EmulatedWorld(W, max(Ts), D, K, E, torch.bfloat16, device="cuda")
    hr, fr = hw.dispatch(xs, idxs, gates), fw.dispatch(xs, idxs, gates)
    for (a, h), (b, _) in zip(hr, fr):
        n = int(h.offsets_e[-1])
        assert torch.equal(a[:n], b[:n])
    ys = [a * 3 for a, _ in hr]
    outs = hw.combine(ys, [h for _, h in hr])
    fouts = fw.combine([y.clone() for y in ys], [h for _, h in fr])
    assert all(torch.equal(a, b) for a, b in zip(outs, fouts))
    hw.check()
