"""The multi-node layouts on real GPUs over NCCL (tier T5): each GPU poses as a node
(``parallel.ranks_per_node=1``), so hybrid sharding runs FSDP2's HSDP with its all-reduce across
"nodes", with EP inside and across them, at ``train.grad_accum`` 1 and 2. Launch with torchrun,
one process per GPU:

    torchrun --nproc-per-node=2 -m pytest -m multigpu tests/test_train_multigpu.py -q

Same check as the gloo tier (tests/test_train_layouts.py): one step's gradients, gathered to global
tensors, against the single-process fp32 / fp64 model on the CPU, within twice the fp32 model's
own error (fp32 training on the GPUs: no bf16 rounding to allow for). And ``parallel.reduce_dtype =
"bfloat16"`` over NCCL (tests/test_train_reduce_dtype.py's bound against the fp32-reduced step; at
``grad_accum=2`` the HSDP partial sums are cast to fp32 on FSDP2's reduce-scatter stream).
"""

from __future__ import annotations

import os

import pytest
import torch

from _train import (GLOBAL_BATCH, assert_bf16_reduction_bound, assert_grads_match, reference_grads,
                    sequence_grad_magnitudes, step_grads)

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="needs torchrun with WORLD_SIZE >= 2"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
]

LAYOUTS = {
    "hybrid_ep1": ["parallel.sharding=hybrid", "parallel.ep=1"],   # experts HSDP (nodes, 1)
    "hybrid_ep2": ["parallel.sharding=hybrid", "parallel.ep=2"],   # EP across "nodes" (all-to-all), dp = 1
    "full_ep2": ["parallel.ep=2"],
}


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference():
    return reference_grads(GLOBAL_BATCH)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("accum", [1, 2])
def test_layout_grads_on_gpus(group, reference, layout, accum):
    import torch.distributed as dist

    W = dist.get_world_size()
    if GLOBAL_BATCH % (W * accum):
        pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split over {W} ranks x {accum}")
    res = step_grads(LAYOUTS[layout] + ["parallel.ranks_per_node=1"], W, accum, "cuda")
    assert res["samples"] == GLOBAL_BATCH
    assert_grads_match(res, reference, f"{layout} grad_accum={accum} on {W} GPUs")


@pytest.mark.parametrize("layout", ["hybrid_ep1", "full_ep2"])
@pytest.mark.parametrize("accum", [1, 2])
def test_bf16_reduction_on_gpus(group, layout, accum):
    import torch.distributed as dist

    W = dist.get_world_size()
    if GLOBAL_BATCH % (W * accum):
        pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split over {W} ranks x {accum}")
    base = LAYOUTS[layout] + ["parallel.ranks_per_node=1"]
    ref = step_grads(base, W, accum, "cuda")
    got = step_grads(base + ["parallel.reduce_dtype=bfloat16"], W, accum, "cuda")
    assert_bf16_reduction_bound(got["grads"], ref["grads"], sequence_grad_magnitudes(), W * accum,
                                f"{layout} grad_accum={accum} on {W} GPUs")
