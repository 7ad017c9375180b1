"""Tier T0 for the step-time pieces of the training loop, in one process (a one-rank gloo group
where FSDP2 needs one): local mixed precision against FSDP2's on one rank, clipping against an
fp64 reference, the fused-optimizer clip path against the plain one, the coalesced router-bias
update against the per-layer one, activation checkpointing and torch.compile against eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _train import one_rank_group, token_batches
from train.config import load_config
from train.model import Transformer
from train.parallelize import (build_mesh, build_model, build_optimizer, clip_grad_norm_, finish_grads,
                               update_router_biases)

DEBUG = Path(__file__).resolve().parent.parent / "configs" / "debug_cpu.toml"
SMALL = ["model.dim=32", "model.n_heads=2", "model.dense_inter_dim=64", "model.moe.moe_inter_dim=32",
         "model.moe.num_experts=4", "model.n_layers=3", "data.seq_len=16", "train.grad_clip=0.5"]


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_group():
        yield


_batches = token_batches


def _train(model, opt, pd, batches, max_norm=0.5):
    losses = []
    for x, y in batches:
        ce = model(x, y)
        (ce + model.aux_loss()).backward()
        finish_grads(model, pd)
        clip_grad_norm_(model, pd, max_norm, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ce.item())
    return losses


def _fsdp2_reference(cfg, pd):
    """The previous construction: FSDP2 on every mesh, also one-rank ones, bf16 compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    m = Transformer(cfg.model, seed=cfg.train.seed)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for b in m.layers:
        if b.moe is not None:
            fully_shard(b.moe, mesh=pd.mesh["dp"], mp_policy=mp)
        fully_shard(b, mesh=pd.world_mesh, mp_policy=mp)
    fully_shard(m, mesh=pd.world_mesh, mp_policy=mp)
    return m


def test_local_mixed_precision_equals_fsdp2_on_one_rank(one_rank):
    """Persistent bf16 compute copies must compute exactly what FSDP2's bf16 policy computes on one
    rank (same roundings of weights and gradients), step after step -- bitwise, since the same
    ops run on the same values; only the copies around them differ."""
    cfg = load_config(DEBUG, SMALL + ["train.dtype=bf16"])
    pd = build_mesh(cfg, "cpu")
    ours = build_model(cfg, pd, torch.device("cpu"), bf16=True)
    assert ours._local_mp is not None and len(ours._local_mp.slots) == len(list(ours.parameters()))
    assert all(p.dtype == torch.float32 for p in ours.parameters())          # masters stay fp32
    ref = _fsdp2_reference(cfg, pd)
    batches = _batches(3)
    l_ours = _train(ours, build_optimizer(ours, cfg), pd, batches)
    l_ref = _train(ref, build_optimizer(ref, cfg), pd, batches)
    assert l_ours == l_ref
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q.to_local()), n


def test_local_mixed_precision_refresh_and_state_dict(one_rank):
    """The compute copies follow every in-place change of the masters (optimizer step, a loaded
    checkpoint) through the version counter, and state_dict always shows the fp32 masters --
    also right after a forward without backward (no finish_grads)."""
    cfg = load_config(DEBUG, SMALL + ["train.dtype=bf16"])
    pd = build_mesh(cfg, "cpu")
    m = build_model(cfg, pd, torch.device("cpu"), bf16=True)
    x, y = _batches(1)[0]
    with torch.no_grad():
        l0 = m(x, y)
    assert not m._local_mp.installed                          # no-grad forward: masters back at once
    sd = m.state_dict()
    assert all(v.dtype == torch.float32 for k, v in sd.items() if "weight" in k or k.endswith(("w13", "w2")))
    m(x, y)                                                     # grad-mode forward leaves copies installed ...
    assert m._local_mp.installed and m.head.weight.dtype == torch.bfloat16
    sd = m.state_dict()                                         # ... until anything reads the state
    assert not m._local_mp.installed and sd["head.weight"].dtype == torch.float32
    # Load changed weights: the next forward must use them (a stale copy would give l0 again).
    sd = {k: (v * 0.5 if k == "head.weight" else v) for k, v in sd.items()}
    m.load_state_dict(sd)
    with torch.no_grad():
        l1 = m(x, y)
        ref = Transformer(cfg.model, seed=cfg.train.seed)
        ref.load_state_dict(sd)
        ref = ref.to(torch.bfloat16)
        l_ref = ref(x, y)
    assert l1.item() != l0.item() and l1.item() == l_ref.item()


@pytest.mark.parametrize("fused", [None, True])
def test_compute_copies_follow_the_optimizer(one_rank, fused):
    """After every optimizer step the next forward computes with the updated weights, for the
    foreach AdamW and for the fused one (the GPU default), whose in-place kernel does not bump the
    parameters' version counters: a copy refreshed on version changes stayed stale there and the
    h200_1gpu run's loss did not move (6.10 -> 6.11 over 60 steps on an H200)."""
    cfg = load_config(DEBUG, SMALL)
    pd = build_mesh(cfg, "cpu")
    m = build_model(cfg, pd, torch.device("cpu"), bf16=True)
    opt = build_optimizer(m, cfg, fused=fused)
    x, y = _batches(1)[0]
    for _ in range(2):
        (m(x, y) + m.aux_loss()).backward()
        finish_grads(m, pd)
        opt.step()
        opt.zero_grad(set_to_none=True)
        m(x, y)  # installs the compute copies
        for _, _, master, compute in m._local_mp.slots:
            assert torch.equal(compute, master.to(compute.dtype))
        m._local_mp.uninstall()


def test_clip_grad_norm_matches_fp64_and_fused_path(one_rank):
    """fp32 per-tensor norms vs an fp64 reference (tolerance: fp32 accumulation over ~1e4
    elements, relative error well below 1e-5); the fused-AdamW path (clip factor as the
    optimizer's grad_scale, no pass over the gradients) vs scaling the gradients first."""
    cfg = load_config(DEBUG, SMALL)
    pd = build_mesh(cfg, "cpu")
    x, y = _batches(1)[0]
    params = []
    for fused in (None, True):
        m = build_model(cfg, pd, torch.device("cpu"), bf16=False)
        opt = build_optimizer(m, cfg, fused=fused)
        (m(x, y) + m.aux_loss()).backward()
        finish_grads(m, pd)
        ref = torch.stack([p.grad.double().square().sum() for p in m.parameters()]).sum().sqrt()
        norm = clip_grad_norm_(m, pd, 0.5, opt)
        assert norm.dtype == torch.float32 and abs(norm.item() - ref.item()) <= 1e-6 * ref.item()
        assert ref.item() > 0.5  # the clip is active, so the two paths are really compared
        if fused:
            assert opt.grad_scale is not None and abs(opt.grad_scale.item() - (ref.item() + 1e-6) / 0.5) < 1e-5
        opt.step()
        params.append([p.detach().clone() for p in m.parameters()])
    # fused vs foreach AdamW and g/(1/c) vs g*c: a few fp32 ulps per element after one step.
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_coalesced_router_bias_update_equals_per_layer(one_rank):
    """update_router_biases with counts all-reduced once for all layers == each layer's own
    update_bias(group) (one all-reduce per layer), on adversarial counts: ties with the mean
    (sign 0), an expert with no tokens, one expert with all of them."""
    cfg = load_config(DEBUG, SMALL + ["model.n_layers=4"])
    a, b = Transformer(cfg.model), Transformer(cfg.model)
    counts = torch.tensor([[4, 4, 4, 4], [0, 5, 5, 6], [0, 0, 16, 0]])
    assert len(a.moe_layers()) == 3
    for m_a, m_b, c in zip(a.moe_layers(), b.moe_layers(), counts):
        m_a.router.tokens_since_update.copy_(c)
        m_b.router.tokens_since_update.copy_(c + 7)   # stale running counts: must be replaced
        m_a.update_bias(dist.group.WORLD)
    update_router_biases(b, counts)
    rate = cfg.model.moe.bias_update_rate
    expect = rate * torch.tensor([[0., 0, 0, 0], [1, -1, -1, -1], [1, 1, -1, 1]])  # sign(mean - count)
    for i, (m_a, m_b) in enumerate(zip(a.moe_layers(), b.moe_layers())):
        assert torch.equal(m_a.router.expert_bias, m_b.router.expert_bias)
        torch.testing.assert_close(m_b.router.expert_bias, expect[i], rtol=0, atol=0)
        assert int(m_b.router.tokens_since_update.sum()) == 0


@pytest.mark.parametrize("mode", ["moe", "full"])
def test_activation_checkpoint_changes_nothing(one_rank, mode):
    """Recomputation must give the same losses, gradients and router-bias updates as keeping the
    activations (bitwise: the same ops on the same inputs). The bias check catches the router
    counting its tokens twice in the recomputed forward."""
    cfg = load_config(DEBUG, SMALL)
    pd = build_mesh(cfg, "cpu")
    out = {}
    for ac in ("none", mode):
        m = build_model(cfg, pd, torch.device("cpu"), bf16=False)
        m.set_activation_checkpoint(ac)
        opt = build_optimizer(m, cfg)
        losses = []
        for x, y in _batches(3):
            ce = m(x, y)
            (ce + m.aux_loss()).backward()
            finish_grads(m, pd)
            clip_grad_norm_(m, pd, 0.5, opt)
            opt.step()
            opt.zero_grad()
            update_router_biases(m, torch.stack([l.last_stats.tokens_per_expert for l in m.moe_layers()]))
            losses.append(ce.item())
        out[ac] = (losses, [p.detach().clone() for p in m.parameters()],
                   [l.router.expert_bias.clone() for l in m.moe_layers()])
    assert out["none"][0] == out[mode][0]
    assert all(torch.equal(p, q) for p, q in zip(out["none"][1], out[mode][1]))
    assert all(torch.equal(p, q) for p, q in zip(out["none"][2], out[mode][2]))


def test_compiled_dense_block_and_loss_match_eager():
    """torch.compile of the dense block, dense MLP and loss traces whole graphs (fullgraph=True),
    once per function for all blocks, and computes what eager does. aot_eager runs the traced
    graphs without code generation (fast); the inductor path runs in test_train_loop.py."""
    from torch._dynamo.utils import counters
    cfg = load_config(DEBUG, SMALL)
    x, y = _batches(1)[0]
    res = []
    counters.clear()
    for compiled in (False, True):
        m = Transformer(cfg.model, seed=0)
        m.set_compile(compiled, backend="aot_eager")
        for _ in range(2):
            loss = m(x, y)
            loss.backward()
        res.append((loss.detach(), [p.grad for p in m.parameters()]))
    assert counters["stats"]["unique_graphs"] == 3   # attention_residual, dense_mlp, lm_loss
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-6, atol=0)
    for a, b in zip(res[1][1], res[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
