"""Expert parallelism: the same global batch and weights through EP=1 (this process) and EP=2, 4
(gloo, separate processes) give the same outputs and gradients within fp32 rounding.

EP=W rank r holds tokens [r*T/W, (r+1)*T/W) and experts [r*e, (r+1)*e). Expected: its output rows
and dx equal the EP=1 slices; its expert grads equal the EP=1 expert slices (every token routed
to those experts arrives at rank r); replicated params' grads summed over ranks equal EP=1's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _util import make_cfg
from tlx_dist import MoELayer

T_GLOBAL = 32
CFGS = {
    "softmax_shared": dict(num_experts=8, top_k=2, num_shared_experts=1),
    "sigmoid_k3": dict(num_experts=8, top_k=3, score_func="sigmoid", route_scale=2.0),
}


def _batch(cfg):
    g = torch.Generator().manual_seed(42)
    x = torch.randn(T_GLOBAL, cfg.dim, generator=g)
    dy = torch.randn(T_GLOBAL, cfg.dim, generator=g)
    return x, dy


def _run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * dy).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, layer.last_stats.tokens_per_expert


def _ep_worker(rank, world):
    results = {}
    for name, cfg_kw in CFGS.items():  # one process group for every config: start-up dominates
        cfg = make_cfg(**cfg_kw)
        torch.manual_seed(0)
        layer = MoELayer(cfg, ep_group=dist.group.WORLD)
        x, dy = _batch(cfg)
        n = T_GLOBAL // world
        rows = slice(rank * n, (rank + 1) * n)
        out, dx, grads, counts = _run(layer, x[rows], dy[rows])
        results[name] = dict(out=out, dx=dx, grads=grads, counts=counts, expert_range=layer.expert_range)
    return results


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.release)])
def test_ep_matches_single_rank(world):
    all_res = run_world(_ep_worker, world)
    for name in CFGS:
        _compare(name, world, [r[name] for r in all_res])


def _compare(name, world, res):
    cfg = make_cfg(**CFGS[name])
    torch.manual_seed(0)
    full = MoELayer(cfg)
    x, dy = _batch(cfg)
    out1, dx1, grads1, counts1 = _run(full, x, dy)
    n = T_GLOBAL // world
    close = dict(rtol=1e-5, atol=1e-6)  # fp32 rounding: only the row grouping inside GEMMs differs
    for r, rr in enumerate(res):
        rows = slice(r * n, (r + 1) * n)
        torch.testing.assert_close(rr["out"], out1[rows], **close)
        torch.testing.assert_close(rr["dx"], dx1[rows], **close)
        lo, hi = rr["expert_range"]
        assert (lo, hi) == (r * cfg.num_experts // world, (r + 1) * cfg.num_experts // world)
        torch.testing.assert_close(rr["grads"]["w13"], grads1["w13"][lo:hi], **close)
        torch.testing.assert_close(rr["grads"]["w2"], grads1["w2"][lo:hi], **close)
    for pname in grads1:
        if pname in ("w13", "w2"):
            continue
        summed = sum(rr["grads"][pname] for rr in res)
        torch.testing.assert_close(summed, grads1[pname], **close)
    assert torch.equal(sum(rr["counts"] for rr in res), counts1)
