"""Process layout of a training job: nodes, the (dp, ep) mesh, and the meshes FSDP2 shards on.

World W = dp * ep ranks; rank = dp_rank * ep + ep_rank (EP groups are runs of consecutive ranks).
Nodes: runs of R = ``ranks_per_node`` consecutive ranks (torchrun numbers the ranks of node n
``n * R + local_rank``); R is ``parallel.ranks_per_node``, else torchrun's ``LOCAL_WORLD_SIZE``,
else W (one node). N = W / R nodes.

    parameters                     parallel.sharding = "full"        "hybrid", N > 1 nodes
    dense (attention, norms,       1-D mesh of all W ranks           2-D (replicate = N, shard = R):
    embedding, head, dense MLP)                                      sharded inside a node,
                                                                     replicated across nodes
    MoE layer (experts, router,    1-D dp mesh: the dp ranks of      2-D (dp_replicate, dp_shard): the
    shared experts)                this rank's ep index (its expert  same ranks, dp_shard = those in
                                   data-parallel group)              one node (R / ep, or 1 when an
                                                                     EP group fills or spans nodes)

The MoE layer's mesh is the expert-data-parallel group: the ranks holding the same experts. Its
gradients are reduced over those ranks only, never over the other ep ranks (which hold other
experts); the router / shared-expert part is finished over ep by ``finish_grads``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import Config, UsageError

__all__ = ["ParallelDims", "build_mesh", "ranks_per_node"]


@dataclass(frozen=True)
class ParallelDims:
    """The job's layout. ``dense_mesh`` / ``expert_mesh`` are the meshes FSDP2 shards the dense
    parameters / the MoE layers on (module docstring); ``expert_mesh`` is unused when dp = 1."""

    world: int
    dp: int
    ep: int
    rank: int
    device_type: str
    world_mesh: DeviceMesh       # 1-D, all ranks ("fsdp")
    mesh: DeviceMesh             # 2-D ("dp", "ep")
    ranks_per_node: int = 0      # 0: the constructor's caller did not say (one node)
    sharding: str = "full"
    dense_mesh: Optional[DeviceMesh] = None    # None: world_mesh
    expert_mesh: Optional[DeviceMesh] = None   # None: mesh["dp"]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh["ep"].get_group()

    @property
    def world_group(self) -> dist.ProcessGroup:
        return self.world_mesh.get_group()

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def nodes(self) -> int:
        return self.world // (self.ranks_per_node or self.world)

    @property
    def dense(self) -> DeviceMesh:
        return self.dense_mesh if self.dense_mesh is not None else self.world_mesh

    @property
    def experts(self) -> DeviceMesh:
        return self.expert_mesh if self.expert_mesh is not None else self.mesh["dp"]

    def groups(self) -> list:
        """Every process group of the meshes (for timeouts)."""
        out = [self.world_group, self.mesh["dp"].get_group(), self.ep_group]
        for m in (self.dense, self.experts):
            out += [m.get_group(i) for i in range(m.ndim)]
        return out


def ranks_per_node(cfg: Config, world: int, rank: int, env: Optional[Mapping[str, str]] = None) -> int:
    """R (module docstring). Checks that R divides the world and, under torchrun, that this rank is
    where torchrun's numbering puts it (``GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``): nodes are
    runs of consecutive ranks only then."""
    env = os.environ if env is None else env
    r = cfg.parallel.ranks_per_node
    if r == 0:
        lws = env.get("LOCAL_WORLD_SIZE")
        r = int(lws) if lws else world
        node, local = env.get("GROUP_RANK"), env.get("LOCAL_RANK")
        if lws and node is not None and local is not None and int(node) * r + int(local) != rank:
            raise UsageError(f"rank {rank} is local rank {local} of node {node} with LOCAL_WORLD_SIZE={r}: nodes "
                             "must hold consecutive ranks (launch the same --nproc-per-node on every node), or set "
                             "parallel.ranks_per_node")
        where = "LOCAL_WORLD_SIZE" if lws else "one node"
    else:
        where = f"parallel.ranks_per_node={r}"
    if world % r:
        raise UsageError(f"{where}: {r} ranks per node does not divide the world size {world}")
    return r


def _expert_shards(cfg: Config, R: int, ep: int) -> int:
    """dp_shard of the hybrid MoE mesh: ranks of one node with the same ep index."""
    if ep <= R:
        if R % ep:
            raise UsageError(f"parallel.sharding='hybrid' needs parallel.ep={ep} to divide the {R} ranks of a node "
                             f"(parallel.ranks_per_node / LOCAL_WORLD_SIZE), or to be a multiple of it")
        return R // ep
    if ep % R:
        raise UsageError(f"parallel.sharding='hybrid': parallel.ep={ep} spans nodes, so it must be a multiple of the "
                         f"{R} ranks of a node (parallel.ranks_per_node / LOCAL_WORLD_SIZE)")
    return 1


def build_mesh(cfg: Config, device_type: str) -> ParallelDims:
    """The meshes of ``cfg.parallel`` on the initialised default group (module docstring).
    Usage errors name the field (``parallel.ep``, ``parallel.dp``, ``parallel.ranks_per_node``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = cfg.parallel.ep
    if world % ep:
        raise UsageError(f"parallel.ep={ep} does not divide the world size {world} "
                         f"(launch {ep} processes per expert-parallel group with torchrun)")
    dp = cfg.parallel.dp or world // ep
    if dp * ep != world:
        raise UsageError(f"parallel.dp={dp} * parallel.ep={ep} = {dp * ep} differs from the world size {world}")
    R = ranks_per_node(cfg, world, rank)
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    dense_mesh = expert_mesh = None
    nodes = world // R
    if cfg.parallel.sharding == "hybrid" and nodes > 1:
        dense_mesh = init_device_mesh(device_type, (nodes, R), mesh_dim_names=("replicate", "shard"))
        dp_shard = _expert_shards(cfg, R, ep)
        if dp > 1:
            m3 = init_device_mesh(device_type, (dp // dp_shard, dp_shard, ep),
                                  mesh_dim_names=("dp_replicate", "dp_shard", "ep"))
            expert_mesh = m3["dp_replicate", "dp_shard"]
    return ParallelDims(world, dp, ep, rank, device_type, world_mesh, mesh, R, cfg.parallel.sharding,
                        dense_mesh, expert_mesh)
