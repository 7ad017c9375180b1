"""Resume across parallel layouts (tier T1, gloo on CPU): a checkpoint saved at one (dp, ep) resumes
at another, experts saved by global id and everything else resharded by DCP (train/checkpoint.py).

Two checks:
1. Exact state: a checkpoint saved at EP=2 (dp=1, 2 ranks) after 2 training steps, loaded at EP=1
   (dp=2) and saved again, loaded from there at EP=2 and saved again, and loaded by one process
   (world 1) and saved again, holds bit for bit the same model, Adam moments, step counts and
   router biases (each checkpoint converted to plain tensors with DCP's ``dcp_to_torch_save``).
   And the experts of a step-0 checkpoint saved at EP=2 are the experts a single-device model
   draws for those global ids -- so the keys really are global ids.
2. Loss continuation, through the CLI: a run at EP=2 checkpoints at step 8 and runs to 12; a job
   at EP=1 resumes from its step 8 and must reproduce steps 9..12; and the same from EP=1 to EP=2.
   Not bitwise: another layout sums the same fp32 terms in another order (module docstring of
   tests/test_train_dist.py: ~1e-7 relative per step), so rtol=2e-5 as the EP parity test, far
   below the ~1e-2 change of the loss per step -- resuming with wrong or shuffled experts, or a
   stale optimizer state, moves the losses by orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_world
from _train import DEBUG, TINY, run_pretrain

pytestmark = pytest.mark.slow

RTOL = 2e-5


def _setup(world: int, ep: int):
    from train.config import load_config
    from train.data import ByteLoader
    from train.parallelize import build_mesh, build_model, build_optimizer, lr_lambda

    cfg = load_config(DEBUG, TINY + [f"parallel.ep={ep}", f"data.batch_size={8 // world}", "train.steps=20",
                                     "model.moe.load_balance_bias=true"])
    pd = build_mesh(cfg, "cpu")
    model = build_model(cfg, pd, torch.device("cpu"), bf16=False)
    opt = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    loader = ByteLoader(cfg.data, pd.rank, pd.world, torch.device("cpu"))
    return cfg, pd, model, opt, sched, loader


def _train_step(cfg, pd, model, opt, sched, loader):
    import torch.nn.functional as F

    from train.parallelize import clip_grad_norm_, finish_grads

    inputs, targets = loader.next_batch()
    logits = model(inputs)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)) + model.aux_loss()
    loss.backward()
    finish_grads(model, pd)
    clip_grad_norm_(model, pd, cfg.train.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    for m in model.moe_layers():
        m.update_bias(pd.world_group)


def _train_and_save(rank, world, ep, ckdir):
    from train.checkpoint import save_checkpoint

    cfg, pd, model, opt, sched, loader = _setup(world, ep)
    save_checkpoint(ckdir, 0, model, opt, sched, loader, pd)
    for _ in range(2):
        _train_step(cfg, pd, model, opt, sched, loader)
    save_checkpoint(ckdir, 2, model, opt, sched, loader, pd)


def _load_and_resave(rank, world, ep, src, dst):
    from train.checkpoint import load_checkpoint, save_checkpoint

    cfg, pd, model, opt, sched, loader = _setup(world, ep)
    step = load_checkpoint(src, 2, model, opt, sched, loader, pd)
    assert step == 2 and loader.samples_seen == 2 * 8
    save_checkpoint(dst, step, model, opt, sched, loader, pd)


def _flat(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(path) + ".pt"
    dcp_to_torch_save(str(path), out)
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (list, tuple)) and prefix.endswith("param_groups"):
            # Per parameter, not per group position: the groups are split by mesh (one foreach
            # kernel per mesh), so their number and order differ between layouts, and DCP maps
            # them back by parameter name on load.
            for group in v:
                for fqn in group["params"]:
                    for k, x in group.items():
                        if k != "params":
                            flat[f"{prefix}[{fqn}].{k}"] = x
        else:
            flat[prefix] = v

    walk("", torch.load(out, weights_only=False))
    return flat


def _assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:10]}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y), f"{what}: {k} differs"
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


def test_checkpoint_state_is_identical_across_layouts(tmp_path):
    ck = {n: tmp_path / n for n in ("ep2", "ep1", "ep2_again", "world1")}
    run_world(_train_and_save, 2, 2, str(ck["ep2"]))                        # dp=1 x ep=2
    run_world(_load_and_resave, 2, 1, str(ck["ep2"]), str(ck["ep1"]))       # EP=2 -> dp=2 x ep=1
    run_world(_load_and_resave, 2, 2, str(ck["ep1"]), str(ck["ep2_again"]))  # EP=1 -> EP=2
    run_world(_load_and_resave, 1, 1, str(ck["ep2"]), str(ck["world1"]))    # 2 ranks -> 1 rank
    from train.config import load_config
    from train.model import Transformer

    cfg = load_config(DEBUG, TINY + ["parallel.ep=2", "model.moe.load_balance_bias=true"])
    single = Transformer(cfg.model, ep_group=None, seed=cfg.train.seed)
    n_moe, E = len(single.moe_layers()), cfg.model.moe.num_experts
    saved = _flat(ck["ep2"] / "step_2")
    experts = [k for k in saved if "@expert" in k]
    # MoE layers x (w13, w2) x E experts x (weight, exp_avg, exp_avg_sq)
    assert n_moe >= 1 and len(experts) == n_moe * 2 * E * 3, experts
    assert sum(k.endswith("expert_bias") for k in saved) == n_moe, "router biases must be saved"
    for name in ("ep1", "ep2_again", "world1"):
        _assert_same(saved, _flat(ck[name] / "step_2"), f"step 2 saved at EP=2 vs reloaded and saved at {name}")
    # Training moved the state: a load that silently did nothing would not pass the above.
    step0 = _flat(ck["ep2"] / "step_0")
    assert not torch.equal(step0[experts[0]], saved[experts[0]])

    # Global ids: the EP=2 step-0 experts are those a single-device model draws for each id.
    checked = 0
    for m in single.moe_layers():
        fqn = next(n for n, mod in single.named_modules() if mod is m)
        for pname in ("w13", "w2"):
            for g in range(E):
                got = step0[f"experts.{fqn}.{pname}@expert{g}"]
                assert torch.equal(got, getattr(m, pname)[g].detach()), f"{fqn}.{pname} expert {g}"
                checked += 1
    assert checked == n_moe * 2 * E


@pytest.mark.parametrize("src_ep,dst_ep", [pytest.param(2, 1, marks=pytest.mark.release), (1, 2)])
def test_resume_at_another_ep_degree_continues_the_losses(tmp_path, src_ep, dst_ep):
    steps, base = 12, TINY + ["data.batch_size=4"]
    ck = [f"checkpoint.dir='{tmp_path / 'ck'}'", "checkpoint.every=8"]
    ref, out = run_pretrain(base + ck + [f"train.steps={steps}", f"parallel.ep={src_ep}"], tmp_path, "ref", nproc=2)
    assert (tmp_path / "ck" / "latest").read_text() == "8" and len(ref) == steps
    resumed, out = run_pretrain(base + ck + [f"train.steps={steps}", f"parallel.ep={dst_ep}"], tmp_path, "resume",
                                nproc=2)
    assert "resumed from" in out and "step_8" in out and f"ep={dst_ep}" in out
    assert len(resumed) == steps - 8
    a, b = torch.tensor(resumed, dtype=torch.float64), torch.tensor(ref[8:], dtype=torch.float64)
    gap = ((a - b).abs() / b.abs()).max().item()
    assert torch.allclose(a, b, rtol=RTOL, atol=0), f"EP={src_ep} -> EP={dst_ep}: max rel gap {gap:.2e}\n{a}\n{b}"
