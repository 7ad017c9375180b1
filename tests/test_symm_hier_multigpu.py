"""The hierarchical exchange on real GPUs (tier T5): the GPUs of one host posing as two nodes (this
module sets ``LOCAL_WORLD_SIZE`` to half the world before building buffers), so the inter-node leg
runs the ``USE_NVSHMEM`` kernels of tlx/comm/hier.py -- staged puts, one-thread signals, NVSHMEM
module init -- and, with four GPUs, the relays forward over peer pointers inside each "node".
NVSHMEM moves the bytes over NVLink (P2P): this checks the kernels and the protocol, not a NIC. A
torchrun of its own (torch symmetric memory's backend is fixed per process by its first allocation):

    torchrun --nproc-per-node=2 -m pytest -m multigpu tests/test_symm_hier_multigpu.py -q
    torchrun --nproc-per-node=4 -m pytest -m multigpu tests/test_symm_hier_multigpu.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2 or int(os.environ.get("WORLD_SIZE", "1")) % 2,
                       reason="needs torchrun with an even WORLD_SIZE >= 2"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    os.environ["LOCAL_WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) // 2)  # two "nodes"
    os.environ.pop("GROUP_RANK", None)  # (torchrun's, for one real node: the posing replaces it)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


def _inputs(W, T, K, E, D, dtype):
    """Every rank's inputs, the same on every rank (seeded on the CPU): the reference needs them all."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T - 7 * s, D, generator=g).to(dtype) for s in range(W)]
    idxs = [torch.rand(x.shape[0], E, generator=g).topk(K, dim=1).indices for x in xs]
    gates = [torch.rand(x.shape[0], K, generator=g).to(dtype) for x in xs]
    douts = [torch.randn(x.shape[0], D, generator=g).to(dtype) for x in xs]
    return xs, idxs, gates, douts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hierarchical_layer_matches_the_reference(group, dtype):
    """dispatch -> "experts" (rank d scales its rows by 1 + d) -> combine, forward and backward
    through SymmDispatcher's autograd, against the flat oracle (rows), the hierarchical reference
    (sums, bf16 exactly: the GPU rounds as torch does) and the per-token formulas (gradients); the
    per-leg counters exactly."""
    import torch.distributed as dist

    from tlx_dist.comm.emulated import reference_dispatch
    from tlx_dist.comm.hier_reference import hier_combine_reference, hier_dispatch_reference
    from tlx_dist.comm.symm import ExchangeConfig, SymmDispatcher, leg_counters_dict

    W, r = dist.get_world_size(), dist.get_rank()
    L = W // 2
    E, K, D, T = 4 * W, 4, 512, 96
    xs, idxs, gates, douts = _inputs(W, T, K, E, D, dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    sd = SymmDispatcher(E, group, max_tokens=T, capacity="worst", config=ExchangeConfig(topology="hierarchical",
                                                                                          timeout_s=20.0))
    x = xs[r].to(dev).requires_grad_(True)
    gate = gates[r].to(dev).requires_grad_(True)
    recv, h = sd.dispatch(x, idxs[r].to(dev), gate)
    assert sd.topology == "hierarchical" and sd.buffers.backend == "nvshmem"
    assert sd.buffers.hier.layout.ranks_per_node == L
    out = sd.combine_weighted(recv * (1 + r), h, gate)
    (out * douts[r].to(dev)).sum().backward()
    torch.cuda.synchronize()
    sd.check()

    flat = reference_dispatch(xs, idxs, E)
    n = flat[r][0].shape[0]
    assert torch.equal(recv[:n].detach().cpu(), flat[r][0])
    ys = [rows * (1 + d) for d, (rows, _) in enumerate(flat)]
    ref_out, comb_counts = hier_combine_reference(ys, idxs, gates, E, L)
    got = out.detach().cpu()
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref_out[r])
    else:  # the GPU contracts a gated product and its add into one FMA: an fp32 ulp of the terms a rounding
        mag, _ = hier_combine_reference([y.double().abs() for y in ys], idxs, [g.double().abs() for g in gates], E, L)
        assert ((got.double() - ref_out[r].double()).abs() <= 4 * 2.0 ** -23 * mag[r]).all()
    # dx: combine's backward gives g_y = gate * dout at each slot's row (rounded to the dtype), the
    # "experts" scale it by 1 + d (rounded), dispatch's backward sums it node-first (adds only: exact)
    acc = torch.float32
    g_rows = reference_dispatch([(gates[s].to(acc)[..., None] * douts[s].to(acc)[:, None, :]).to(dtype).reshape(-1, D)
                                 for s in range(W)], [i.reshape(-1, 1) for i in idxs], E)
    ref_dx, _ = hier_combine_reference([rows * (1 + d) for d, (rows, _) in enumerate(g_rows)], idxs, None, E, L)
    assert torch.equal(x.grad.cpu(), ref_dx[r])
    # dgate[t, k] = <dout[t], y[t, k]>: an fp32 dot of D products (its error at most D * 2**-24 of the sum of
    # |products|), returned in the gates' dtype (one rounding of it)
    e = E // W
    y_slot = (xs[r][:, None, :] * (1 + idxs[r] // e)[..., None].to(dtype)).double()
    prod = douts[r].double()[:, None, :] * y_slot
    exact, bound = prod.sum(-1), D * 2.0 ** -24 * prod.abs().sum(-1)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    assert ((gate.grad.double().cpu() - exact).abs() <= bound + ulp * exact.abs() * 1.01).all()

    disp = hier_dispatch_reference(xs, idxs, E, L).counts
    c = leg_counters_dict(sd.leg_counters())
    two = 2  # each direction ran twice: dispatch + combine's backward, combine + dispatch's backward
    want = {}
    for leg, counts in (("dispatch", disp), ("combine", comb_counts)):
        for path, rows in (("nic", counts.nic_rows_W), ("nvl", counts.nvl_rows_W)):
            want[f"{leg}_{path}_rows"] = two * int(rows[r])
            want[f"{leg}_{path}_bytes"] = two * int(rows[r]) * counts.row_bytes
    assert c == want, (c, want)
    sd.reset_leg_counters()
    dist.barrier()
