"""Expert parallelism + FSDP2 over a ("dp", "ep") DeviceMesh, and the gradient bookkeeping they need.

World W = dp * ep ranks; rank = dp_rank * ep + ep_rank. Every rank reads its own data (EP ranks are
also data-parallel for everything that is not an expert).

    parameter                         sharded over       gradient reduced over
    experts w13 / w2                  ep (by MoELayer)   dp (FSDP2 reduce-scatter, dp mesh)
                                      + dp (FSDP2)
    router, shared experts            dp (FSDP2)         dp (FSDP2) then ep (all-reduce, here)
    attention, norms, dense MLP,      all W ranks        all W ranks (FSDP2 on a 1-D mesh of W)
    embedding, head                   (FSDP2)

The router and shared experts live in the same ``MoELayer`` module as the experts, and FSDP2 groups
parameters per module, so the whole MoE layer is sharded over the dp mesh and the replicated part is
finished by an all-reduce over ep after backward (``finish_grads``). (If ``MoELayer`` kept its
experts in a submodule, the router and shared experts could join the W-rank FSDP group instead.)

Gradient scale: each rank's loss is the mean over its own tokens; the objective is the mean over
the W ranks. FSDP2 divides by its mesh size. An expert's local gradient already sums the
contributions of all ep ranks (they arrive through the all-to-all backward), so expert gradients
are additionally divided by ep; the router / shared gradients are summed over ep then divided by ep.

Mixed precision (GPU): FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` --
fp32 master weights and optimizer state, bf16 compute, fp32 gradient reduction.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .config import Config
from .model import Transformer

__all__ = ["ParallelDims", "build_mesh", "build_model", "finish_grads", "clip_grad_norm_",
           "build_optimizer", "local_tensor", "expert_param_names"]


@dataclass(frozen=True)
class ParallelDims:
    world: int
    dp: int
    ep: int
    rank: int
    device_type: str
    world_mesh: DeviceMesh       # 1-D, all ranks ("fsdp")
    mesh: DeviceMesh             # 2-D ("dp", "ep")

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


def build_mesh(cfg: Config, device_type: str) -> ParallelDims:
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = cfg.parallel.ep
    if world % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the world size {world}")
    dp = cfg.parallel.dp or world // ep
    if dp * ep != world:
        raise ValueError(f"parallel.dp={dp} * parallel.ep={ep} = {dp * ep} differs from the world size {world}")
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    return ParallelDims(world, dp, ep, rank, device_type, world_mesh, mesh)


def expert_param_names(model: nn.Module) -> set[str]:
    """FQNs of the EP-sharded expert weights (``*.w13``, ``*.w2`` of each MoELayer)."""
    names = set()
    for mname, m in model.named_modules():
        if hasattr(m, "expert_range"):
            names |= {f"{mname}.w13", f"{mname}.w2"}
    return names


def build_model(cfg: Config, pd: ParallelDims, device: torch.device, bf16: bool) -> Transformer:
    """Build the single-device model with the ep group handed to its MoE layers (each keeps only
    its ``E/ep`` experts), initialise it (same weights for every ep), then apply FSDP2."""
    ep_group = pd.ep_group if pd.ep > 1 else None
    model = Transformer(cfg.model, ep_group=ep_group, gemm_backend=cfg.train.gemm_backend or None,
                        device=device, seed=cfg.train.seed)
    # MoELayer returns a view of its output; FSDP2 warns that an in-place op on it would skip the
    # backward hook. Block adds it out of place (h + ffn(h)), so the warning does not apply here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoELayer\) returned a view")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.layers:
        if block.moe is not None:
            fully_shard(block.moe, mesh=pd.mesh["dp"], mp_policy=mp)
        fully_shard(block, mesh=pd.world_mesh, mp_policy=mp)
    fully_shard(model, mesh=pd.world_mesh, mp_policy=mp)
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _moe_params(model: Transformer):
    """(replicated-over-ep params, expert params) of every MoE layer."""
    rep, exp = [], []
    for m in model.moe_layers():
        exp += [m.w13, m.w2]
        rep += [p for p in (m.router.weight, m.shared_w13, m.shared_w2) if p is not None]
    return rep, exp


@torch.no_grad()
def finish_grads(model: Transformer, pd: ParallelDims) -> None:
    """After ``loss.backward()``: complete the reductions FSDP2 cannot express (module docstring)."""
    if pd.ep == 1:
        return
    rep, exp = _moe_params(model)
    for p in exp:
        if p.grad is not None:
            local_tensor(p.grad).div_(pd.ep)
    grads = [local_tensor(p.grad) for p in rep if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=pd.ep_group)
        flat.div_(pd.ep)
        i = 0
        for g in grads:
            g.copy_(flat[i:i + g.numel()].view_as(g))
            i += g.numel()


@torch.no_grad()
def clip_grad_norm_(model: Transformer, pd: ParallelDims, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients over every rank, each element counted once; scales the
    gradients in place when it exceeds ``max_norm`` (0 = measure only). Returns the norm (fp32).

    Local shards: W-rank FSDP params are disjoint across all ranks; MoE-layer params are disjoint
    across dp, and across ep the experts are disjoint while the router / shared experts are
    replicated (so their square sums are divided by ep before the all-rank sum)."""
    rep, _ = _moe_params(model)
    rep_ids = {id(p) for p in rep}
    sq = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        g = local_tensor(p.grad)
        grads.append(g)
        s = g.double().square().sum()
        sq += s / pd.ep if id(p) in rep_ids else s
    if pd.world > 1:
        dist.all_reduce(sq, group=pd.world_group)
    norm = sq.sqrt().float()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return norm


def build_optimizer(model: Transformer, cfg: Config, fused: Optional[bool] = None) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and the embedding. Groups are split by mesh so that every
    foreach kernel sees DTensors of one mesh."""
    t = cfg.train
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        decay = p.dim() >= 2 and "embed" not in name
        mesh = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None
        groups.setdefault((mesh, decay), []).append(p)
    param_groups = [{"params": ps, "weight_decay": t.weight_decay if decay else 0.0}
                    for (_, decay), ps in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]
    return torch.optim.AdamW(param_groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused)


def lr_lambda(cfg: Config):
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    import math

    t = cfg.train

    def f(step: int) -> float:  # step = number of optimizer steps already taken
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        span = max(t.steps - t.warmup_steps, 1)
        progress = min((step - t.warmup_steps) / span, 1.0)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f
