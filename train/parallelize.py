"""Expert parallelism + FSDP2 over a ("dp", "ep") DeviceMesh, and the gradient bookkeeping they need.

World W = dp * ep ranks; rank = dp_rank * ep + ep_rank. Every rank reads its own data (EP ranks are
also data-parallel for everything that is not an expert).

    parameter                         sharded over            gradient reduced over
    experts w13 / w2                  ep (by MoELayer)        their expert-data-parallel group: the dp
                                      + the MoE mesh (FSDP2)  ranks of this ep index (the MoE mesh)
    router, shared experts            the MoE mesh (FSDP2)    the MoE mesh, then ep (all-reduce, here)
    attention, norms, dense MLP,      the dense mesh (FSDP2)  the dense mesh: all W ranks
    embedding, head

The meshes are ``train.mesh``'s: with ``parallel.sharding = "full"`` the dense mesh is all W ranks
and the MoE mesh the dp ranks of this ep index; with ``"hybrid"`` on several nodes both are 2-D
(HSDP: sharded inside a node, replicated across nodes; reduce-scatter inside the node, then an
all-reduce of the shards across nodes).

The router and shared experts live in the same ``MoELayer`` module as the experts, and FSDP2 groups
parameters per module, so the whole MoE layer is sharded over the dp mesh and the replicated part is
finished by an all-reduce over ep after backward (``finish_grads``). (If ``MoELayer`` kept its
experts in a submodule, the router and shared experts could join the W-rank FSDP group instead.)

One-rank meshes are not sharded: FSDP2 on one rank only adds copies (a cast of every parameter in
each forward and backward, staging copies of every gradient). When dp = 1 the MoE layers stay out
of FSDP (``ignored_params``), and when W = 1 nothing is FSDP-wrapped. Those parameters keep fp32
masters in the module; on GPU (bf16) their bf16 compute copies persist between steps
(``train.mixed_precision.LocalMixedPrecision``): one cast of the weights after each optimizer step
and one of the gradients, nothing else.

Gradient scale: each rank's loss is the mean over its own tokens; the objective is the mean over
the W ranks. FSDP2 divides by its mesh size. An expert's local gradient already sums the
contributions of all ep ranks (they arrive through the all-to-all backward), so expert gradients
are additionally divided by ep; the router / shared gradients are summed over ep then divided by ep.

Mixed precision (GPU): FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` --
fp32 master weights and optimizer state, bf16 compute, fp32 gradient reduction. Forward inputs are
not cast (``cast_forward_inputs=False``): the residual stream is bf16 already, and the RoPE tables
stay fp32 (FSDP2 would round them to bf16 at every block).

``parallel.reduce_dtype = "bfloat16"``: only the gradient *communication* is bf16 -- FSDP2's
``reduce_dtype`` (its reduce-scatters and the HSDP all-reduce across nodes) and ``finish_grads``'
all-reduce over ep. What the ranks hold stays fp32: the sharded gradients (FSDP2 casts each
reduction's result to the fp32 parameter dtype), the masters, the optimizer state, and the sums over
``train.grad_accum`` micro-batches (below). Each element then carries the bf16 rounding of the
operands sent and of every add in the reduction: at most (contributions + 4) * 2^-8 of the
sum of the contributions' magnitudes (tests/test_train_reduce_dtype.py).

Wrapping and overlap: every block is its own FSDP2 unit and its MoE layer a unit inside it, so each
unit's reduce-scatter (and HSDP all-reduce) is issued as soon as that unit's backward is done and
runs on FSDP2's communication streams while earlier blocks compute their backward. Prefetching is
explicit, one unit ahead in the order the hooks fire: in the forward each unit's pre-forward issues
the next unit's all-gather (block i -> its MoE layer -> block i + 1 ...), so it does not rely on the
CPU running ahead (an exchange that reads its counts on the host stalls it); in the backward the
same chain reversed (block i -> its MoE layer -> block i - 1), which is FSDP2's implicit order
made explicit.

Gradient accumulation (``train.grad_accum``): ``set_gradient_sync(model, pd, False)`` before every
micro-batch but the last. An HSDP unit keeps reduce-scattering inside the node (sharded gradients,
no unsharded copy kept) and skips the all-reduce across nodes; a fully sharded unit skips the
reduce-scatter and accumulates its unsharded gradient (in the fp32 reduce dtype) until the last
micro-batch. ``finish_grads`` runs once per optimizer step. With bf16 reduction FSDP2 would
accumulate in bf16 (its accumulators take the reduce dtype), so instead: a fully sharded unit
reduce-scatters every micro-batch (in bf16) into its fp32 sharded gradient, and an HSDP unit's
partial sum of the in-node reduce-scatters is cast to fp32 after each micro-batch
(``keep_accumulation_fp32``), rounded to bf16 once, for the all-reduce of the last one.

Per step, after backward: ``finish_grads`` (EP reductions), ``clip_grad_norm_`` (fp32 per-tensor
norms with ``_foreach_norm``, one all-reduce; with the fused AdamW the clip factor is handed to
the optimizer kernel as its ``grad_scale`` instead of a separate pass over the gradients), the
optimizer, then ``update_router_biases`` (aux-loss-free balancing for every layer from one
all-reduced ``[L, E]`` count tensor).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from .config import Config, UsageError
from .mesh import ParallelDims, build_mesh
from .mixed_precision import LocalMixedPrecision
from .model import Transformer

__all__ = ["ParallelDims", "build_mesh", "build_model", "make_train_dispatcher", "check_exchange", "finish_grads",
           "clip_grad_norm_", "build_optimizer", "param_role", "OPTIMIZER_ROLES", "set_gradient_sync", "local_tensor",
           "expert_param_names", "update_router_biases", "REDUCE_DTYPES", "keep_accumulation_fp32"]

# parallel.reduce_dtype -> the dtype gradients are communicated in
REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def expert_param_names(model: nn.Module) -> set[str]:
    """FQNs of the EP-sharded expert weights (``*.w13``, ``*.w2`` of each MoELayer)."""
    names = set()
    for mname, m in model.named_modules():
        if hasattr(m, "expert_range"):
            names |= {f"{mname}.w13", f"{mname}.w2"}
    return names


def _ep_in_one_node(pd: ParallelDims) -> bool:
    """Whether this rank's EP group (ranks ``dp_rank * ep + [0, ep)``) sits inside one node."""
    R = getattr(pd, "ranks_per_node", 0)
    if R:
        first = pd.dp_rank * pd.ep
        return first // R == (first + pd.ep - 1) // R
    from tlx_dist.comm import Topology
    return Topology.from_group(pd.ep_group).single_node


def _hier_exchange(pd: ParallelDims, topology: str) -> bool:
    """Whether this rank's EP group runs the hierarchical exchange over more than one node
    (``ExchangeConfig.topology`` over the group's nodes, as the exchange resolves it)."""
    from tlx_dist.comm import Topology
    from tlx_dist.comm.topology import exchange_ranks_per_node
    R = getattr(pd, "ranks_per_node", 0)
    if R:
        nodes = tuple((pd.dp_rank * pd.ep + v) // R for v in range(pd.ep))
    else:
        nodes = Topology.from_group(pd.ep_group).nodes
    L = exchange_ranks_per_node(topology, nodes)
    return bool(L) and len(set(nodes)) > 1


def _symm_runs(pd: ParallelDims, device: torch.device) -> bool:
    """Whether the symmetric exchange runs this rank's EP group on ``device`` (CUDA): inside one
    node always (peer pointers); across nodes where NVSHMEM does."""
    if _ep_in_one_node(pd):
        return True
    from tlx_dist import comm
    return comm.nvshmem_supported(device)


def make_train_dispatcher(cfg: Config, pd: ParallelDims, device: torch.device):
    """``parallel.dispatcher`` -> what the MoE layers get: ``"auto"`` = the deduplicated symmetric
    exchange on CUDA when ep > 1 -- an EP group inside one node over peer pointers, one that spans
    nodes where NVSHMEM runs (``tlx_dist.comm.nvshmem_supported``; the hierarchical exchange there,
    ``parallel.exchange.topology``) -- one SymmDispatcher for every layer, its buffers sized for this
    recipe's tokens per rank and placed on the mesh's nodes (``parallel.ranks_per_node`` /
    ``LOCAL_WORLD_SIZE``); the layer's own default otherwise (local / all-to-all: CPU, gloo, a group
    across nodes without NVSHMEM). ``parallel.moe_pipeline="fused"`` at ep > 1 needs the symmetric
    exchange."""
    p = cfg.parallel
    kind = p.dispatcher
    if kind == "auto":
        kind = "symm" if device.type == "cuda" and pd.ep > 1 and _symm_runs(pd, device) else "auto"
    if p.moe_pipeline == "fused" and pd.ep > 1 and kind != "symm":
        raise UsageError(f"parallel.moe_pipeline='fused' at ep={pd.ep} runs over the symmetric exchange, which "
                         f"needs CUDA GPUs (and NVSHMEM across nodes) here (parallel.dispatcher={p.dispatcher!r} "
                         f"resolved to {kind!r}); use moe_pipeline='separate' or 'auto'")
    if kind != "symm":
        return kind
    if device.type != "cuda":
        raise UsageError("parallel.dispatcher='symm' needs CUDA GPUs (use 'all_to_all' or 'auto' on CPU)")
    import dataclasses

    from tlx_dist.comm import SymmDispatcher
    # The exchange's bounded waits use the run's collective timeout (unless parallel.exchange.timeout_s
    # sets one): a rank may reach the first dispatch long after another (first-step compilation),
    # which is no failure.
    exchange = p.exchange
    if exchange.timeout_s is None:
        exchange = dataclasses.replace(exchange, timeout_s=cfg.train.comm_timeout_s)
    # per-layer receive regions only where a fused EP layer claims one (MoELayer: pipeline "fused",
    # or "auto" with narrow experts, F <= 2D), not for separate ops
    from tlx_dist.moe import _narrow_experts
    m = cfg.model
    fused_possible = p.moe_pipeline == "fused" or (p.moe_pipeline == "auto" and _narrow_experts(m.moe))
    regions = m.n_layers - m.n_dense_layers if p.ep_row_regions and pd.ep > 1 and fused_possible else 0
    # the exchange's nodes are the mesh's (parallel.ranks_per_node, else LOCAL_WORLD_SIZE): which peers
    # are reached by NVSHMEM and, with topology "auto" / "hierarchical", the hierarchy's nodes
    R = getattr(pd, "ranks_per_node", 0)
    if exchange.overlap and not p.ep_row_regions and not _hier_exchange(pd, exchange.topology):
        raise UsageError("parallel.exchange.overlap=true: this EP group's exchange is flat (inside one node, or one "
                         "rank a node), whose overlap reads each layer's rows where they land: set "
                         "parallel.ep_row_regions = true (across nodes the hierarchical exchange needs none)")
    return SymmDispatcher(cfg.model.moe.num_experts, pd.ep_group if pd.ep > 1 else None, validate=False,
                          max_tokens=cfg.data.batch_size * cfg.data.seq_len,
                          capacity=p.capacity_factor if p.capacity_factor > 0 else "exact", row_regions=regions,
                          config=exchange, ranks_per_node=R if R and pd.ep > 1 else None)


def check_exchange(model: Transformer) -> None:
    """At a log step: raises if a symmetric exchange overflowed its capacity (naming the config key)
    or a wait timed out (naming the op and the peer), or if a grouped GEMM got out-of-range offsets
    (clamped on the device, flagged). One host sync per distinct buffer set, one for the flag."""
    from tlx_dist.grouped_gemm import check_offsets
    if next(model.parameters()).is_cuda:
        check_offsets(next(model.parameters()).device)
    seen = set()
    for m in model.moe_layers():
        check = getattr(m.dispatcher, "check", None)
        if check is not None and id(m.dispatcher) not in seen:
            seen.add(id(m.dispatcher))
            check(capacity_hint="parallel.capacity_factor")


def build_model(cfg: Config, pd: ParallelDims, device: torch.device, bf16: bool) -> Transformer:
    """Build the single-device model with the ep group handed to its MoE layers (each keeps only
    its ``E/ep`` experts), initialise it (same weights for every ep), set compile and activation
    checkpointing from ``cfg.train``, then apply FSDP2 on the meshes with more than one rank
    (module docstring) and local mixed precision to the rest."""
    ep_group = pd.ep_group if pd.ep > 1 else None
    model = Transformer(cfg.model, ep_group=ep_group, gemm_backend=cfg.train.gemm_backend or None,
                        device=device, seed=cfg.train.seed, dispatcher=make_train_dispatcher(cfg, pd, device),
                        pipeline=cfg.parallel.moe_pipeline)
    model.set_activation_checkpoint(cfg.train.activation_checkpoint)
    model.set_compile(cfg.train.compile)
    # MoELayer returns a view of its output; FSDP2 warns that an in-place op on it would skip the
    # backward hook. Block adds it out of place (h + ffn(h)), so the warning does not apply here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoELayer\) returned a view")
    rd = REDUCE_DTYPES[cfg.parallel.reduce_dtype]
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=rd, cast_forward_inputs=False)
    elif rd != torch.float32:   # fp32 compute, bf16 on the links
        mp = MixedPrecisionPolicy(reduce_dtype=rd, cast_forward_inputs=False)
    else:
        mp = MixedPrecisionPolicy()
    model._grad_reduce_dtype = rd
    local: list[nn.Parameter] = []   # parameters outside FSDP (their mesh has one rank)
    if pd.world == 1:
        local = list(model.parameters())
    else:
        pairs = []   # (block, its MoE layer if that is an FSDP2 unit of its own)
        for block in model.layers:
            ignored, moe_unit = None, None
            if block.moe is not None:
                if pd.dp > 1:
                    fully_shard(block.moe, mesh=pd.experts, mp_policy=mp)
                    moe_unit = block.moe
                else:
                    ignored = set(block.moe.parameters())
                    local += list(ignored)
            fully_shard(block, mesh=pd.dense, mp_policy=mp, ignored_params=ignored)
            pairs.append((block, moe_unit))
        fully_shard(model, mesh=pd.dense, mp_policy=mp)
        _set_prefetch(model, pairs)
        if rd != torch.float32 and cfg.train.grad_accum > 1:
            _partial_reductions(model)   # fails here, not mid-step, if this FSDP2 keeps them elsewhere
    model._local_mp = LocalMixedPrecision(model, local, torch.bfloat16) if bf16 and local else None
    return model


def _set_prefetch(root: nn.Module, pairs: list) -> None:
    """One unit ahead in the order the hooks fire (module docstring). Forward: the root (embedding),
    block 0, its MoE layer, block 1, ...; backward: the root (head), block L-1, its MoE layer, block
    L-2, ... (a block's pre-backward hook fires on its output's gradient, before its MoE layer's)."""
    def chain(order):
        units = [root] + [u for pair in order for u in pair if u is not None]
        return list(zip(units, units[1:]))
    for a, b in chain(pairs):
        a.set_modules_to_forward_prefetch([b])
    for a, b in chain(reversed(pairs)):
        a.set_modules_to_backward_prefetch([b])


def set_gradient_sync(model: Transformer, pd: ParallelDims, enabled: bool) -> None:
    """Whether the next backward reduces the gradients across ranks (off for every micro-batch of
    ``train.grad_accum`` but the last; module docstring). An HSDP unit (2-D mesh) keeps its
    reduce-scatter inside the node and toggles only the all-reduce across nodes; a 1-D unit toggles
    its reduce-scatter, except under bf16 reduction, where it reduce-scatters every micro-batch
    (FSDP2 would accumulate the unsharded gradient in bf16). Parameters outside FSDP2 accumulate
    locally either way, and ``finish_grads`` (the EP reductions) is called once per step by the
    caller."""
    every_micro_batch = getattr(model, "_grad_reduce_dtype", torch.float32) != torch.float32
    for m in model.modules():
        if isinstance(m, FSDPModule):
            hsdp = (pd.experts if hasattr(m, "expert_range") else pd.dense).ndim == 2
            if hsdp:
                m.set_requires_all_reduce(enabled, recurse=False)
            else:
                m.set_requires_gradient_sync(enabled or every_micro_batch, recurse=False)


def _partial_reductions(model: Transformer) -> list:
    """FSDP2's parameter group of every unit. Each holds ``_partial_reduce_output``: an HSDP unit's
    sum of the reduce-scattered gradient shards of the micro-batches whose all-reduce was skipped,
    in the reduce dtype, on its reduce-scatter stream (``comm_ctx.reduce_scatter_stream``). Private
    FSDP2 state: a torch without it is an error naming the key that needs it."""
    groups = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is None:
                continue
            if not (hasattr(pg, "_partial_reduce_output") and hasattr(pg, "comm_ctx")):
                raise UsageError(f"parallel.reduce_dtype='bfloat16' with train.grad_accum > 1 keeps the sums over "
                                 f"micro-batches in fp32 through FSDP2's _partial_reduce_output, which torch "
                                 f"{torch.__version__} does not have; use train.grad_accum = 1 or reduce_dtype 'float32'")
            groups.append(pg)
    return groups


@torch.no_grad()
def keep_accumulation_fp32(model: Transformer) -> None:
    """After the backward of a micro-batch that skipped the cross-node all-reduce: cast each HSDP
    unit's partial sum of reduce-scattered gradient shards to fp32, so that the next micro-batches
    add into an fp32 sum (FSDP2 keeps it in the reduce dtype, bf16 under ``parallel.reduce_dtype =
    "bfloat16"``); the last micro-batch adds its own shard to it and rounds the sum to bf16 once, for
    the all-reduce. No-op under fp32 reduction. The cast runs on the reduce-scatter stream that
    produced the sum and reads it next, so the allocator's stream ordering covers both; no host sync."""
    if getattr(model, "_grad_reduce_dtype", torch.float32) == torch.float32:
        return
    for pg in _partial_reductions(model):
        part = pg._partial_reduce_output
        if part is None or part.dtype == torch.float32:
            continue
        if part.is_cuda:
            with torch.cuda.stream(pg.comm_ctx.reduce_scatter_stream):
                pg._partial_reduce_output = part.float()
        else:
            pg._partial_reduce_output = part.float()


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
    """After ``loss.backward()``: put the fp32 masters of local mixed precision back in the model,
    and complete the reductions FSDP2 cannot express (module docstring)."""
    if getattr(model, "_local_mp", None) is not None:
        model._local_mp.uninstall()
    if pd.ep == 1:
        return
    rep, exp = _moe_params(model)
    for p in exp:
        if p.grad is not None:
            local_tensor(p.grad).div_(pd.ep)
    grads = [local_tensor(p.grad) for p in rep if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        rd = getattr(model, "_grad_reduce_dtype", flat.dtype)
        if rd == flat.dtype:
            dist.all_reduce(flat, group=pd.ep_group)
        else:   # bf16 on the link, the sum divided and kept in fp32
            wire = flat.to(rd)
            dist.all_reduce(wire, group=pd.ep_group)
            flat = wire.to(flat.dtype)
        flat.div_(pd.ep)
        i = 0
        for g in grads:
            g.copy_(flat[i:i + g.numel()].view_as(g))
            i += g.numel()


def _fused(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """The optimizer divides each gradient by its ``grad_scale`` as it reads it."""
    return optimizer is not None and (bool(optimizer.defaults.get("fused"))
                                      or bool(getattr(optimizer, "applies_grad_scale", False)))


@torch.no_grad()
def clip_grad_norm_(model: Transformer, pd: ParallelDims, max_norm: float,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
    """Global L2 norm of all gradients over every rank, each element counted once; scales the
    gradients by ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0`` (0 = measure only).
    Returns the norm (fp32, 0-dim, on the device; no host sync).

    Norms are fp32 per tensor (``torch._foreach_norm``: one multi-tensor kernel, no fp64 copies),
    their squares summed in fp32 and all-reduced once. With a fused optimizer (``fused=True``) the
    scaling is not a pass of its own: ``optimizer.grad_scale = 1 / factor`` makes the fused AdamW
    kernel divide each gradient as it reads it (the hook ``GradScaler`` uses); the next
    ``optimizer.step()`` must follow.

    Local shards, each counted once: a gradient's local shard is held by ``_copies`` ranks -- the
    replicate dimension of an HSDP mesh (dense: the nodes; MoE layers: dp_replicate), times ep for
    the router / shared experts (replicated over ep; the experts are disjoint across ep) -- so its
    square sum is divided by that before the all-rank sum."""
    rep, _ = _moe_params(model)
    rep_ids = {id(p) for p in rep}
    by_copies: dict[tuple, list] = {(1, False): []}   # (copies, replicated over ep) -> local gradients
    for p in model.parameters():
        if p.grad is not None:
            r = id(p) in rep_ids
            by_copies.setdefault((_copies(p.grad) * (pd.ep if r else 1), r), []).append(local_tensor(p.grad))
    lmp = getattr(model, "_local_mp", None)
    if lmp is not None and lmp.keep_grads:  # AdamWBf16Grads: the bf16 gradients (one rank, ep = 1)
        by_copies[(1, False)] += lmp.pending_grads()
    device = next(model.parameters()).device
    sq = torch.zeros((), dtype=torch.float32, device=device)
    f32 = torch.float32  # per-tensor norms accumulated in fp32 whatever the gradient's dtype
    for n, r in sorted(by_copies):
        if by_copies[(n, r)]:
            part = torch.stack(torch._foreach_norm(by_copies[(n, r)], 2.0, dtype=f32)).square().sum()
            sq = sq + (part / n if r or n > 1 else part)
    if pd.world > 1:
        dist.all_reduce(sq, group=pd.world_group)
    norm = sq.sqrt()
    if _fused(optimizer):
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0) if max_norm > 0 else None
    elif max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([g for n in sorted(by_copies) for g in by_copies[n]], coef)
    return norm


def _copies(t: torch.Tensor) -> int:
    """Ranks holding the same local shard of ``t``: the sizes of its Replicate mesh dimensions."""
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for i, pl in enumerate(t.placements):
        if isinstance(pl, Replicate):
            n *= t.device_mesh.size(i)
    return n


# The optimizer's parameter groups, in this order, each present iff the model has such parameters:
# a function of the model alone, never of the mesh, so that a checkpoint's groups (saved by index)
# and LR schedule match those of a job at any other (world, dp, ep). One group never mixes meshes:
# the dense parameters share the dense mesh, the MoE layers the MoE mesh (foreach kernels need one).
OPTIMIZER_ROLES = ("dense", "dense_no_decay", "moe", "moe_no_decay")


def param_role(name: str, p: torch.Tensor, moe_modules: tuple[str, ...]) -> str:
    """The optimizer group of parameter ``name``: ``moe`` for an MoE layer's (experts, router,
    shared experts; ``moe_modules`` are those layers' names), ``dense`` for the rest; ``_no_decay``
    for norms (1-D) and the embedding."""
    moe = name.startswith(tuple(f"{m}." for m in moe_modules))
    decay = p.dim() >= 2 and "embed" not in name
    return ("moe" if moe else "dense") + ("" if decay else "_no_decay")


def build_optimizer(model: Transformer, cfg: Config, fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and the embedding. One parameter group per role present in
    the model (``OPTIMIZER_ROLES``; ``optimizer.group_roles`` names them), the same groups at every
    layout. ``train.optimizer = "adamw_bf16_grads"``:
    :class:`train.optim.AdamWBf16Grads` over the one-rank bf16 masters (``fused`` does not apply);
    ``"auto"``: that where every parameter is such a master (bf16 on one rank), else torch's AdamW."""
    t = cfg.train
    moe_modules = tuple(n for n, m in model.named_modules() if hasattr(m, "expert_range"))
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        groups.setdefault(param_role(name, p, moe_modules), []).append(p)
    roles = [r for r in OPTIMIZER_ROLES if r in groups]
    param_groups = [{"params": groups[r], "weight_decay": 0.0 if r.endswith("_no_decay") else t.weight_decay}
                    for r in roles]
    lmp = getattr(model, "_local_mp", None)
    local_bf16 = lmp is not None and len(lmp.slots) == len(list(model.parameters()))
    if t.optimizer == "adamw_bf16_grads" or (t.optimizer == "auto" and local_bf16):
        if not local_bf16:
            raise ValueError("train.optimizer='adamw_bf16_grads' needs bf16 training on one rank (every parameter "
                             "a local bf16 master: train.dtype bf16, world size 1); use train.optimizer='adamw'")
        from .optim import AdamWBf16Grads

        opt = AdamWBf16Grads(param_groups, lmp, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                             weight_decay=t.weight_decay)
    else:
        opt = torch.optim.AdamW(param_groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused)
    opt.group_roles = tuple(roles)
    _refresh_fp8_per_step(model, opt)
    return opt


def _refresh_fp8_per_step(model: Transformer, opt: torch.optim.Optimizer) -> None:
    """FP8 MoE layers (``model.moe.precision = "fp8"``) remake their FP8 weight copies once per
    optimizer step: a post-step hook marks them stale, and the layers stop watching version counters
    (``fp8_refresh="step"``), which torch's fused AdamW does not bump and FSDP2's per-micro-batch
    all-gathers bump without changing a value."""
    layers = [m for m in model.moe_layers() if m.precision == "fp8"]
    if not layers:
        return
    for m in layers:
        m.fp8_refresh = "step"
        m.invalidate_fp8_weights()

    def hook(*_):
        for m in layers:
            m.invalidate_fp8_weights()

    opt.register_step_post_hook(hook)


@torch.no_grad()
def update_router_biases(model: Transformer, counts_LE: torch.Tensor) -> None:
    """Aux-loss-free balancing step of every MoE layer from ``counts_LE`` (int64 ``[L, E]``: tokens
    each layer routed to each expert since the last update, *already summed over all ranks* -- the
    caller all-reduces the stacked counts once per step instead of one all-reduce per layer).

    Uses ``Router.update_bias`` unchanged: the summed counts are written into each router's
    ``tokens_since_update`` and the update runs with no group (so it does not reduce again). This
    also replaces the router's own running count, which activation checkpointing would otherwise
    double (the recomputed forward counts its tokens a second time)."""
    for i, m in enumerate(model.moe_layers()):
        m.router.tokens_since_update.copy_(counts_LE[i])
        m.update_bias(None)


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
