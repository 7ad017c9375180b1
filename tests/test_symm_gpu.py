"""Symmetric dispatch/combine on the GPU (tiers T3/T4): the compiled tlx/comm kernels in an emulated
world of W = 1, 2, 4, 8 virtual ranks on one GPU, torch symmetric memory at world size 1, CUDA-graph
capture and replay, and MoELayer with the symm dispatcher. Run: ``pytest -m gpu tests/test_symm_gpu.py``.

Comparisons are exact: the ops move bits, and the k-sums are the same torch reductions as the oracle.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 is set (a CPU interpreter test module sets it at collection): "
                              "run this file on its own"),
]

from tlx_dist.comm import LocalDispatcher, SymmBuffers, SymmDispatcher  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch  # noqa: E402
from tlx_dist.testing import assert_close_ksum_bf16  # noqa: E402

DEV = "cuda"



def _idx(g, T, K, E, W, kind):
    if kind == "random":
        return torch.rand(T, E, generator=g, device=DEV).topk(K, dim=1).indices
    if kind == "zero_token_experts":  # only even experts used
        return torch.rand(T, E // 2, generator=g, device=DEV).topk(K, dim=1).indices * 2
    if kind == "heavy_imbalance":  # every slot to rank 0's experts
        return torch.rand(T, E // W, generator=g, device=DEV).topk(K, dim=1).indices
    if kind == "one_expert":  # first choice always the last expert
        rest = torch.rand(T, E - 1, generator=g, device=DEV).topk(K - 1, dim=1).indices
        return torch.cat([torch.full((T, 1), E - 1, device=DEV, dtype=torch.long), rest], 1)
    raise ValueError(kind)


def _check_world(W, E, K, D, Ts, kind, dtype=torch.bfloat16, capacity=None):
    g = torch.Generator(device=DEV).manual_seed(W * 100 + D)
    world = EmulatedWorld(W, max(Ts), D, K, E, dtype, capacity=capacity, device=DEV)
    xs = [torch.randn(T, D, device=DEV, generator=g).to(dtype) for T in Ts]
    idxs = [_idx(g, T, K, E, W, kind) for T in Ts]
    res = world.dispatch(xs, idxs)
    ref = reference_dispatch(xs, idxs, E)
    e = E // W
    for d, (recv, h) in enumerate(res):
        rows, cnt = ref[d]
        n = rows.shape[0]
        assert h.offsets_e.tolist() == cnt.cumsum(0).tolist(), f"W={W} {kind}: rank {d} offsets"
        assert torch.equal(recv[:n], rows), f"W={W} {kind}: rank {d} rows"
        assert not recv[n:].any(), f"W={W} {kind}: rank {d} padding not zero"
    scale = [torch.tensor(1.0 + d, dtype=dtype, device=DEV) for d in range(W)]
    ys = world.combine([r * scale[d] for d, (r, _) in enumerate(res)], [h for _, h in res])
    for s, (x, idx) in enumerate(zip(xs, idxs)):
        owner = idx // e
        expect = x[:, None, :] * (1 + owner[..., None]).to(dtype)
        assert torch.equal(ys[s], expect), f"W={W} {kind}: combine on rank {s}"
    gs = [torch.randn(x.shape[0], K, D, device=DEV, generator=g).to(dtype) for x in xs]
    g_ND = world.dispatch_grad(gs, [h for _, h in res])
    g_ref = reference_dispatch([q.reshape(-1, D) for q in gs], [i.reshape(-1, 1) for i in idxs], E)
    for d in range(W):
        n = g_ref[d][0].shape[0]
        assert torch.equal(g_ND[d][:n], g_ref[d][0]) and not g_ND[d][n:].any()
    g_TD = world.combine_grad([q * scale[d] for d, q in enumerate(g_ND)], [h for _, h in res])
    for s, idx in enumerate(idxs):
        owner = idx // e
        assert torch.equal(g_TD[s], (gs[s] * (1 + owner[..., None]).to(dtype)).sum(1))
    world.check()
    return world


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "zero_token_experts", "heavy_imbalance", "one_expert"])
def test_emulated_world(W, kind):
    """E = 256, K = 8, D = 7168 bf16 (DeepSeek-V3 rows); T differs per rank (1 .. 300 tokens):
    T = 1 is below every tile, the others are not multiples of the row block."""
    Ts = [300 - 37 * s if s else 1 for s in range(W)] if W > 1 else [300]
    _check_world(W, 256, 8, 7168, Ts, kind)


def test_emulated_odd_shapes():
    """fp16 rows of 6 bytes... (D = 3: 2-byte words), fp32 D = 2049 (4-byte words), K = 1, E = W."""
    _check_world(2, 2, 1, 3, [5, 9], "random", torch.float16)
    _check_world(4, 8, 1, 2049, [33, 1, 64, 17], "random", torch.float32)


def test_capacity_overflow_on_gpu():
    W, E, K, D, T = 4, 16, 4, 512, 64
    world = EmulatedWorld(W, T, D, K, E, torch.bfloat16, capacity=100, device=DEV)
    xs = [torch.randn(T, D, device=DEV, dtype=torch.bfloat16) for _ in range(W)]
    g = torch.Generator(device=DEV).manual_seed(0)
    idxs = [_idx(g, T, K, E, W, "heavy_imbalance") for _ in range(W)]  # W*T*K = 1024 rows to rank 0
    res = world.dispatch(xs, idxs)
    ref = reference_dispatch(xs, idxs, E)
    assert torch.equal(res[0][0], ref[0][0][:100])
    ys = world.combine([r for r, _ in res], [h for _, h in res])
    for s in range(W):
        kept = (res[s][1].row_S < 100).view(T, K, 1)
        assert torch.equal(ys[s], torch.where(kept, xs[s][:, None, :], torch.zeros((), dtype=torch.bfloat16, device=DEV)))
    with pytest.raises(RuntimeError, match="overflowed its capacity of 100"):
        world.buffers[0].check()


def test_cuda_graph_capture_and_replay():
    """Dispatch + combine of an emulated W = 4 world captured once, replayed with new tokens and new
    routing: device-side epochs and counters make every replay a fresh, correct exchange."""
    W, E, K, D, T = 4, 32, 4, 1024, 96
    world = EmulatedWorld(W, T, D, K, E, torch.bfloat16, device=DEV)
    xs = [torch.zeros(T, D, device=DEV, dtype=torch.bfloat16) for _ in range(W)]
    idxs = [torch.zeros(T, K, device=DEV, dtype=torch.long) for _ in range(W)]
    g = torch.Generator(device=DEV).manual_seed(1)

    def fill():
        for x, i in zip(xs, idxs):
            x.copy_(torch.randn(T, D, device=DEV, generator=g))
            i.copy_(_idx(g, T, K, E, W, "random"))

    def step():
        res = world.dispatch(xs, idxs)
        return res, world.combine([r * 2 for r, _ in res], [h for _, h in res])

    fill()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, ys = step()
    for _ in range(3):
        fill()
        graph.replay()
        ref = reference_dispatch(xs, idxs, E)
        for d in range(W):
            n = ref[d][0].shape[0]
            assert torch.equal(res[d][0][:n], ref[d][0]) and not res[d][0][n:].any()
            assert torch.equal(ys[d], 2 * xs[d][:, None, :].expand(T, K, D))


def test_world_size_one_torch_symmetric_memory():
    """The real backend: torch symmetric memory (CUDA) rendezvous over a one-rank NCCL group; the
    dispatcher vs LocalDispatcher, forward and backward, plus MoELayer symm vs local."""
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device(DEV, 0))
        try:
            E, K, D, T = 64, 8, 2048, 512
            bufs = SymmBuffers(T, D, K, E, torch.bfloat16, dist.group.WORLD)
            assert bufs.backend == "cuda" and bufs.capacity == T * K
            sd = SymmDispatcher(E, dist.group.WORLD, buffers=bufs, validate=False)
            x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            x2 = x.detach().clone().requires_grad_(True)
            idx = torch.rand(T, E, device=DEV).topk(K, dim=1).indices
            recv, h = sd.dispatch(x, idx)
            lrecv, lh = LocalDispatcher(E).dispatch(x2, idx)
            assert torch.equal(recv, lrecv) and torch.equal(h.offsets_e, lh.offsets_e)
            y, ly = sd.combine(recv * 3, h), LocalDispatcher(E).combine(lrecv * 3, lh)
            assert torch.equal(y, ly)
            gy = torch.randn_like(y)
            (y.float() * gy.float()).sum().backward()
            (ly.float() * gy.float()).sum().backward()
            # Dispatch backward sums the K slot gradients of a token: ours in fp32 then one rounding
            # (exactly torch's bf16 sum over k); LocalDispatcher's index_add rounds after every add.
            assert torch.equal(x.grad, (gy * 3).sum(1))
            assert_close_ksum_bf16(x2.grad, x.grad)

            cfg = MoEConfig(dim=512, moe_inter_dim=256, num_experts=16, top_k=4, dtype="bfloat16")
            torch.manual_seed(0)
            a = MoELayer(cfg, dist.group.WORLD, dispatcher="all_to_all", device=DEV)
            b = MoELayer(cfg, dist.group.WORLD, dispatcher="symm", device=DEV)
            b.load_state_dict(a.state_dict())
            xm = torch.randn(4, 64, 512, device=DEV, dtype=torch.bfloat16)
            xa, xb = xm.clone().requires_grad_(True), xm.clone().requires_grad_(True)
            oa, ob = a(xa), b(xb)
            assert torch.equal(oa, ob)
            oa.float().square().sum().backward()
            ob.float().square().sum().backward()
            assert_close_ksum_bf16(xa.grad, xb.grad)
            for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
                assert torch.equal(pa.grad, pb.grad), n
            bufs.close()
            b.dispatcher.buffers.close()
        finally:
            dist.destroy_process_group()
