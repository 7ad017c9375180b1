"""train.optimizer = "adamw_bf16_grads" (train/optim.py): AdamW over the one-rank fp32 masters that
reads the bf16 gradients and writes the bf16 compute copies.

* the update (PyTorch path) against torch.optim.AdamW on the same (bf16-valued) gradients;
* the Triton kernel against the PyTorch path, under TRITON_INTERPRET=1 in a child process;
* in the training step on CPU (bf16, one rank): the same losses and masters as torch's AdamW, the
  compute copies equal to bf16(master) after every step without a refresh, the clipping norm over
  the kept bf16 gradients, state_dict round trip, and the errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _train import one_rank_group, token_batches
from train.config import load_config
from train.optim import AdamWBf16Grads, adamw_step_ref
from train.parallelize import build_mesh, build_model, build_optimizer, clip_grad_norm_, finish_grads

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ROOT / "configs" / "debug_cpu.toml"
SMALL = ["model.dim=32", "model.n_heads=2", "model.dense_inter_dim=64", "model.moe.moe_inter_dim=32",
         "model.moe.num_experts=4", "model.n_layers=3", "data.seq_len=16", "train.grad_clip=0.5", "train.dtype=bf16"]


def test_update_matches_torch_adamw():
    """Five steps of adamw_step_ref on bf16 gradients == torch's AdamW on the same values in fp32
    (torch blends m with lerp, we with mul + add: equal to fp32 rounding)."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=g)
    ours, ref = p0.clone(), torch.nn.Parameter(p0.clone())
    m, v = torch.zeros_like(p0), torch.zeros_like(p0)
    copy = torch.empty(1000, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for t in range(1, 6):
        grad = torch.randn(1000, generator=g).bfloat16()
        scale = torch.tensor(1.7)
        adamw_step_ref(ours, grad, m, v, copy, 3e-3, 0.9, 0.95, 1e-8, 0.1, t, scale)
        ref.grad = grad.float() / scale
        opt.step()
        torch.testing.assert_close(ours, ref.detach(), rtol=2e-6, atol=2e-7)
        assert torch.equal(copy, ours.bfloat16())
    assert opt.state[ref]["exp_avg"].sub(m).abs().max() < 1e-6


_KERNEL_CHILD = r"""
import torch
from train.optim import adamw_step_ref, AdamWBf16Grads, _use_kernel
import train.optim as o
assert _use_kernel(torch.empty(1)), "interpreter not active"
g = torch.Generator().manual_seed(1)
for n, scaled, with_copy in ((5000, True, True), (2048, False, True), (37, True, False), (0, False, True)):
    p = torch.randn(n, generator=g); m = torch.randn(n, generator=g).abs() * 0.1; v = torch.rand(n, generator=g) * 0.01
    grad = torch.randn(n, generator=g).bfloat16()
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    cr, ck = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    scale = torch.tensor(2.5) if scaled else None
    adamw_step_ref(pr, grad, mr, vr, cr if with_copy else None, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, scale)
    opt = AdamWBf16Grads.__new__(AdamWBf16Grads)
    opt.grad_scale = scale
    opt._update(p, grad, m, v, ck if with_copy else None, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3)
    for a, b in ((p, pr), (m, mr), (v, vr)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if with_copy:
        assert torch.equal(ck, p.bfloat16())
# the copy's rounding on the bits: specials, the fp32 max (-> inf), ties, denormals, NaNs of any sign
bits = torch.tensor([0xFFFFFFFF, 0xFFFF8000, 0x7FC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000,
                     0x3F818000, 0x00000001, 0x80000000, 0x007FFFFF], dtype=torch.int64).to(torch.int32)
p = bits.view(torch.float32).clone()
ck = torch.empty(p.numel(), dtype=torch.bfloat16)
opt = AdamWBf16Grads.__new__(AdamWBf16Grads)
opt.grad_scale = None
opt._update(p, torch.zeros(p.numel(), dtype=torch.bfloat16), torch.zeros_like(p), torch.zeros_like(p), ck,
            0.0, 0.9, 0.95, 1e-8, 0.0, 1)
want = bits.view(torch.float32).bfloat16()
nan = want.isnan()
assert torch.equal(ck.isnan(), nan), (ck, want)   # NaN stays NaN (its payload is not kept)
assert torch.equal(ck[~nan].view(torch.int16), want[~nan].view(torch.int16)), (ck.view(torch.int16), want.view(torch.int16))
print("kernel ok")
"""


def test_kernel_matches_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _KERNEL_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "kernel ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_group():
        yield


_batches = token_batches


def test_training_steps_match_torch_adamw(one_rank, monkeypatch):
    cfg_ref = load_config(DEBUG, SMALL)
    cfg = load_config(DEBUG, SMALL + ["train.optimizer=adamw_bf16_grads"])
    pd = build_mesh(cfg, "cpu")
    ref = build_model(cfg_ref, pd, torch.device("cpu"), bf16=True)
    ours = build_model(cfg, pd, torch.device("cpu"), bf16=True)
    ours.load_state_dict(ref.state_dict())
    opt_ref, opt = build_optimizer(ref, cfg_ref), build_optimizer(ours, cfg)
    assert isinstance(opt, AdamWBf16Grads) and ours._local_mp.keep_grads
    lmp = ours._local_mp
    refreshes = []
    real_refresh = lmp.refresh
    monkeypatch.setattr(lmp, "refresh", lambda: (refreshes.append(1), real_refresh()))
    for i, (x, y) in enumerate(_batches(4)):
        norms, losses = [], []
        for model, o in ((ref, opt_ref), (ours, opt)):
            ce = model(x, y)
            (ce + model.aux_loss()).backward()
            finish_grads(model, pd)
            if model is ours:  # the gradients stay bf16 and out of the masters
                assert all(p.grad is None for p in ours.parameters()) and lmp.pending_grads()
                assert all(g.dtype == torch.bfloat16 for g in lmp.pending_grads())
            norms.append(clip_grad_norm_(model, pd, 0.5, o))
            o.step()
            o.zero_grad(set_to_none=True)
            losses.append(ce.item())
        # the bf16 gradients are those torch's path casts to fp32: equal norms and losses up to
        # fp32 summation order
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
        assert abs(losses[0] - losses[1]) < 1e-4 * max(1.0, abs(losses[0])), (i, losses)
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
        for _, _, master, compute in lmp.slots:  # written by the update itself
            assert torch.equal(compute, master.detach().bfloat16())
        assert not lmp.pending_grads()
    assert len(refreshes) == 1, f"the compute copies were refreshed {len(refreshes)} times (once expected)"
    # a model load replaces the masters: the next forward refreshes
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():  # (a no-grad forward puts the masters back when it ends)
        ours(*_batches(1)[0])
    assert len(refreshes) == 2 and not lmp.installed
    # state_dict round trip: torch AdamW's keys
    sd = opt.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == 4.0
    opt2 = build_optimizer(ours, cfg)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], st["exp_avg"])


def test_second_gradient_in_a_step_sums_in_fp32(one_rank):
    """Two backwards before a step (accumulation): the kept gradient becomes fp32 g1 + g2, as the
    cast path's master.grad; the norm and the update take it."""
    cfg = load_config(DEBUG, SMALL + ["train.optimizer=adamw_bf16_grads"])
    pd = build_mesh(cfg, "cpu")
    m = build_model(cfg, pd, torch.device("cpu"), bf16=True)
    opt = build_optimizer(m, cfg)
    assert "fused" not in opt.defaults and opt.applies_grad_scale
    (x, y), = _batches(1)
    got = []
    for _ in range(2):
        m(x, y).backward()
        got.append([None if g is None else g.clone() for g in m._local_mp.grads])
    finish_grads(m, pd)
    for g1, g2 in zip(*got):
        if g1 is not None:
            assert g2.dtype == torch.float32 and torch.equal(g2, g1.float() * 2)
    clip_grad_norm_(m, pd, 0.5, opt)
    assert opt.grad_scale is not None  # the clip factor goes to the update
    opt.step()
    assert not m._local_mp.pending_grads()


def test_config_and_build_errors(one_rank):
    with pytest.raises(ValueError, match=r"train.optimizer='sgd' must be one of"):
        load_config(DEBUG, SMALL + ["train.optimizer=sgd"])
    cfg = load_config(DEBUG, [s for s in SMALL if s != "train.dtype=bf16"] + ["train.dtype=fp32",
                                                                             "train.optimizer=adamw_bf16_grads"])
    pd = build_mesh(cfg, "cpu")
    m = build_model(cfg, pd, torch.device("cpu"), bf16=False)
    with pytest.raises(ValueError, match=r"train.optimizer='adamw_bf16_grads' needs bf16 training on one rank"):
        build_optimizer(m, cfg)


def test_auto_picks_bf16_grads_only_where_it_applies(one_rank):
    """``train.optimizer = "auto"`` (the h200_1gpu recipe): AdamWBf16Grads on one bf16 rank, torch's
    AdamW where the bf16-gradient update does not apply (fp32 here; more ranks likewise) -- so the
    recipe still runs under bench/scaling.py at ep = 2 instead of failing."""
    cfg = load_config(DEBUG, SMALL + ["train.optimizer=auto"])
    pd = build_mesh(cfg, "cpu")
    assert isinstance(build_optimizer(build_model(cfg, pd, torch.device("cpu"), bf16=True), cfg), AdamWBf16Grads)
    cfg32 = load_config(DEBUG, [s for s in SMALL if s != "train.dtype=bf16"] + ["train.dtype=fp32",
                                                                               "train.optimizer=auto"])
    opt = build_optimizer(build_model(cfg32, build_mesh(cfg32, "cpu"), torch.device("cpu"), bf16=False), cfg32)
    assert type(opt) is torch.optim.AdamW


def test_h200_recipe_selects_auto():
    from train.pretrain import CONFIGS

    assert load_config(str(CONFIGS / "h200_1gpu.toml"), []).train.optimizer == "auto"


@pytest.mark.parametrize("target", [90, 100, "gfx942"])
@pytest.mark.parametrize("grad", ["bf16", "fp32"])
def test_kernel_compiles(target, grad):
    """The update kernel compiles for every GPU the recipes name (CI tier T2), with 16-byte vector
    accesses to the fp32 master and moments on NVIDIA when the element count is a multiple of 16
    (the JIT's specialisation for every weight of the recipes)."""
    import triton
    from triton.compiler import ASTSource

    from test_tlx_compile import _target
    from train.optim import _adamw_kernel

    sig = {"p_ptr": "*fp32", "g_ptr": f"*{grad}", "m_ptr": "*fp32", "v_ptr": "*fp32", "c_ptr": "*bf16",
           "scale_ptr": "*fp32", "n": "i32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32",
           "decay": "fp32", "step_size": "fp32", "bc2_sqrt": "fp32", "HAS_COPY": "constexpr",
           "HAS_SCALE": "constexpr", "BLOCK": "constexpr"}
    names = _adamw_kernel.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*") or k == "n"}
    k = triton.compile(ASTSource(_adamw_kernel, sig, constexprs={"HAS_COPY": True, "HAS_SCALE": True, "BLOCK": 2048},
                                 attrs=attrs), target=_target(target), options={"num_warps": 8})
    if isinstance(target, int):
        ptx = k.asm["ptx"]
        assert "ld.global.v4.b32" in ptx or "ld.global.v4.f32" in ptx, "fp32 loads are not 16-byte vectors"
    else:
        assert len(k.asm["hsaco"]) > 0


@pytest.mark.release  # resume through the CLI stays fast in test_train_dist / test_train_cli
def test_cli_checkpoint_resume_with_the_bf16_grads_optimizer(tmp_path):
    """Through the CLI (DCP checkpoints, get_state_dict's state initialisation included): a 6-step
    job killed after its checkpoint at step 3, resumed, logs the uninterrupted run's losses for
    steps 4-6; and the same losses as torch's AdamW to fp32 rounding."""
    import json

    def run(ck, out, opt="adamw_bf16_grads", crash=0):
        args = [sys.executable, "-m", "train.pretrain", "--config", str(DEBUG), "--losses-out", str(out)]
        for o in SMALL + [f"train.optimizer={opt}", "train.steps=6", "train.warmup_steps=2", f"train.crash_at_step={crash}",
                          "metrics.progress=false", f"checkpoint.dir='{ck}'", "checkpoint.every=3"]:
            args += ["--override", o]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if crash:
            assert r.returncode != 0 and (Path(ck) / "step_3").is_dir(), r.stdout[-2000:] + r.stderr[-2000:]
            return None
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return json.loads(Path(out).read_text())

    whole = run(tmp_path / "ck_whole", tmp_path / "whole.json")
    run(tmp_path / "ck", tmp_path / "a.json", crash=3)
    resumed = run(tmp_path / "ck", tmp_path / "b.json")
    ref = run(tmp_path / "ck_ref", tmp_path / "ref.json", opt="adamw")
    assert len(whole) == 6 and len(resumed) == 3, (whole, resumed)
    assert resumed == whole[3:], (resumed, whole)
    assert max(abs(a - b) for a, b in zip(whole, ref)) < 1e-3, (whole, ref)
