"""Training reaches the hierarchical exchange (T0, CPU, no kernels): ``parallel.ranks_per_node``
places the symmetric exchange's ranks on the mesh's nodes (not only torchrun's ``LOCAL_WORLD_SIZE``),
and ``parallel.dispatcher = "auto"`` picks the symmetric exchange for an EP group that spans nodes
where NVSHMEM runs, all-to-all on CPU / gloo and where it does not (the choice with fakes: no GPU,
no process group)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tlx_dist import comm
from tlx_dist.comm import SymmDispatcher, Topology
from tlx_dist.comm.symm import api, buffers
from tlx_dist.comm.topology import exchange_ranks_per_node
from train.config import UsageError, load_config
from train.mesh import ranks_per_node
from train.parallelize import make_train_dispatcher

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "debug_cpu.toml"
CUDA = SimpleNamespace(type="cuda")  # (nothing below touches a device: buffers come at the first op)


def _pd(ep, R, dp_rank=0):
    """A fake ParallelDims: ``ep`` ranks an EP group, ``R`` ranks a node (the mesh's placement)."""
    return SimpleNamespace(ep=ep, ranks_per_node=R, dp_rank=dp_rank, ep_group=None)


def test_ranks_per_node_places_the_group_without_the_environment():
    """An explicit placement wins over LOCAL_WORLD_SIZE / GROUP_RANK (a recipe posing 4 ranks of one
    machine as 2 nodes x 2 under torchrun's one-node environment)."""
    env = {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}
    t = Topology.from_ranks(range(4), 3, env, ranks_per_node=2)
    assert t.nodes == (0, 0, 1, 1) and not t.single_node
    assert exchange_ranks_per_node("auto", t.nodes) == 2
    assert Topology.from_ranks(range(4), 3, env).single_node  # (without it: torchrun's one node)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="ranks_per_node="):
            Topology.from_ranks(range(4), 0, env, ranks_per_node=bad)


def test_symm_buffers_take_the_placement(monkeypatch):
    """SymmBuffers reads the group's nodes with the given placement (the NVSHMEM peers and the
    hierarchy's nodes follow from them); stopped right after, before any symmetric allocation."""
    group = object()
    seen = []

    class Placed(Exception):
        pass

    def from_group(g, rpn=None):
        seen.append((g, rpn))
        raise Placed

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: 1)
    monkeypatch.setattr(buffers.Topology, "from_group", staticmethod(from_group))
    with pytest.raises(Placed):
        buffers.SymmBuffers(8, 16, 2, 8, torch.bfloat16, group, device="cpu", ranks_per_node=2)
    assert seen == [(group, 2)]


def test_dispatcher_hands_the_placement_to_its_buffers(monkeypatch):
    """SymmDispatcher(ranks_per_node=) -> ep_buffers -> SymmBuffers; another placement is another
    buffer set; bad values raise naming the argument."""
    built = []

    class Recorder:
        closed = False

        def __init__(self, *a, **kw):
            built.append(kw["ranks_per_node"])

    monkeypatch.setattr(api, "SymmBuffers", Recorder)
    monkeypatch.setattr(api, "_EP_BUFFERS", {})
    sd = SymmDispatcher(8, max_tokens=4, ranks_per_node=2)
    assert sd.ranks_per_node == 2
    sd._buffers_for(torch.zeros(4, 16), 2)
    assert built == [2]
    api.ep_buffers(None, 4, 16, 2, 8, torch.float32, device="cpu", ranks_per_node=2)
    assert built == [2], "the same placement reuses the set"
    api.ep_buffers(None, 4, 16, 2, 8, torch.float32, device="cpu", ranks_per_node=4)
    assert built == [2, 4], "another placement is another set"
    for bad in (0, True, "2"):
        with pytest.raises(ValueError, match="ranks_per_node="):
            SymmDispatcher(8, ranks_per_node=bad)


def test_recipe_ranks_per_node_reaches_the_exchange():
    """``parallel.ranks_per_node`` (over torchrun's LOCAL_WORLD_SIZE) is the mesh's R and the
    training dispatcher's placement."""
    cfg = load_config(RECIPE, ["parallel.ep=4", "parallel.ranks_per_node=2", "parallel.dispatcher=symm"])
    R = ranks_per_node(cfg, 4, 3, env={"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "LOCAL_RANK": "3"})
    assert R == 2
    d = make_train_dispatcher(cfg, _pd(4, R), CUDA)
    assert isinstance(d, SymmDispatcher) and d.ranks_per_node == 2
    cfg = load_config(RECIPE, ["parallel.ep=4", "parallel.dispatcher=symm"])
    assert make_train_dispatcher(cfg, _pd(4, 4), CUDA).ranks_per_node == 4  # (LOCAL_WORLD_SIZE's R)
    cfg = load_config(RECIPE, ["parallel.dispatcher=symm"])
    assert make_train_dispatcher(cfg, _pd(1, 4), CUDA).ranks_per_node is None  # one rank: no placement


@pytest.mark.parametrize("ep,R,dp_rank,device,nvshmem,want", [
    (4, 4, 0, "cuda", False, "symm"),      # inside one node: peer pointers, NVSHMEM not needed
    (4, 8, 1, "cuda", False, "symm"),      # the second EP group of an 8-rank node
    (4, 2, 0, "cuda", True, "symm"),       # spans 2 nodes x 2, NVSHMEM runs: the hierarchical exchange
    (4, 2, 0, "cuda", False, "auto"),      # spans nodes, no NVSHMEM: all-to-all
    (8, 4, 0, "cpu", True, "auto"),        # CPU / gloo: all-to-all whatever the placement
    (4, 4, 0, "cpu", True, "auto"),
    (2, 4, 1, "cuda", False, "symm"),      # ranks 2, 3 of a 4-rank node
    (4, 6, 1, "cuda", True, "symm"),       # ranks 4..7 straddle nodes of 6: spans nodes
    (4, 6, 1, "cuda", False, "auto"),
])
def test_auto_dispatcher_choice(monkeypatch, ep, R, dp_rank, device, nvshmem, want):
    asked = []

    def fake_nvshmem(dev):
        asked.append(dev)
        return nvshmem

    monkeypatch.setattr(comm, "nvshmem_supported", fake_nvshmem)
    cfg = load_config(RECIPE, [f"parallel.ep={ep}"])
    dev = CUDA if device == "cuda" else torch.device("cpu")
    d = make_train_dispatcher(cfg, _pd(ep, R, dp_rank), dev)
    if want == "symm":
        assert isinstance(d, SymmDispatcher) and d.ranks_per_node == R
    else:
        assert d == "auto"
    first = dp_rank * ep
    spans = first // R != (first + ep - 1) // R
    assert bool(asked) == (device == "cuda" and spans), "NVSHMEM is asked about only for a group across nodes"


def test_fused_pipeline_across_nodes_without_nvshmem_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(comm, "nvshmem_supported", lambda dev: False)
    cfg = load_config(RECIPE, ["parallel.ep=4", "parallel.moe_pipeline=fused"])
    with pytest.raises(UsageError, match=r"parallel.moe_pipeline='fused' at ep=4 .* NVSHMEM across nodes"):
        make_train_dispatcher(cfg, _pd(4, 2), CUDA)
    monkeypatch.setattr(comm, "nvshmem_supported", lambda dev: True)
    assert isinstance(make_train_dispatcher(cfg, _pd(4, 2), CUDA), SymmDispatcher)


def test_nvshmem_supported_is_false_off_cuda():
    assert comm.nvshmem_supported("cpu") is False
    assert comm.nvshmem_supported(torch.device("meta")) is False


@pytest.mark.parametrize("ep,R,topology,regions,ok", [
    (4, 2, "auto", False, True),            # 2 nodes x 2: the hierarchical overlap, no regions needed
    (4, 2, "hierarchical", False, True),
    (8, 4, "auto", False, True),            # 2 x 4
    (4, 4, "auto", False, False),           # one node: the flat overlap needs regions ...
    (4, 4, "auto", True, True),             # ... given
    (4, 1, "auto", False, False),           # one rank a node: "auto" runs the flat exchange
    (4, 2, "flat", True, True),
    (4, 2, "flat", False, False),           # flat across nodes: regions, named at load
])
def test_overlap_across_nodes_reaches_the_hierarchical_exchange(monkeypatch, ep, R, topology, regions, ok):
    """``parallel.exchange.overlap = true`` with a static capacity: across nodes the dispatcher the
    layers get has the overlap on and needs no receive regions (the hierarchical exchange's
    overlap computes the node's rows first); where the exchange is flat, regions are required --
    by name, at load for topology 'flat', when the exchange is built for 'auto'."""
    monkeypatch.setattr(comm, "nvshmem_supported", lambda dev: True)
    over = [f"parallel.ep={ep}", f"parallel.ranks_per_node={R}", "parallel.exchange.overlap=true",
            "parallel.capacity_factor=2.0", f"parallel.exchange.topology='{topology}'",
            f"parallel.ep_row_regions={'true' if regions else 'false'}", "parallel.moe_pipeline=fused"]
    if topology == "flat" and not regions:
        with pytest.raises(ValueError, match="parallel.ep_row_regions = true"):
            load_config(RECIPE, over)
        return
    cfg = load_config(RECIPE, over)
    if not ok:
        with pytest.raises(UsageError, match="parallel.ep_row_regions = true"):
            make_train_dispatcher(cfg, _pd(ep, R), CUDA)
        return
    d = make_train_dispatcher(cfg, _pd(ep, R), CUDA)
    assert isinstance(d, SymmDispatcher) and d.overlap and d.capacity == 2.0 and d.ranks_per_node == R
