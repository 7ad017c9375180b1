"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout of ``<dir>/step_<N>/``: the DCP files of the model and optimizer (each rank writes its own
shards), plus ``extra_rank<r>.pt`` per rank (step, scheduler, data position, RNG states) -- small
and rank-specific, so a plain ``torch.save``. ``<dir>/latest`` names the last complete step; it is
written after every rank has finished, so a job killed mid-save resumes from the previous one.

Expert weights: an FSDP2 expert DTensor spans the dp mesh only, so to DCP every ep rank's
``layers.3.ffn.w13`` looks like the same tensor. Their keys (and their optimizer states) get an
``@ep<rank>`` suffix to keep the ep shards apart; resuming therefore needs the same ep degree.
Router biases (aux-loss-free balancing) are buffers and travel with the model state.
"""

from __future__ import annotations

import os
import random
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .parallelize import ParallelDims, expert_param_names
from .resume_check import check_resume_compatible

__all__ = ["save_checkpoint", "load_checkpoint", "latest_step"]


def _suffix_map(model, pd: ParallelDims) -> dict[str, str]:
    return {n: f"{n}@ep{pd.ep_rank}" for n in expert_param_names(model)} if pd.ep > 1 else {}


def _rename(model_sd: dict, optim_sd: dict, m: dict[str, str]) -> tuple[dict, dict]:
    if not m:
        return model_sd, optim_sd
    model_sd = {m.get(k, k): v for k, v in model_sd.items()}
    optim_sd = {
        "state": {m.get(k, k): v for k, v in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [m.get(p, p) for p in g["params"]]} for g in optim_sd["param_groups"]],
    }
    return model_sd, optim_sd


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


def save_checkpoint(ckpt_dir: str, step: int, model, optimizer, scheduler, loader, pd: ParallelDims) -> str:
    path = os.path.join(ckpt_dir, f"step_{step}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd, optim_sd = _rename(model_sd, optim_sd, _suffix_map(model, pd))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    torch.save({"step": step, "scheduler": scheduler.state_dict(), "data": loader.state_dict(),
                "rng": _rng_state()}, os.path.join(path, f"extra_rank{pd.rank}.pt"))
    dist.barrier()
    if pd.rank == 0:
        tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(ckpt_dir, "latest"))
    dist.barrier()
    return path


def load_checkpoint(ckpt_dir: str, step: int, model, optimizer, scheduler, loader, pd: ParallelDims) -> int:
    """Loads everything saved at ``step`` in place; returns the step to continue from."""
    path = os.path.join(ckpt_dir, f"step_{step}")
    m = _suffix_map(model, pd)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd, optim_sd = _rename(model_sd, optim_sd, m)
    state = {"model": model_sd, "optim": optim_sd}
    check_resume_compatible(path, state)  # a mismatch is one clear line, not DCP's traceback
    dcp.load(state, checkpoint_id=path)
    back = {v: k for k, v in m.items()}
    model_sd, optim_sd = _rename(state["model"], state["optim"], back)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    extra = torch.load(os.path.join(path, f"extra_rank{pd.rank}.pt"), weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    loader.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    if "cuda" in extra["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng"]["cuda"])
    return int(extra["step"])
