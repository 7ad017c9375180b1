"""Helpers shared by the CPU tests (not collected: no test_ prefix)."""

from __future__ import annotations

import dataclasses

import torch

from tlx_dist import MoEConfig, MoELayer, moe_reference


def make_cfg(**kw) -> MoEConfig:
    base = dict(dim=16, moe_inter_dim=12, num_experts=8, top_k=2, init_std=0.3)
    base.update(kw)
    return MoEConfig(**base)


def with_dtype(cfg: MoEConfig, dtype: str) -> MoEConfig:
    return dataclasses.replace(cfg, dtype=dtype)


def clone_layer(layer: MoELayer, dtype: str) -> MoELayer:
    """Same weights and bias, another dtype (single rank)."""
    other = MoELayer(with_dtype(layer.cfg, dtype))
    other.load_state_dict({k: v.to(other.state_dict()[k].dtype) for k, v in layer.state_dict().items()})
    return other


def reference_of(layer: MoELayer, x_TD: torch.Tensor):
    """Runs the naive loop on the layer's (global, single-rank) weights, in x_TD's dtype."""
    dt = x_TD.dtype
    p = {n: t.detach().to(dt).requires_grad_(True) for n, t in layer.named_parameters()}
    out = moe_reference(x_TD, p["router.weight"], p["w13"], p["w2"], layer.cfg,
                        p.get("shared_w13"), p.get("shared_w2"), layer.router.expert_bias)
    return out, p
