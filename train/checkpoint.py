"""Distributed checkpoints with torch.distributed.checkpoint (DCP), resumable at any (dp, ep) layout.

Layout of ``<dir>/step_<N>/``: the DCP files of the model, optimizer and experts (each rank writes
its own shards), plus ``extra_rank<r>.pt`` per rank (step, scheduler, data position, RNG states) --
small, so a plain ``torch.save``. ``<dir>/latest`` names the last complete step; it is written
after every rank has finished, so a job killed mid-save resumes from the previous one.

Experts are saved by *global expert id*. An FSDP2 expert DTensor spans the dp mesh only, so to DCP
every ep rank's ``layers.3.moe.w13`` would look like the same tensor; instead each expert row
``g`` of ``w13`` / ``w2`` (and its Adam moments) is its own DCP entry, ``experts/<fqn>@expert<g>``,
written by the one rank that holds it (a rank holds experts ``ep_rank * e + [dp shard of e]``).
Loading asks for the ids this rank holds *now*, so a checkpoint saved at one (dp, ep) resumes at
any other with the same number of experts (e.g. EP=2 -> EP=1 -> EP=2), and DCP reshards everything
else (FSDP2 DTensors over the dp or the world mesh) itself. The world size may change too when the
global batch (``data.batch_size * world * train.grad_accum``) stays the same: a rank with no
``extra_rank<r>.pt`` of its own takes rank 0's (step, scheduler and data position are global).
Router biases (aux-loss-free balancing) are replicated buffers and travel with the model state.

Nothing saved depends on the mesh: the optimizer's parameter groups are one per parameter role
(``train.parallelize.OPTIMIZER_ROLES``), the same at every layout, and the LR scheduler's per-group
lists are saved keyed by role (``schedule_state``). Loading reads the optimizer's per-parameter
state (Adam moments, step counts) and the schedule, not the saved param groups: the groups and
their hyperparameters (betas, eps, weight decay) are this run's, from its config, and every group's
learning rate is set from the restored schedule. So a checkpoint whose groups were split by mesh
(written before the groups were by role) loads too, its schedule mapped onto this run's groups.
"""

from __future__ import annotations

import os
import random
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from .parallelize import ParallelDims
from .resume_check import check_resume_compatible

__all__ = ["save_checkpoint", "load_checkpoint", "latest_step", "prune_checkpoints", "expert_key", "schedule_state",
           "load_schedule_state"]


def expert_key(fqn: str, global_id: int) -> str:
    """The DCP key of expert ``global_id`` of the expert weight ``fqn`` (e.g. ``layers.3.moe.w13``)."""
    return f"{fqn}@expert{global_id}"


def _dim0_shard(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(offset of this rank's rows along dim 0 within the tensor, the local rows) -- FSDP2 shards
    the local experts along dim 0 over dp (torch.chunk sizes, possibly none on some ranks)."""
    if not isinstance(t, DTensor):
        return 0, t
    if any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and p.dim != 0) for p in t.placements):
        raise ValueError(f"expert weights must be sharded along dim 0 (the expert dim), got {t.placements}")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], t.to_local()


def _expert_first_ids(model) -> dict[str, int]:
    """FQN of every expert weight -> global id of its local row 0 on this ep rank."""
    firsts = {}
    for mname, m in model.named_modules():
        if hasattr(m, "expert_range"):
            for pname in ("w13", "w2"):
                firsts[f"{mname}.{pname}"] = m.expert_range[0]
    return firsts


def _split_experts(model_sd: dict, optim_sd: dict, firsts: dict[str, int]) -> tuple[dict, dict, dict]:
    """Moves every expert weight and its optimizer state out of the two state dicts into one flat
    dict keyed by global expert id (values are views of the local tensors: DCP loads into them in
    place). Returns (model rest, optim rest, experts); the input dicts are not modified."""
    model_rest = dict(model_sd)
    state_rest = dict(optim_sd["state"])
    experts: dict[str, torch.Tensor] = {}
    for fqn, first in firsts.items():
        if fqn not in model_rest:
            raise KeyError(f"expert weight {fqn} is not in the model state dict")
        offset, local = _dim0_shard(model_rest.pop(fqn))
        ids = range(first + offset, first + offset + local.shape[0])
        for i, g in enumerate(ids):
            experts[expert_key(fqn, g)] = local[i]
        for name, v in state_rest.pop(fqn, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # Adam moments: one row per expert
                v_off, v_local = _dim0_shard(v)
                if v_off != offset or v_local.shape[0] != local.shape[0]:
                    raise ValueError(f"optimizer state {fqn}.{name} is not sharded like the weight")
                for i, g in enumerate(ids):
                    experts[f"{expert_key(fqn, g)}/{name}"] = v_local[i]
            else:  # the step count: the same on every rank (DCP writes one copy)
                experts[f"{fqn}/{name}"] = v
    return model_rest, {**optim_sd, "state": state_rest}, experts


_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")   # LR scheduler state with one entry per group


def _roles(optimizer) -> list[str]:
    return list(getattr(optimizer, "group_roles", None) or map(str, range(len(optimizer.param_groups))))


def schedule_state(scheduler, optimizer) -> dict:
    """``scheduler.state_dict()`` with its per-group lists as ``{role: value}`` (mesh-independent)."""
    roles = _roles(optimizer)
    return {k: dict(zip(roles, v)) if k in _PER_GROUP and isinstance(v, list) else v
            for k, v in scheduler.state_dict().items()}


def load_schedule_state(scheduler, optimizer, extra: dict) -> None:
    """Restores the LR schedule from a checkpoint's ``extra`` (``schedule`` by role, or an older
    ``scheduler`` state with one entry per saved group) and sets every group's current ``lr`` to it:
    the next optimizer step uses the rate the uninterrupted run would."""
    roles = _roles(optimizer)
    if "schedule" in extra:
        sd = dict(extra["schedule"])
        for k in _PER_GROUP:
            if isinstance(sd.get(k), dict):
                missing = [r for r in roles if r not in sd[k]]
                if missing:
                    raise ValueError(f"the checkpoint's LR schedule has no parameter group {missing[0]!r} "
                                     f"(it has {sorted(sd[k])}): saved by a different model")
                sd[k] = [sd[k][r] for r in roles]
    else:   # one entry per saved group; its groups may have been split by mesh
        sd = dict(extra["scheduler"])
        for k in _PER_GROUP:
            v = sd.get(k)
            if isinstance(v, list) and len(v) != len(roles):
                if len(set(map(repr, v))) != 1:
                    raise ValueError(f"the checkpoint's LR schedule has {len(v)} parameter groups with different "
                                     f"{k} and this run has {len(roles)}: cannot map them")
                sd[k] = [v[0]] * len(roles)
    scheduler.load_state_dict(sd)
    for g, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        g["lr"] = lr


def latest_step(ckpt_dir: str) -> Optional[int]:
    p = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return int(f.read().strip())


def _rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def prune_checkpoints(ckpt_dir: str, keep: int) -> list[str]:
    """Deletes all but the newest ``keep`` complete checkpoints (``step_<N>`` with N <= latest);
    returns the deleted paths. ``keep=0`` keeps everything. A step newer than ``latest`` (a save
    that did not finish) is left alone: the next save of that step overwrites it."""
    import shutil
    if keep <= 0:
        return []
    latest = latest_step(ckpt_dir)
    if latest is None:
        return []
    steps = sorted(int(n[5:]) for n in os.listdir(ckpt_dir) if n.startswith("step_") and n[5:].isdigit())
    done = [s for s in steps if s <= latest]
    gone = [os.path.join(ckpt_dir, f"step_{s}") for s in done[:-keep]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def save_checkpoint(ckpt_dir: str, step: int, model, optimizer, scheduler, loader, pd: ParallelDims,
                    keep: int = 0) -> str:
    path = os.path.join(ckpt_dir, f"step_{step}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_rest, optim_rest, experts = _split_experts(model_sd, optim_sd, _expert_first_ids(model))
    dcp.save({"model": model_rest, "optim": optim_rest, "experts": experts}, checkpoint_id=path)
    torch.save({"step": step, "schedule": schedule_state(scheduler, optimizer), "data": loader.state_dict(),
                "rng": _rng_state(), "layout": {"world": pd.world, "dp": pd.dp, "ep": pd.ep, "nodes": pd.nodes,
                                                "sharding": pd.sharding}},
               os.path.join(path, f"extra_rank{pd.rank}.pt"))
    dist.barrier()
    if pd.rank == 0:
        tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(ckpt_dir, "latest"))
        prune_checkpoints(ckpt_dir, keep)
    dist.barrier()
    return path


def load_checkpoint(ckpt_dir: str, step: int, model, optimizer, scheduler, loader, pd: ParallelDims) -> int:
    """Loads everything saved at ``step`` in place, at this job's (dp, ep) layout whatever the
    saving job's was; returns the step to continue from."""
    path = os.path.join(ckpt_dir, f"step_{step}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_rest, optim_rest, experts = _split_experts(model_sd, optim_sd, _expert_first_ids(model))
    # The saved param_groups are not read (module docstring): the groups stay this run's.
    state = {"model": model_rest, "optim": {"state": optim_rest["state"]}, "experts": experts}
    check_resume_compatible(path, state)  # a mismatch is one clear line, not DCP's traceback
    dcp.load(state, checkpoint_id=path)  # experts land in place in model_sd / optim_sd's tensors
    model_sd = {**model_sd, **state["model"]}
    optim_sd = {"state": {**optim_sd["state"], **state["optim"]["state"]}, "param_groups": optim_rest["param_groups"]}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    own = os.path.join(path, f"extra_rank{pd.rank}.pt")
    extra = torch.load(own if os.path.exists(own) else os.path.join(path, "extra_rank0.pt"), weights_only=False)
    load_schedule_state(scheduler, optimizer, extra)
    loader.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    if "cuda" in extra["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng"]["cuda"])
    return int(extra["step"])
