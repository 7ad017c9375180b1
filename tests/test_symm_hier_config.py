"""Which exchange a buffer set runs (T0, CPU, no kernels): ``ExchangeConfig.topology`` resolved from
the group's nodes (``topology.exchange_ranks_per_node``), the hierarchical regions it adds, the
checks that keep every dispatcher of a set on the same exchange, and the leg counters' surface."""

from __future__ import annotations

import pytest
import torch

from tlx_dist.comm.emulated import EmulatedWorld
from tlx_dist.comm.symm import LEG_COUNTERS, ExchangeConfig, SymmBuffers, SymmDispatcher
from tlx_dist.comm.topology import Topology, exchange_ranks_per_node


@pytest.mark.parametrize("setting,nodes,want", [
    ("auto", (0, 0, 0, 0, 1, 1, 1, 1), 4),     # 2 x 4: spans nodes, several ranks a node
    ("auto", (0, 0, 1, 1, 2, 2, 3, 3), 2),     # 4 x 2
    ("auto", (0, 0, 0, 0), 0),                 # one node: flat
    ("auto", (0, 1, 2, 3), 0),                 # one rank a node: the relay is the only owner, flat
    ("auto", (0, 0, 1), 0),                    # unequal nodes: flat
    ("auto", (0, 1, 0, 1), 0),                 # ranks not in node order: flat
    ("flat", (0, 0, 1, 1), 0),
    ("hierarchical", (0, 0, 1, 1), 2),
    ("hierarchical", (0, 0, 0, 0), 4),         # one node: the flat rows, by the hierarchical ops
    ("hierarchical", (0, 1), 1),               # one rank a node (two one-GPU "nodes")
])
def test_topology_resolution(setting, nodes, want):
    assert exchange_ranks_per_node(setting, nodes) == want


def test_topology_resolution_bad_input():
    with pytest.raises(ValueError, match=r"topology='hierarchical' needs .* equal nodes in rank order"):
        exchange_ranks_per_node("hierarchical", (0, 0, 1))
    with pytest.raises(ValueError, match=r"topology='hierarchical' needs"):
        exchange_ranks_per_node("hierarchical", (0, 1, 0, 1))
    with pytest.raises(ValueError, match="topology='ring' must be one of"):
        exchange_ranks_per_node("ring", (0, 0))
    with pytest.raises(ValueError, match=r"ExchangeConfig.topology='ring' must be one of"):
        ExchangeConfig(topology="ring")
    with pytest.raises(ValueError, match=r"exchange.topology=3 must be one of"):
        ExchangeConfig.from_dict({"topology": 3})
    assert ExchangeConfig.from_dict({"topology": "flat"}).topology == "flat"
    assert ExchangeConfig().topology == "auto" and ExchangeConfig().to_dict()["topology"] == "auto"


def test_topology_from_torchrun_env():
    """torchrun's LOCAL_WORLD_SIZE places the ranks; GROUP_RANK (the node) must agree with it."""
    env = {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    t = Topology.from_ranks(list(range(8)), 5, env)
    assert t.nodes == (0, 0, 0, 0, 1, 1, 1, 1) and exchange_ranks_per_node("auto", t.nodes) == 4
    with pytest.raises(ValueError, match="GROUP_RANK=0 but global rank 5"):
        Topology.from_ranks(list(range(8)), 5, {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"})
    # an EP group of every other global rank: two ranks on each of two nodes
    t = Topology.from_ranks([0, 2, 4, 6], 0, {"LOCAL_WORLD_SIZE": "4"})
    assert t.nodes == (0, 0, 1, 1) and exchange_ranks_per_node("auto", t.nodes) == 2


def _emulated(topology, W=4, rpn=2, **kw):
    return SymmBuffers.emulated(W, 8, 16, 2, 8, torch.bfloat16, device="cpu", ranks_per_node=rpn,
                                config=ExchangeConfig(topology=topology), **kw)


def test_emulated_buffers_take_the_topology():
    flat, hier = _emulated("flat"), _emulated("auto")
    assert all(b.hier is None for b in flat) and all(b.hier is not None for b in hier)
    H = hier[0].hier.layout
    assert (H.ranks_per_node, H.num_nodes, H.hmeta_words) == (2, 2, 2 * 2 + 2 + 1)
    # the hierarchical regions follow the flat ones: the flat offsets do not move
    assert H.off_hflag >= flat[0].layout.nbytes and hier[0].layout.nbytes == H.nbytes > flat[0].layout.nbytes
    assert hier[0].layout.off_comb == flat[0].layout.off_comb
    # pointer 0 for the other node's ranks (the emulated NVSHMEM route), unless asked otherwise
    assert [p == 0 for p in hier[1].peers.tolist()] == [False, False, True, True]
    assert all(p != 0 for p in _emulated("hierarchical", nvshmem=False)[1].peers.tolist())
    assert _emulated("hierarchical", rpn=4)[0].hier.layout.num_nodes == 1  # one node, hierarchical ops
    assert _emulated("auto", rpn=1)[0].hier is None  # one rank a node: flat
    with pytest.raises(ValueError, match="nvshmem=False: the flat exchange reaches other nodes only"):
        _emulated("flat", nvshmem=False)
    with pytest.raises(ValueError, match="topology='hierarchical' needs"):
        SymmBuffers.emulated(3, 8, 16, 2, 6, torch.bfloat16, device="cpu", ranks_per_node=2,
                             config=ExchangeConfig(topology="hierarchical"))


def test_a_set_keeps_its_topology():
    """Its regions depend on it: a dispatcher or a reconfigure asking for the other raises."""
    hier = _emulated("auto")
    with pytest.raises(ValueError, match="asks for the flat exchange; this buffer set was built for the "
                                         "hierarchical exchange over nodes of 2"):
        SymmDispatcher(8, buffers=hier[0], config=ExchangeConfig(topology="flat"))
    with pytest.raises(ValueError, match="asks for the flat exchange"):
        hier[0].reconfigure(ExchangeConfig(topology="flat"))
    flat = _emulated("flat")
    with pytest.raises(ValueError, match="asks for the hierarchical exchange over nodes of 2"):
        flat[0].reconfigure(ExchangeConfig(topology="auto"))
    SymmDispatcher(8, buffers=hier[0], config=ExchangeConfig(topology="auto"))  # the config it was built with


def test_leg_counters_surface():
    hier = _emulated("auto")
    d = SymmDispatcher(8, buffers=hier[0])
    c = d.leg_counters()
    assert d.topology == "hierarchical" and c.dtype == torch.int64 and c.shape == (len(LEG_COUNTERS),)
    assert c.device == hier[0].device and not c.any()
    c += 3
    d.reset_leg_counters()
    assert not d.leg_counters().any()
    flat = SymmDispatcher(8, buffers=_emulated("flat")[0])
    assert flat.topology == "flat" and flat.leg_counters() is None
    assert SymmDispatcher(8).topology is None
    w = EmulatedWorld(4, 8, 16, 2, 8, torch.bfloat16, device="cpu", ranks_per_node=2)
    assert w.hierarchical and w.leg_counters() == [dict.fromkeys(LEG_COUNTERS, 0)] * 4
    with pytest.raises(ValueError, match="leg counters belong to the hierarchical exchange"):
        EmulatedWorld(4, 8, 16, 2, 8, torch.bfloat16, device="cpu").leg_counters()


def test_topology_in_the_training_recipe(tmp_path):
    """``[parallel.exchange] topology`` in a recipe reaches the training config; a bad value names the key."""
    from test_symm_config import RECIPE
    from train.config import load_config

    base = open(RECIPE).read()
    head = "[parallel]\nep = 1\n"
    assert head in base
    for value in ("hierarchical", "flat"):
        path = tmp_path / f"{value}.toml"
        path.write_text(base.replace(head, f'{head}\n[parallel.exchange]\ntopology = "{value}"\n'))
        assert load_config(path).parallel.exchange.topology == value
    path = tmp_path / "bad.toml"
    path.write_text(base.replace(head, f'{head}\n[parallel.exchange]\ntopology = "mesh"\n'))
    with pytest.raises(ValueError, match=r"parallel.exchange.topology='mesh' must be one of"):
        load_config(path)
    assert load_config(RECIPE).parallel.exchange.topology == "auto"
