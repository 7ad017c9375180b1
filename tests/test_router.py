"""Router: gates, selection, hand-computed aux/z losses, aux-loss-free bias balancing."""

from __future__ import annotations

import math

import pytest
import torch

from _util import make_cfg
from tlx_dist import MoELayer, Router
from tlx_dist.router import expert_counts


def test_gates_softmax_normalised():
    torch.manual_seed(0)
    r = Router(make_cfg(dtype="float64", top_k=3))
    x = torch.randn(10, 16, dtype=torch.float64)
    out = r(x)
    probs = torch.softmax(x @ r.weight.T, -1)
    top = probs.topk(3, -1)
    assert torch.equal(out.idx_TK, top.indices)
    torch.testing.assert_close(out.gate_TK, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(out.gate_TK.sum(-1), torch.ones(10, dtype=torch.float64))


def test_gates_sigmoid_scaled_unnormalised():
    torch.manual_seed(0)
    r = Router(make_cfg(dtype="float64", score_func="sigmoid", route_norm=False, route_scale=2.5))
    x = torch.randn(10, 16, dtype=torch.float64)
    out = r(x)
    s = torch.sigmoid(x @ r.weight.T)
    torch.testing.assert_close(out.gate_TK, 2.5 * s.gather(1, out.idx_TK))


def test_aux_and_z_loss_hand_computed():
    """A 2-token, 2-expert, K=1 example worked out by hand."""
    r = Router(make_cfg(dim=2, num_experts=2, top_k=1, dtype="float64", aux_loss_coef=0.1, z_loss_coef=0.01))
    with torch.no_grad():
        r.weight.copy_(torch.eye(2, dtype=torch.float64))
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)  # both tokens pick expert 0
    out = r(x)
    p1 = [math.exp(1) / (math.exp(1) + 1), 1 / (math.exp(1) + 1)]
    p2 = [math.exp(2) / (math.exp(2) + 1), 1 / (math.exp(2) + 1)]
    P = [(p1[0] + p2[0]) / 2, (p1[1] + p2[1]) / 2]
    f = [1.0, 0.0]
    aux = 0.1 * 2 * (f[0] * P[0] + f[1] * P[1])
    z = 0.01 * (math.log(math.exp(1) + 1) ** 2 + math.log(math.exp(2) + 1) ** 2) / 2
    assert out.idx_TK.tolist() == [[0], [0]]
    assert float(out.stats.aux_loss.detach()) == pytest.approx(aux, rel=1e-12)
    assert float(out.stats.z_loss.detach()) == pytest.approx(z, rel=1e-12)
    assert out.stats.tokens_per_expert.tolist() == [2, 0]
    assert float(out.stats.load_imbalance()) == pytest.approx(2.0)


def test_bias_steers_selection_not_gates():
    torch.manual_seed(0)
    r = Router(make_cfg(dtype="float64", load_balance_bias=True, top_k=2))
    x = torch.randn(6, 16, dtype=torch.float64)
    r.expert_bias[5] = 10.0
    out = r(x)
    assert (out.idx_TK == 5).any(1).all()
    probs = torch.softmax(x @ r.weight.T, -1)
    g = probs.gather(1, out.idx_TK)
    torch.testing.assert_close(out.gate_TK, g / g.sum(-1, keepdim=True))


def test_expert_counts_invariants():
    idx = torch.tensor([[0, 3], [3, 1], [3, 0]])
    c = expert_counts(idx, 5)
    assert c.tolist() == [2, 1, 0, 3, 0]
    assert int(c.sum()) == idx.numel()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_bias_balancing_moves_skewed_load_to_uniform(score_func):
    """Skew the router towards experts 0-1 (about 2.6x the mean load), then let the aux-loss-free
    bias rebalance over 50 steps of fresh batches, as a training loop would."""
    torch.manual_seed(0)
    cfg = make_cfg(num_experts=8, top_k=2, load_balance_bias=True, bias_update_rate=0.005, score_func=score_func)
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.weight[:2] += 0.15
    layer.train()
    imbalance = []
    for _ in range(50):
        x = torch.randn(512, 16) + 0.5
        with torch.no_grad():
            layer(x)
        imbalance.append(float(layer.last_stats.load_imbalance()))
        counts = layer.update_bias()
        assert int(counts.sum()) == 512 * 2
        assert int(layer.router.tokens_since_update.sum()) == 0
    first, last = imbalance[0], sum(imbalance[-10:]) / 10
    assert first > 2.2, first
    assert last < 1.3, imbalance[-10:]
    assert layer.router.expert_bias[:2].max() < layer.router.expert_bias[2:].min()


def test_update_bias_requires_flag():
    layer = MoELayer(make_cfg())
    with pytest.raises(RuntimeError, match="load_balance_bias"):
        layer.update_bias()
