"""The NVSHMEM route on real GPUs (tier T5): two or more GPUs of one host, each rank posing as a node
of its own (this module sets ``LOCAL_WORLD_SIZE=1`` before building buffers), so every peer pointer
but a rank's own is 0 and every row between ranks goes through the ``USE_NVSHMEM`` kernels:
staging, block puts, one-thread signals, NVSHMEM module init of exactly those kernels. NVSHMEM
itself then moves the bytes over NVLink (P2P), so this checks the kernels, not an inter-node
network. A torchrun of its own: torch symmetric memory's backend is fixed per process by its first
allocation, and tests/test_symm_multigpu.py allocates with the CUDA backend.

    torchrun --nproc-per-node=2 -m pytest -m multigpu tests/test_symm_nvshmem_multigpu.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

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
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per "node": the EP group spans nodes
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


def test_buffers_take_the_nvshmem_route(group):
    import torch.distributed as dist

    from tlx_dist.comm import SymmBuffers

    W, r = dist.get_world_size(), dist.get_rank()
    bufs = SymmBuffers(64, 256, 2, 2 * W, torch.bfloat16, group)
    assert bufs.backend == "nvshmem" and bufs.use_nvshmem and bufs.layout.staging
    assert [p == 0 for p in bufs.peers.tolist()] == [d != r for d in range(W)]
    assert bufs.pes.tolist() == list(range(W))
    bufs.close()


def test_counters_after_an_op(group):
    """Counters after a dispatch (and a barrier, so every rank's op has ended): the op's last kernel
    moved each rank to epoch 2 and raised its readiness on every peer (FLAGS = 2 from every rank),
    and consumed and zeroed every arrival counter (token rows, partial rows, gate-gradient rows).
    Exact counts inside an op are tests/symm_nvshmem_interpreted_cases.py's (the interpreter can
    stop between kernels); here the signals travel by NVSHMEM on real GPUs."""
    import torch.distributed as dist

    from tlx_dist.comm import SymmBuffers, SymmDispatcher

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T = 4 * W, 2, 512, 100
    bufs = SymmBuffers(T, D, K, E, torch.bfloat16, group, timeout_s=20.0)
    try:
        L = bufs.layout
        flags = bufs._region(L.off_flags, 8 * W).view(torch.int64).tolist()
        assert flags == [1] * W and int(bufs.state()[0]) == 1, (flags, bufs.state().tolist())
        g = torch.Generator(device="cuda").manual_seed(r)
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        sd = SymmDispatcher(E, group, buffers=bufs, capacity="worst")
        sd.dispatch(x, idx)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        flags = bufs._region(L.off_flags, 8 * W).view(torch.int64).tolist()
        arrive = bufs._region(L.off_arrive, 24 * W).view(torch.int64).tolist()
        assert flags == [2] * W, flags
        assert arrive == [0] * (3 * W), arrive
        assert int(bufs.state()[0]) == 2, bufs.state().tolist()
        sd.check()
    finally:
        dist.barrier()
        bufs.close()


@pytest.mark.parametrize("kind", ["random", "heavy_imbalance", "zero_token_experts"])
def test_nvshmem_route_matches_all_to_all(group, kind):
    """The peer-pointer multi-GPU test's comparison with NCCL all-to-all (rows, offsets, combine,
    gradients of x and gates), on buffers that now take the NVSHMEM route."""
    from test_symm_multigpu import test_symm_matches_all_to_all

    test_symm_matches_all_to_all(group, kind)


def test_moe_layer_over_nvshmem_matches_all_to_all(group):
    from test_symm_multigpu import test_moe_layer_symm_vs_all_to_all

    test_moe_layer_symm_vs_all_to_all(group)


@pytest.mark.parametrize("regions", [0, 2])
def test_moe_layer_fused_ep_over_nvshmem_matches_all_to_all(group, regions):
    """The fused EP layer (what ``pipeline="auto"`` takes under EP with the symmetric exchange) over
    the NVSHMEM route: staged partial rows and gate gradients. ``regions=2``: receive regions asked
    for, which this route does not reserve (it copies as before)."""
    from test_symm_multigpu import test_moe_layer_fused_ep_vs_all_to_all

    test_moe_layer_fused_ep_vs_all_to_all(group, regions)


def test_rank_that_skips_an_op_is_an_error_not_a_hang(group):
    """Real ranks (NVSHMEM): after one matched dispatch, rank 1 skips the next. Rank 0's waits give
    up after timeout_s (1 s) instead of hanging, its dispatch returns, and check() names the op,
    the waiting rank and the missing peer. (Buffers of their own: the timeout is part of
    ep_buffers' key. The matched op comes first so that every rank has compiled and
    NVSHMEM-initialised the kernels of this timeout before rank 0 is left alone: a first compile
    of the NVSHMEM variants takes tens of seconds, more than the skipping rank would wait.)"""
    import time

    import torch.distributed as dist

    from tlx_dist.comm import SymmDispatcher
    from tlx_dist.comm.symm.buffers import ExchangeError

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T = 4 * W, 2, 256, 32
    sd = SymmDispatcher(E, group, max_tokens=T, capacity=2.0, timeout_s=1.0, validate=False)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    gate = torch.rand(T, K, device="cuda")
    bufs = sd._buffers_for(x, K)  # collective: every rank builds the buffers
    sd.dispatch(x, idx, gate)  # a matched op first: every rank compiles (and NVSHMEM-initialises) the kernels
    torch.cuda.synchronize()
    sd.check()
    dist.barrier()
    if r == 0:
        t0 = time.monotonic()
        sd.dispatch(x, idx, gate)
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        with pytest.raises(ExchangeError, match=r"rank 0 waited 1 s for the .* from rank 1"):
            sd.check()
        assert waited < 30, f"the dispatch returned after {waited:.1f} s"
    dist.barrier()
    bufs.close()
