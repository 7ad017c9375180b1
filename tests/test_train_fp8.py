"""Training with FP8 experts (``model.moe.precision = "fp8"``) on CPU, where the FP8 layer runs its
reference path: the recipe key loads on the H200 recipe and is validated; the optimizer hook
remakes the FP8 weight copies once per optimizer step whatever the number of micro-batches (and
the fused AdamW, which bumps no version counter, still updates them); a short run's loss falls; and
``train.plot`` overlays the loss curves of two runs (the bf16 / fp8 comparison plot).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _train import DEBUG, TINY, one_rank_group, run_pretrain

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "configs" / "h200_1gpu.toml"


def test_recipe_key_on_the_h200_recipe():
    from train.config import load_config

    assert load_config(H200).model.moe.precision == "bf16"
    cfg = load_config(H200, ["model.moe.precision=fp8"])
    assert cfg.model.moe.precision == "fp8"
    with pytest.raises(ValueError, match=r"model\.moe\.precision='fp4' must be one of"):
        load_config(H200, ["model.moe.precision=fp4"])


@pytest.mark.parametrize("fused", [False, True], ids=["foreach_adamw", "fused_adamw"])
def test_fp8_weights_remade_once_per_optimizer_step(fused):
    from train.config import load_config
    from train.data import ByteLoader
    from train.parallelize import build_mesh, build_model, build_optimizer, finish_grads
    from train.pretrain import accumulate_grads

    accum, steps = 3, 2
    cfg = load_config(DEBUG, TINY + ["model.moe.precision=fp8", "train.dtype=fp32", f"train.grad_accum={accum}",
                                     "data.batch_size=2"])
    with one_rank_group():
        pd = build_mesh(cfg, "cpu")
        model = build_model(cfg, pd, torch.device("cpu"), bf16=False)
        opt = build_optimizer(model, cfg, fused=fused)
        loader = ByteLoader(cfg.data, pd.rank, pd.world, grad_accum=accum)
        layers = model.moe_layers()
        assert layers and all(m.precision == "fp8" and m.fp8_refresh == "step" for m in layers)
        for step in range(1, steps + 1):
            w = layers[0].w13.detach().clone()
            accumulate_grads(model, pd, loader, accum)
            finish_grads(model, pd)
            # two weights per layer, once for the step's `accum` micro-batches
            assert [m.fp8_quantizations for m in layers] == [2 * step] * len(layers)
            opt.step()
            opt.zero_grad()
            assert not torch.equal(layers[0].w13.detach(), w)
        # the copies the next forward uses are those of the updated weights
        from tlx_dist.fp8 import quantize_weight

        accumulate_grads(model, pd, loader, 1)
        q = layers[0]._fp8_weights()[0]
        assert torch.equal(q.q_EDF.view(torch.uint8), quantize_weight(layers[0].w13.detach()).q_EDF.view(torch.uint8))


@pytest.mark.slow
def test_short_fp8_run_loss_falls_and_plots_beside_bf16(tmp_path):
    common = TINY + ["train.steps=30", "train.log_every=5"]
    runs = {}
    for prec in ("bf16", "fp8"):
        out_dir = tmp_path / prec
        losses, out = run_pretrain(common + [f"model.moe.precision={prec}", f"metrics.out_dir='{out_dir}'"],
                                   tmp_path, prec)
        runs[prec] = (losses, out_dir / "metrics.jsonl")
    losses = runs["fp8"][0]
    assert len(losses) == 30
    first, last = losses[0], sum(losses[-5:]) / 5
    assert first > 5.0 and last < first - 1.0, (first, last)
    # the two curves part by quantization noise only, far less than what training moved
    gap = abs(last - sum(runs["bf16"][0][-5:]) / 5)
    assert gap < 0.1 * (first - last), (gap, first, last)

    from train.plot import plot_compare

    png = plot_compare([runs["bf16"][1], runs["fp8"][1]], ["bf16", "fp8"], tmp_path / "cmp")
    assert png.exists() and png.stat().st_size > 1000
    recs = [json.loads(line) for line in runs["fp8"][1].read_text().splitlines() if line.strip()]
    assert recs and all("loss" in r for r in recs)
