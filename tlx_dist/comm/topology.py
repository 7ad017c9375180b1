"""Which ranks of an expert-parallel group share a node, from torchrun's environment.

torchrun numbers global ranks node by node: node ``n`` holds global ranks
``[n * LOCAL_WORLD_SIZE, (n + 1) * LOCAL_WORLD_SIZE)``. Ranks on this node reach each other through
torch symmetric-memory peer pointers (NVLink); ranks on other nodes only through NVSHMEM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["Topology", "TOPOLOGIES", "exchange_ranks_per_node"]

# How an EP group's exchange is laid out over its nodes (``ExchangeConfig.topology``).
TOPOLOGIES = ("auto", "flat", "hierarchical")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    val = env.get(name)
    if val is None or val == "":
        return default
    try:
        out = int(val)
    except ValueError:
        raise ValueError(f"environment variable {name}={val!r} is not an integer") from None
    if out < (0 if name.endswith("RANK") else 1):
        raise ValueError(f"environment variable {name}={val!r} is out of range")
    return out


@dataclass(frozen=True)
class Topology:
    """Node placement of the ranks of one group.

    global_ranks: global rank of each group rank. local_world_size: ranks per node.
    rank: this process's rank in the group.
    """

    global_ranks: tuple
    local_world_size: int
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.global_ranks)

    def node_of(self, group_rank: int) -> int:
        return self.global_ranks[group_rank] // self.local_world_size

    def same_node(self, group_rank: int) -> bool:
        return self.node_of(group_rank) == self.node_of(self.rank)

    @property
    def single_node(self) -> bool:
        return all(self.same_node(d) for d in range(self.world_size))

    @property
    def nodes(self) -> tuple:
        """The node of each group rank."""
        return tuple(self.node_of(d) for d in range(self.world_size))

    @classmethod
    def from_ranks(cls, global_ranks: Sequence[int], rank: int,
                   env: Optional[Mapping[str, str]] = None) -> "Topology":
        """``LOCAL_WORLD_SIZE`` from ``env`` (default ``os.environ``); absent means one node."""
        env = os.environ if env is None else env
        global_ranks = tuple(int(g) for g in global_ranks)
        if not 0 <= rank < len(global_ranks):
            raise ValueError(f"rank={rank} is outside the group of {len(global_ranks)} ranks")
        lws = _env_int(env, "LOCAL_WORLD_SIZE", max(global_ranks) + 1 if global_ranks else 1)
        node = env.get("GROUP_RANK")
        if node not in (None, "") and _env_int(env, "GROUP_RANK", 0) != global_ranks[rank] // lws:
            raise ValueError(f"GROUP_RANK={node} but global rank {global_ranks[rank]} with LOCAL_WORLD_SIZE={lws} is "
                             f"on node {global_ranks[rank] // lws}: torchrun numbers ranks node by node")
        return cls(global_ranks, lws, rank)

    @classmethod
    def from_group(cls, group=None) -> "Topology":
        import torch.distributed as dist

        world = dist.get_world_size(group)
        ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
        return cls.from_ranks(ranks, dist.get_rank(group))


def exchange_ranks_per_node(setting: str, nodes) -> int:
    """Ranks per node of the hierarchical exchange for an EP group whose rank v is on node
    ``nodes[v]``, or 0 for the flat one. The hierarchical exchange needs the group's ranks to fill
    equal nodes in rank order (rank v local rank ``v % L`` of the group's ``v // L``-th node).
    ``setting`` (``ExchangeConfig.topology``): ``"flat"`` -- 0; ``"hierarchical"`` -- L (ValueError if
    the ranks do not fill equal nodes; one node gives the flat exchange's rows, bit for bit);
    ``"auto"`` -- L when the group spans nodes with more than one rank on each, else 0."""
    if setting not in TOPOLOGIES:
        raise ValueError(f"topology={setting!r} must be one of {TOPOLOGIES}")
    nodes = tuple(nodes)
    if setting == "flat" or not nodes:
        return 0
    W = len(nodes)
    L = sum(1 for n in nodes if n == nodes[0])
    chunks = [nodes[i:i + L] for i in range(0, W, L)]
    rect = W % L == 0 and all(len(set(c)) == 1 for c in chunks) and len({c[0] for c in chunks}) == len(chunks)
    if setting == "hierarchical":
        if not rect:
            raise ValueError(f"topology='hierarchical' needs the EP group's ranks to fill equal nodes in rank order; "
                             f"its ranks are on nodes {list(nodes)}")
        return L
    return L if rect and len(chunks) > 1 and L > 1 else 0
