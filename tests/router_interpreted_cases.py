"""The one-launch router (``tlx/portable/router.py``: scores, top-K, gates, the losses' sums, and its
backward) under the Triton interpreter, against the torch ops of ``tlx_dist.router.Router``
(``Router(kernel=False)``) and an fp64 recomputation from the kernel's own selection:
random and adversarial logits (ties, a NaN row, a +inf row, -inf entries), softmax and sigmoid,
with and without the normalisation, the balancing bias and a scale, non-power-of-two E, K = 1 and
K = E, every gradient. Run by tests/test_router_kernel.py in a child pytest (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _util import make_cfg  # noqa: E402
from tlx_dist import Router  # noqa: E402
from tlx_dist.router import _router_kernel_runs  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_router_kernel.py (needs TRITON_INTERPRET=1)")


def _run(router, x, kernel: bool, w_TK=None):
    """Forward + backward of ``sum(gate * w) + aux + z`` with the router kernel on or off (the torch
    ops); returns (out, loss, dx, dW)."""
    router.kernel = kernel
    x = x.detach().clone().requires_grad_(True)
    router.zero_grad(set_to_none=True)
    out = router(x)
    w = w_TK if w_TK is not None else torch.ones_like(out.gate_TK)
    loss = (out.gate_TK * w).nansum() + out.stats.aux_loss + out.stats.z_loss
    loss.backward()
    return out, loss.detach(), x.grad, router.weight.grad.clone()


def _ref64(logits, idx, cfg, bias=None):
    """fp64 gates and losses given the selection ``idx`` (the definitions in tlx_dist/router.py)."""
    lg = logits.double()
    p = torch.softmax(lg, -1) if cfg.score_func == "softmax" else torch.sigmoid(lg)
    g = p.gather(1, idx)
    if cfg.route_norm:
        g = g / (g.sum(-1, keepdim=True) + 1e-20)
    g = g * cfg.route_scale
    fin = torch.isfinite(lg).all(-1)
    n = fin.sum().double().clamp_min(1.0)
    q = p if cfg.score_func == "softmax" else p / (p.sum(-1, keepdim=True) + 1e-20)
    f = torch.zeros(cfg.num_experts, dtype=torch.float64).scatter_add_(
        0, idx.reshape(-1), fin[:, None].expand_as(idx).double().reshape(-1)) / (n * cfg.top_k)
    P = torch.where(fin[:, None], q, 0.0).sum(0) / n
    aux = cfg.aux_loss_coef * cfg.num_experts * (f * P).sum()
    z = cfg.z_loss_coef * torch.where(fin, torch.logsumexp(lg, -1), 0.0).square().sum() / n
    return g, aux, z


CASES = [  # (E, K, score_func, route_norm, route_scale, bias)
    (8, 2, "softmax", True, 1.0, False), (8, 2, "softmax", False, 2.5, False), (12, 3, "sigmoid", True, 1.0, True),
    (12, 4, "sigmoid", False, 1.7, False), (64, 8, "softmax", True, 1.0, True), (6, 1, "softmax", False, 1.0, False),
    (6, 6, "sigmoid", True, 1.0, False), (5, 5, "softmax", True, 1.0, True),
]


@pytest.mark.parametrize("E,K,score,norm,scale,bias", CASES)
@pytest.mark.parametrize("T", [1, 45])
def test_router_kernel_matches_torch_ops(E, K, score, norm, scale, bias, T):
    cfg = make_cfg(dim=24, num_experts=E, top_k=K, score_func=score, route_norm=norm, route_scale=scale,
                   load_balance_bias=bias, aux_loss_coef=0.03, z_loss_coef=0.002, dtype="float32", init_std=0.5)
    torch.manual_seed(E * 100 + K * 10 + T)
    r = Router(cfg)
    if bias:
        with torch.no_grad():
            r.expert_bias.copy_(torch.randn(E) * 0.05)
    x = torch.randn(T, 24)
    w = torch.randn(T, K)
    assert _router_kernel_runs(torch.zeros(1, E), cfg)
    ko, kl, kdx, kdw = _run(r, x, True, w)
    to, tl_, tdx, tdw = _run(r, x, False, w)
    assert torch.equal(ko.idx_TK, to.idx_TK)
    assert ko.idx_TK.dtype == torch.int64 and ko.gate_TK.dtype == torch.float32
    torch.testing.assert_close(ko.gate_TK, to.gate_TK, rtol=1e-6, atol=1e-7)
    assert torch.equal(ko.stats.tokens_per_expert, to.stats.tokens_per_expert)
    assert ko.stats.tokens_per_expert.dtype == torch.int64
    torch.testing.assert_close(ko.stats.aux_loss, to.stats.aux_loss, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(ko.stats.z_loss, to.stats.z_loss, rtol=1e-5, atol=1e-8)
    for a, b, name in ((kdx, tdx, "dx"), (kdw, tdw, "dW")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)
    # and against fp64 from the definitions
    g64, aux64, z64 = _ref64(ko.stats.logits_TE.detach(), ko.idx_TK, cfg)
    torch.testing.assert_close(ko.gate_TK.double(), g64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ko.stats.aux_loss.double(), aux64, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(ko.stats.z_loss.double(), z64, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
def test_router_kernel_adversarial_rows(score, norm):
    """Crafted logits straight into the kernel: a tie (constant row), a NaN entry, a +inf entry,
    -inf entries, saturating values, near-ties. The K picks are distinct experts in [0, E) in every
    row and a valid top-K of the scores (smallest index first among equal ones); rows with a clear
    margin pick what torch.topk picks; gates, the aux loss's score sums, the slot counts and the z
    loss's sum equal the fp64 definitions given those picks (non-finite rows left out of the losses,
    NaN gates where a picked score is NaN); the logits' gradient equals fp64 autograd on every row whose
    scores are numbers."""
    from tlx_dist.router import _RouteKernel

    E, K, scale = 8, 3, 1.3
    torch.manual_seed(3)
    lg = torch.randn(9, E) * 2
    lg[1] = 0.5                                            # ties everywhere
    lg[2, 3] = float("nan")                                # NaN entry
    lg[3, 5] = float("inf")                                # +inf entry
    lg[4, [0, 6]] = float("-inf")                          # -inf entries
    lg[5] = torch.tensor([80.0, -80, 79, 3, -2, 60, 0, 1])  # saturating
    lg[6] = torch.tensor([1e-7, 2e-7, 0, 0, 0, 0, 0, 3e-7])  # near-ties
    bias = torch.randn(E) * 0.01
    soft = score == "softmax"
    lk = lg.clone().requires_grad_(True)
    idx, gate, q_E, zsum, fin_slots, slots, n_fin = _RouteKernel.apply(lk, bias, K, soft, norm, scale)
    assert ((idx >= 0) & (idx < E)).all() and all(len(set(row)) == K for row in idx.tolist())
    p32 = torch.softmax(lg, -1) if soft else torch.sigmoid(lg)
    sel = p32 + bias
    numeric = ~torch.isnan(sel).any(-1)
    picked = torch.zeros(9, E, dtype=torch.bool).scatter_(1, idx, True)
    for t in torch.nonzero(numeric).flatten().tolist():   # a valid top-K of the selection scores
        assert float(sel[t][picked[t]].min()) >= float(sel[t][~picked[t]].max()), t
    top = sel.topk(K + 1, -1).values
    clear = numeric & (top[:, K - 1] - top[:, K] > 1e-5)
    assert clear.sum() >= 4 and torch.equal(idx[clear], sel.topk(K, -1).indices[clear])
    # fp64 definitions given the kernel's picks, with autograd
    l64 = lg.double().requires_grad_(True)
    p = torch.softmax(l64, -1) if soft else torch.sigmoid(l64)
    g = p.gather(1, idx)
    if norm:
        g = g / (g.sum(-1, keepdim=True) + 1e-20)
    g = g * scale
    fin = torch.isfinite(lg).all(-1)
    q = p if soft else p / (p.sum(-1, keepdim=True) + 1e-20)
    q64 = torch.where(fin[:, None], q, 0.0).sum(0)
    z64 = torch.where(fin, torch.logsumexp(l64, -1), 0.0).square().sum()
    # NaN exactly where a picked score is NaN (a NaN score ranks last, so a sigmoid row with one NaN
    # logit routes around it; torch.topk would rank it first)
    torch.testing.assert_close(gate.double(), g.detach(), rtol=1e-5, atol=1e-7, equal_nan=True)
    if soft:  # a NaN or +inf logit makes the whole softmax row NaN
        assert (~numeric).sum() == 2 and torch.isnan(gate[~numeric]).all()
    else:     # sigmoid: only the NaN score is NaN, never picked
        assert (~numeric).sum() == 1 and not torch.isnan(gate).any()
    torch.testing.assert_close(q_E.double(), q64.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(zsum.double(), z64.detach(), rtol=1e-5, atol=1e-6)
    assert int(n_fin) == int(fin.sum())
    assert torch.equal(slots, torch.bincount(idx.reshape(-1), minlength=E))
    assert torch.equal(fin_slots.long(), torch.bincount(idx[fin].reshape(-1), minlength=E))
    w = torch.randn(9, K)
    wq, wz = torch.randn(E), 0.7
    ((gate[numeric] * w[numeric]).sum() + (q_E * wq).sum() + wz * zsum).backward()
    ((g[numeric] * w[numeric].double()).sum() + (q64 * wq.double()).sum() + wz * z64).backward()
    assert torch.isfinite(lk.grad[numeric]).all()
    # (torch's where-around-logsumexp gives NaN on a +inf row: 0 * softmax(row with +inf); the
    # kernel leaves those rows out of the z loss's gradient instead, so compare where it is a number)
    cmp = numeric & torch.isfinite(l64.grad).all(-1)
    assert cmp.sum() >= 6
    torch.testing.assert_close(lk.grad[cmp].double(), l64.grad[cmp], rtol=1e-4, atol=1e-6)


def test_router_kernel_one_expert_per_token_counts_all_rows():
    """K = 1, every token on expert 0 (a heavy imbalance), T not a multiple of the block: the counts
    cover every row, the aux loss is coef * E * P_0."""
    E = 16
    cfg = make_cfg(dim=E, num_experts=E, top_k=1, aux_loss_coef=0.1, z_loss_coef=0.0, dtype="float32")
    r = Router(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
    x = torch.randn(77, E)
    x[:, 0] = 50.0
    ko, *_ = _run(r, x, True)
    assert ko.stats.tokens_per_expert.tolist() == [77] + [0] * (E - 1)
    p0 = torch.softmax(x.double(), -1)[:, 0].mean()
    torch.testing.assert_close(ko.stats.aux_loss.double(), 0.1 * E * p0, rtol=1e-5, atol=0)
    assert float(ko.stats.z_loss) == 0.0


def test_router_kernel_moe_layer_matches():
    """A whole MoELayer forward + backward (reference experts) with the router kernel on and off."""
    from tlx_dist import MoELayer

    cfg = make_cfg(dim=16, num_experts=12, top_k=3, aux_loss_coef=0.01, z_loss_coef=1e-3, dtype="float32")
    torch.manual_seed(5)
    layer = MoELayer(cfg)
    x = torch.randn(23, 16)
    res = []
    for on in (True, False):
        layer.router.kernel = on
        xx = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(xx)
        loss = F.mse_loss(y, torch.ones_like(y)) + layer.aux_loss
        loss.backward()
        res.append((y.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y1, dx1, g1), (y0, dx0, g0) = res
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=1e-4, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_router_kernel_switch():
    cfg = make_cfg(dtype="float32")
    lg = torch.zeros(3, cfg.num_experts)
    assert _router_kernel_runs(lg, cfg)                                   # CPU, interpreted
    assert not _router_kernel_runs(lg.double(), cfg)                      # fp64 logits: the torch ops
    assert not _router_kernel_runs(lg[:0], cfg)                           # no tokens
    assert not _router_kernel_runs(lg, make_cfg(dtype="float32", num_experts=8, n_group=4, topk_group=2))
    assert not _router_kernel_runs(lg, cfg, wanted=False)                 # Router(kernel=False)
    assert Router(cfg).kernel and not Router(cfg, kernel=False).kernel
    with pytest.raises(TypeError, match=r"kernel='0' must be a bool"):
        Router(cfg, kernel="0")


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_kernel_partial_losses_and_nan_rows(score):
    """Only some outputs used (the unused ones' gradients arrive as None and their terms are skipped):
    gates only (aux and z coefficients 0), losses only (gates unused); each matches the torch ops.
    A sigmoid row with a NaN logit (the aux loss on): routed around the NaN, its logit gradient NaN
    only at that entry, every other row's untouched."""
    E, K = 12, 3
    torch.manual_seed(9)
    x = torch.randn(20, 24)
    for aux, z, use_gates in ((0.0, 0.0, True), (0.05, 0.01, False), (0.05, 0.0, True)):
        cfg = make_cfg(dim=24, num_experts=E, top_k=K, score_func=score, aux_loss_coef=aux, z_loss_coef=z,
                       dtype="float32", init_std=0.5)
        r = Router(cfg)
        grads = []
        for on in (True, False):
            r.kernel = on
            xx = x.clone().requires_grad_(True)
            r.zero_grad(set_to_none=True)
            out = r(xx)
            loss = out.stats.aux_loss + out.stats.z_loss + (out.gate_TK.square().sum() if use_gates else 0.0)
            loss.backward()
            grads.append((xx.grad, r.weight.grad.clone()))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if score == "sigmoid":
        from tlx_dist.router import _RouteKernel

        lg = torch.randn(6, E)
        lg[2, 4] = float("nan")
        lk = lg.clone().requires_grad_(True)
        idx, gate, q_E, zsum, *_ = _RouteKernel.apply(lk, None, K, False, True, 1.0)
        assert 4 not in idx[2].tolist() and torch.isfinite(gate).all()
        (gate.sum() + 0.3 * q_E.sum() + 0.1 * zsum).backward()
        g = lk.grad
        assert torch.isnan(g[2, 4]) and torch.isfinite(g[2, [c for c in range(E) if c != 4]]).all()
        assert torch.isfinite(g[[0, 1, 3, 4, 5]]).all()
