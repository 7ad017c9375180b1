"""Multi-node layouts on gloo (tier T1): 4 processes posing as 2 nodes x 2 (``parallel.ranks_per_node=2``).

For each layout -- hybrid sharding with EP filling a node, with EP=1 (experts sharded inside a node),
with EP spanning both nodes, and full sharding -- one training step's gradients, gathered to full
tensors (experts over ep and dp), are compared with a single-process model run on the same global
batch of 8 sequences: at ``train.grad_accum=1`` (2 sequences a rank) and at ``grad_accum=2`` (two
micro-batches of 1), so the accumulation is checked against one big batch too. And the meshes the
gradients live on are asserted: experts on their expert-data-parallel group (the ranks holding the
same experts), dense parameters on the (node, rank-in-node) mesh.

Tolerance (STYLE 6): ``max|ours - ref64| <= 2 * max|ref32 - ref64| + atol`` per parameter, ref64 the
single-process model in float64, ref32 the same in float32: a distributed step sums the same fp32
terms in another order (per-rank partial gradients added by reduce-scatter / all-reduce, losses
scaled by 1/grad_accum), an error of the size of the single-process fp32 error itself. atol =
2^-20 of the tensor's largest gradient covers tensors whose fp32 reference happens to be nearly
exact. A gradient reduced over the wrong group (an expert averaged with another expert's, a missing
1/ep, a micro-batch counted twice) is off by O(1) of its size.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_world
from _train import DEBUG, GLOBAL_BATCH, assert_grads_match, reference_grads, step_grads

WORLD = 4
NODES = ["parallel.ranks_per_node=2"]

# id: (overrides, expected mesh of the expert gradients, of the dense gradients; rank lists per
# mesh dimension as DeviceMesh.mesh.tolist() on rank 0, None = not a DTensor)
LAYOUTS = {
    # EP=2 fills a node: each expert lives on one rank per node -- no sharding inside the node,
    # replicated across nodes (HSDP with a shard dimension of 1); dense parameters HSDP 2 x 2.
    "hybrid_ep2": (["parallel.sharding=hybrid", "parallel.ep=2"], [[0], [2]], [[0, 1], [2, 3]]),
    # EP=1: every rank holds every expert; sharded over the node's 2 ranks, replicated across nodes.
    "hybrid_ep1": (["parallel.sharding=hybrid", "parallel.ep=1"], [[0, 1], [2, 3]], [[0, 1], [2, 3]]),
    # EP=4 spans both nodes: one copy of each expert, nothing to reduce (dp = 1: outside FSDP2).
    "hybrid_ep4": (["parallel.sharding=hybrid", "parallel.ep=4"], None, [[0, 1], [2, 3]]),
    # Full sharding (the default): experts over the dp ranks of their ep index, dense over all 4.
    "full_ep2": (["parallel.ep=2"], [0, 2], [0, 1, 2, 3]),
}


def _layout_grads(rank, world, overrides):
    return {accum: step_grads(NODES + overrides, world, accum, "cpu") for accum in (1, 2)}


@pytest.fixture(scope="module")
def reference():
    return reference_grads(GLOBAL_BATCH)


# EP across nodes and full sharding on 2 "nodes" run with -m release (the latter is also covered by
# the torchrun loopback test of tests/test_train_dist.py).
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.release) if k in ("hybrid_ep4", "full_ep2")
                                    else k for k in LAYOUTS])
def test_layout_grads_equal_single_process(layout, reference):
    overrides, expert_mesh, dense_mesh = LAYOUTS[layout]
    res = run_world(_layout_grads, WORLD, overrides, start_method="forkserver")
    for accum in (1, 2):
        r0 = res[0][accum]
        assert r0["samples"] == GLOBAL_BATCH, "a step must consume the global batch, whatever grad_accum"
        assert_grads_match(r0, reference, f"{layout} grad_accum={accum}")
        # every rank holds the same global gradient (a rank-dependent reduction would not)
        for r in res[1:]:
            assert all(torch.equal(r[accum]["grads"][n], g) for n, g in r0["grads"].items())
    # Where the gradients live: experts on the ranks that hold the same experts, nothing wider.
    meshes = res[0][1]["meshes"]
    assert meshes["layers.1.ffn.w13"] == expert_mesh and meshes["layers.1.ffn.router.weight"] == expert_mesh
    assert meshes["layers.0.attn.wqkv.weight"] == dense_mesh and meshes["embed.weight"] == dense_mesh
    for rank, r in enumerate(res):
        ep = len(r[1]["ep_group"])
        assert r[1]["ep_group"] == list(range(rank // ep * ep, rank // ep * ep + ep))  # consecutive ranks
        m = r[1]["meshes"]["layers.1.ffn.w13"]
        if m is not None:   # the expert-data-parallel group: every rank of this rank's ep index
            flat = sorted(sum(m, []) if isinstance(m[0], list) else m)
            assert flat == [q for q in range(WORLD) if q % ep == rank % ep], (rank, m)


def test_layout_errors_name_the_field():
    """Layouts the mesh cannot build are usage errors naming the field, before any collective."""
    from train.config import UsageError, load_config
    from train.mesh import _expert_shards, ranks_per_node

    cfg = load_config(DEBUG, ["parallel.ranks_per_node=3"])
    with pytest.raises(UsageError, match=r"parallel.ranks_per_node=3: 3 ranks per node does not divide the world "
                                         r"size 4"):
        ranks_per_node(cfg, 4, 0)
    with pytest.raises(UsageError, match="nodes must hold consecutive ranks"):
        ranks_per_node(load_config(DEBUG), 4, 1, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0"})
    assert ranks_per_node(load_config(DEBUG), 4, 2, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                                                         "LOCAL_RANK": "0"}) == 2
    assert ranks_per_node(load_config(DEBUG), 4, 2, env={}) == 4   # no torchrun: one node
    with pytest.raises(UsageError, match="parallel.ep=3 to divide the 4 ranks of a node"):
        _expert_shards(cfg, 4, 3)
    with pytest.raises(UsageError, match="parallel.ep=6 spans nodes, so it must be a multiple of the 4 ranks"):
        _expert_shards(cfg, 4, 6)
    assert _expert_shards(cfg, 8, 2) == 4 and _expert_shards(cfg, 8, 16) == 1
    for bad, msg in ((["parallel.sharding=hsdp"], "parallel.sharding='hsdp' must be one of 'full', 'hybrid'"),
                     (["parallel.ranks_per_node=-1"], "parallel.ranks_per_node=-1 must be non-negative"),
                     (["train.grad_accum=0"], "train.grad_accum=0 must be positive")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            load_config(DEBUG, bad)


def test_one_rank_grad_accum_matches_one_big_batch(reference):
    """One process, nothing FSDP-wrapped (gradients accumulate in the parameters' .grad): 4
    micro-batches of 2 sequences give the gradients of the 8 at once."""
    from _train import one_rank_group
    with one_rank_group():
        res = step_grads([], 1, 4, "cpu")
    assert res["samples"] == GLOBAL_BATCH and all(m is None for m in res["meshes"].values())
    assert_grads_match(res, reference, "one rank, grad_accum=4")
