"""Real multi-GPU symmetric dispatch (tier T5): SymmDispatcher vs AllToAllDispatcher (NCCL) on W >= 2
GPUs, and MoELayer forward/backward with both. Launch with torchrun, one process per GPU:

    torchrun --nproc-per-node=2 -m pytest -m multigpu tests/test_symm_multigpu.py -q

Not run yet: only single-GPU machines have been lent (see the report in bench/RESULTS.md).
Across nodes (``--nnodes=2``) the same test exercises the NVSHMEM backend (``backend="auto"``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tlx_dist.testing import assert_close_ksum_bf16

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="needs torchrun with WORLD_SIZE >= 2"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]



@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["random", "heavy_imbalance", "zero_token_experts"])
def test_symm_matches_all_to_all(group, kind):
    import torch.distributed as dist

    from tlx_dist.comm import AllToAllDispatcher, SymmBuffers, SymmDispatcher

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T_max = 8 * W, 4, 2048, 256
    T = T_max - 17 * r  # unequal token counts per rank
    g = torch.Generator(device="cuda").manual_seed(r)
    if kind == "random":
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    elif kind == "heavy_imbalance":  # everything to rank 0
        idx = torch.rand(T, E // W, device="cuda", generator=g).topk(K, dim=1).indices
    else:
        idx = torch.rand(T, E // 2, device="cuda", generator=g).topk(K, dim=1).indices * 2
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bufs = SymmBuffers(T_max, D, K, E, torch.bfloat16, group)
    sd, ad = SymmDispatcher(E, group, buffers=bufs), AllToAllDispatcher(E, group)
    xs, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    rs, hs = sd.dispatch(xs, idx)
    ra, ha = ad.dispatch(xa, idx)
    n = ra.shape[0]
    assert torch.equal(rs[:n], ra) and not rs[n:].any()
    assert torch.equal(hs.offsets_e, ha.offsets_e)
    scale = torch.tensor(1.0 + r, device="cuda", dtype=torch.bfloat16)
    ys, ya = sd.combine(rs * scale, hs), ad.combine(ra * scale, ha)
    assert torch.equal(ys, ya)
    gy = torch.randn(ys.shape, device="cuda", generator=g).to(torch.bfloat16)
    (ys.float() * gy.float()).sum().backward()
    (ya.float() * gy.float()).sum().backward()
    owner_scale = (1 + idx // (E // W)).to(torch.bfloat16)[..., None]
    assert torch.equal(xs.grad, (gy * owner_scale).sum(1))  # one rounding of the fp32 k-sum
    assert_close_ksum_bf16(xa.grad, xs.grad)
    sd.check()
    bufs.close()


def test_moe_layer_symm_vs_all_to_all(group):
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer

    W = dist.get_world_size()
    cfg = MoEConfig(dim=1024, moe_inter_dim=512, num_experts=8 * W, top_k=4, dtype="bfloat16")
    torch.manual_seed(0)  # same seed on every rank: replicated router, expert e identical whatever W
    a = MoELayer(cfg, group, dispatcher="all_to_all", device="cuda")
    b = MoELayer(cfg, group, dispatcher="symm", device="cuda")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 128, 1024, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(dist.get_rank()))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oa, ob = a(xa), b(xb)
    assert torch.equal(oa, ob)
    oa.float().square().sum().backward()
    ob.float().square().sum().backward()
    assert_close_ksum_bf16(xa.grad, xb.grad)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), name
