"""Elastic resume on gloo (tier T1): a checkpoint saved at one (world, dp, ep, sharding, grad_accum)
resumes at another that divides the model, optimizer state and LR schedule included.

Each source world runs ``train.pretrain.train`` for STEPS steps, checkpointing at SAVE_AT (the
uninterrupted run), then points ``latest`` back at SAVE_AT. Each destination world resumes from it
with its own layout and runs to STEPS. Checked:

* the destination's losses for steps SAVE_AT+1..STEPS equal the uninterrupted run's within
  RTOL = 2e-5: the layouts compute the same function of the same global batch of 8 sequences and
  differ only in fp32 summation order (module docstring of tests/test_train_dist.py: a relative gap
  of ~1e-7 per step, 2.3e-7 over 20 steps measured there), far below the ~1e-2 change of the loss
  per step -- a stale Adam moment, a wrong learning rate or a shuffled expert moves it by orders of
  magnitude more;
* the state right after loading -- every parameter, Adam moment and step count (experts gathered
  over ep and dp to global tensors), the router biases, every group's learning rate, the scheduler's
  step and the data position -- equals, bit for bit, what the source layout loads from the same
  checkpoint (resharding only moves values).

The transitions the issue reported as crashes (1 -> 2 ranks: a missing optimizer param-group key;
2 -> 1: the scheduler's per-group lists) and EP 2 -> 1 run by default; the wider matrix (2 -> 4,
4 -> 2, dp/ep swaps at 4 ranks, grad_accum 1 <-> 2) with ``-m release``.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_world
from _train import DEBUG, TINY, full_tensor

STEPS, SAVE_AT, GLOBAL_BATCH = 8, 4, 8
RTOL = 2e-5
NODES2 = ["parallel.ranks_per_node=2", "parallel.sharding=hybrid"]

# id: (world, overrides)
LAYOUTS = {
    "w1": (1, []),
    "w1_accum2": (1, ["train.grad_accum=2"]),
    "w2_ep2": (2, ["parallel.ep=2"]),
    "w2_dp2": (2, ["parallel.ep=1"]),
    "w4_2x2_ep2": (4, ["parallel.ep=2"] + NODES2),
    "w4_ep4": (4, ["parallel.ep=4"]),
    "w4_dp4": (4, ["parallel.ep=1"]),
}


def _cfg(layout: str, ckdir: str, every: int):
    from train.config import load_config
    world, ov = LAYOUTS[layout]
    accum = 2 if "train.grad_accum=2" in ov else 1
    return load_config(DEBUG, TINY + ov + [
        f"data.batch_size={GLOBAL_BATCH // (world * accum)}", f"train.steps={STEPS}", "train.log_every=1",
        f"checkpoint.dir='{ckdir}'", f"checkpoint.every={every}"])


def _loaded_state(cfg) -> dict:
    """Everything a resume restores, as global values, right after ``load_checkpoint``."""
    from train.checkpoint import load_checkpoint
    from train.data import ByteLoader
    from train.parallelize import build_mesh, build_model, build_optimizer, expert_param_names, lr_lambda

    pd = build_mesh(cfg, "cpu")
    model = build_model(cfg, pd, torch.device("cpu"), bf16=False)
    opt = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    loader = ByteLoader(cfg.data, pd.rank, pd.world, grad_accum=cfg.train.grad_accum)
    step = load_checkpoint(cfg.checkpoint.dir, SAVE_AT, model, opt, sched, loader, pd)
    experts = expert_param_names(model)
    st = {"step": step, "last_epoch": sched.last_epoch, "samples_seen": loader.samples_seen,
          "lr": {r: g["lr"] for r, g in zip(opt.group_roles, opt.param_groups)}}
    for n, p in model.named_parameters():
        st[f"param {n}"] = full_tensor(p, n in experts, pd)
        for k, v in opt.state[p].items():
            st[f"optim {n}.{k}"] = full_tensor(v, n in experts, pd)
    for n, b in model.named_buffers():
        st[f"buffer {n}"] = b.detach().clone()
    return st


def _source(rank, world, layout, ckdir):
    import torch.distributed as dist

    from train.pretrain import train

    losses = train(_cfg(layout, ckdir, every=SAVE_AT), torch.device("cpu"))
    if rank == 0:   # the destinations resume from SAVE_AT, not from the last save
        with open(f"{ckdir}/latest", "w") as f:
            f.write(str(SAVE_AT))
    dist.barrier()
    return losses, _loaded_state(_cfg(layout, ckdir, every=0))


def _destination(rank, world, layout, ckdir):
    from train.pretrain import train

    cfg = _cfg(layout, ckdir, every=0)
    state = _loaded_state(cfg)
    return train(cfg, torch.device("cpu")), state


_sources: dict = {}


def _source_run(layout: str, tmp_path_factory):
    """Runs each source layout once per session; returns (losses of steps 1..STEPS, loaded state, dir)."""
    if layout not in _sources:
        ckdir = str(tmp_path_factory.mktemp(f"src_{layout}"))
        res = run_world(_source, LAYOUTS[layout][0], layout, ckdir, start_method="forkserver")
        _sources[layout] = (*res[0], ckdir)
    return _sources[layout]


def _check(src: str, dst: str, tmp_path_factory):
    ref, src_state, ckdir = _source_run(src, tmp_path_factory)
    assert len(ref) == STEPS and ref[-1] < ref[0]
    losses, state = run_world(_destination, LAYOUTS[dst][0], dst, ckdir, start_method="forkserver")[0]
    assert state.keys() == src_state.keys()
    for k, v in src_state.items():
        if isinstance(v, torch.Tensor):
            assert v.shape == state[k].shape and torch.equal(v, state[k]), f"{src} -> {dst}: {k} differs after loading"
        else:
            assert v == state[k], f"{src} -> {dst}: {k}: {state[k]!r}, saved layout loads {v!r}"
    assert state["step"] == SAVE_AT and state["samples_seen"] == SAVE_AT * GLOBAL_BATCH
    assert len(losses) == STEPS - SAVE_AT
    a, b = torch.tensor(losses, dtype=torch.float64), torch.tensor(ref[SAVE_AT:], dtype=torch.float64)
    gap = ((a - b).abs() / b.abs()).max().item()
    assert torch.allclose(a, b, rtol=RTOL, atol=0), f"{src} -> {dst}: max rel gap {gap:.2e} > {RTOL}\n{a}\n{b}"


FAST = [("w1", "w2_dp2"), ("w2_ep2", "w1"), ("w2_ep2", "w2_dp2")]
WIDE = [("w2_dp2", "w4_2x2_ep2"), ("w4_2x2_ep2", "w2_ep2"), ("w4_2x2_ep2", "w4_ep4"), ("w4_ep4", "w4_dp4"),
        ("w2_ep2", "w1_accum2"), ("w1_accum2", "w4_2x2_ep2")]


@pytest.mark.parametrize("src,dst", FAST, ids=[f"{a}-{b}" for a, b in FAST])
def test_resume_at_another_layout(src, dst, tmp_path_factory):
    _check(src, dst, tmp_path_factory)


@pytest.mark.release
@pytest.mark.parametrize("src,dst", WIDE, ids=[f"{a}-{b}" for a, b in WIDE])
def test_resume_matrix(src, dst, tmp_path_factory):
    _check(src, dst, tmp_path_factory)


def test_checkpoint_with_mesh_split_groups_loads(tmp_path):
    """A checkpoint written before the groups were by role -- two AdamW groups at one rank (no decay,
    decay), the scheduler saved with one entry per group -- loads into this run's three groups:
    parameters, Adam moments and steps as saved, each group's weight decay its own, every group's
    learning rate the saved schedule's."""
    import os

    from _train import one_rank_group
    from train.checkpoint import load_checkpoint, save_checkpoint
    from train.config import load_config
    from train.data import ByteLoader
    from train.parallelize import build_mesh, build_model, build_optimizer, clip_grad_norm_, finish_grads, lr_lambda

    cfg = load_config(DEBUG, TINY + ["data.batch_size=2", "train.steps=20"])
    with one_rank_group():
        pd = build_mesh(cfg, "cpu")
        model = build_model(cfg, pd, torch.device("cpu"), bf16=False)
        split = {True: [], False: []}
        for name, p in model.named_parameters():
            split[p.dim() >= 2 and "embed" not in name].append(p)
        old = torch.optim.AdamW([{"params": split[False], "weight_decay": 0.0},
                                 {"params": split[True], "weight_decay": cfg.train.weight_decay}], lr=cfg.train.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(old, lr_lambda(cfg))
        loader = ByteLoader(cfg.data, 0, 1)
        for _ in range(3):
            x, y = loader.next_batch()
            (model(x, y) + model.aux_loss()).backward()
            finish_grads(model, pd)
            clip_grad_norm_(model, pd, cfg.train.grad_clip)
            old.step()
            old.zero_grad()
            sched.step()
        save_checkpoint(str(tmp_path), 3, model, old, sched, loader, pd)
        extra = tmp_path / "step_3" / "extra_rank0.pt"
        e = torch.load(extra, weights_only=False)
        del e["schedule"]
        e["scheduler"] = sched.state_dict()          # the format of those checkpoints
        torch.save(e, extra)
        saved = {n: (p.detach().clone(), {k: v.clone() for k, v in old.state[p].items()})
                 for n, p in model.named_parameters()}

        new_model = build_model(cfg, pd, torch.device("cpu"), bf16=False)
        opt = build_optimizer(new_model, cfg)
        new_sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        assert len(opt.param_groups) == 3 and os.path.exists(extra)
        assert load_checkpoint(str(tmp_path), 3, new_model, opt, new_sched, ByteLoader(cfg.data, 0, 1), pd) == 3
    for n, p in new_model.named_parameters():
        w, st = saved[n]
        assert torch.equal(p, w), n
        assert st.keys() == opt.state[p].keys() and all(torch.equal(opt.state[p][k], v) for k, v in st.items()), n
    assert new_sched.last_epoch == 3 and [g["lr"] for g in opt.param_groups] == [sched.get_last_lr()[0]] * 3
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.train.weight_decay, 0.0, cfg.train.weight_decay]
