"""Router: gates, selection, hand-computed aux/z losses, aux-loss-free bias balancing, group-limited
routing (DeepSeek-V3), the NaN policy of the losses, the bf16 router GEMM."""

from __future__ import annotations

import math

import pytest
import torch

from _util import make_cfg, reference_of
from tlx_dist import MoELayer, Router
from tlx_dist.router import expert_counts, router_logits
from tlx_dist.testing import assert_close_to_ref


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


# --- group-limited routing (DeepSeek-V3 n_group / topk_group) ------------------------------------

def _layer_vs_loop_fp64(layer: MoELayer, x: torch.Tensor):
    """fp64 layer against the fp64 per-token loop: output, chosen experts, losses, every gradient."""
    (ref, idx_ref, aux_ref, z_ref), p = reference_of(layer, x)
    out = layer(x)
    st = layer.last_stats
    assert_close_to_ref(out, ref, name="out")
    assert_close_to_ref(st.aux_loss, aux_ref, name="aux_loss")
    assert_close_to_ref(st.z_loss, z_ref, name="z_loss")
    assert torch.equal(st.tokens_per_expert, torch.bincount(idx_ref.reshape(-1), minlength=layer.cfg.num_experts))
    g = torch.randn_like(out)
    params = dict(layer.named_parameters())
    names = ["x"] + list(p)
    ours = torch.autograd.grad((out * g).sum() + st.loss, [x] + [params[n] for n in p], allow_unused=True)
    refs = torch.autograd.grad((ref * g).sum() + aux_ref + z_ref, [x] + list(p.values()), allow_unused=True)
    for n, a, r in zip(names, ours, refs):
        a = torch.zeros_like(params.get(n, x)) if a is None else a
        r = torch.zeros_like(a) if r is None else r
        assert_close_to_ref(a, r, name=f"grad {n}")
    return idx_ref


# (id, config overrides, T, why)
GROUP_CASES = [
    ("dsv3_like", dict(score_func="sigmoid", num_experts=16, top_k=4, n_group=4, topk_group=2, route_scale=2.5,
                       load_balance_bias=True, num_shared_experts=1), 40,
     "DeepSeek-V3 in miniature: sigmoid, selection bias inside the group scores, scaled gates, shared"),
    ("one_group", dict(num_experts=12, top_k=3, n_group=4, topk_group=1, aux_loss_coef=0.01), 30,
     "topk_group=1: all K experts from one group (node-limited routing to a single node)"),
    ("k_fills_groups", dict(num_experts=12, top_k=6, n_group=4, topk_group=2, z_loss_coef=1e-2), 25,
     "K = topk_group * group size: every expert of both chosen groups is picked"),
    ("groups_of_three", dict(num_experts=9, top_k=2, n_group=3, topk_group=2, dim=7, moe_inter_dim=5), 23,
     "odd sizes and groups of 3, where the top-2 sum leaves one member out of the group score"),
    ("softmax_losses", dict(num_experts=8, top_k=2, n_group=2, topk_group=1, aux_loss_coef=0.02,
                            z_loss_coef=1e-3), 20, "softmax scores with groups and both losses"),
    ("single_token", dict(num_experts=8, top_k=2, n_group=4, topk_group=2), 1, "T=1"),
    ("empty_batch", dict(num_experts=8, top_k=2, n_group=4, topk_group=2, aux_loss_coef=0.01), 0,
     "T=0: no token, losses 0"),
]


@pytest.mark.parametrize("case", GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_group_limited_layer_matches_loop(case):
    _, kw, T, _why = case
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(dtype="float64", **kw))
    if layer.cfg.load_balance_bias:
        layer.router.expert_bias.copy_(0.2 * torch.randn(layer.cfg.num_experts))
    x = torch.randn(T, layer.cfg.dim, dtype=torch.float64, requires_grad=True)
    idx = _layer_vs_loop_fp64(layer, x)
    cfg = layer.cfg
    S = cfg.num_experts // cfg.n_group
    # The invariant group-limited routing exists for: a token's experts span at most topk_group groups.
    for row in (idx // S).tolist():
        assert len(set(row)) <= cfg.topk_group


@pytest.mark.parametrize("kw", [dict(n_group=4, topk_group=4), dict(n_group=8, topk_group=2)],
                         ids=["topk_group_eq_n_group", "groups_of_one"])
def test_group_limits_that_do_not_limit(kw):
    """topk_group = n_group keeps every group; groups of one expert score that expert alone, so the
    best topk_group >= K groups hold the plain top-K. Both must route exactly like no groups."""
    torch.manual_seed(3)
    x = torch.randn(50, 16, dtype=torch.float64)
    plain = Router(make_cfg(dtype="float64", score_func="sigmoid"))
    grouped = Router(make_cfg(dtype="float64", score_func="sigmoid", **kw))
    grouped.load_state_dict(plain.state_dict())
    a, b = plain(x), grouped(x)
    assert torch.equal(a.idx_TK.sort(1).values, b.idx_TK.sort(1).values)
    torch.testing.assert_close(a.gate_TK.sort(1).values, b.gate_TK.sort(1).values, rtol=0, atol=0)


def _router_with_scores(scores, n_group, topk_group, top_k, bias=None):
    """A sigmoid router whose scores for the one-hot token x = e_0 are exactly ``scores``."""
    s = torch.tensor(scores, dtype=torch.float64)
    cfg = make_cfg(dtype="float64", dim=2, num_experts=len(scores), top_k=top_k, n_group=n_group,
                   topk_group=topk_group, score_func="sigmoid", load_balance_bias=bias is not None)
    r = Router(cfg)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.log(s / (1 - s))  # logit of each score
        if bias is not None:
            r.expert_bias.copy_(torch.tensor(bias))
    return r, torch.tensor([[1.0, 0.0]], dtype=torch.float64)


def test_group_score_is_sum_of_top2_not_max():
    # Group 0 holds the single best expert (0.95) but a weak partner; group 1 two good ones.
    # DeepSeek-V2's max rule would keep group 0; DeepSeek-V3's top-2 sum keeps group 1.
    r, x = _router_with_scores([0.95, 0.05, 0.62, 0.60, 0.10, 0.10], n_group=3, topk_group=1, top_k=1)
    assert r(x).idx_TK.tolist() == [[2]]


def test_group_score_is_sum_of_top2_not_of_all():
    # Three members: group 0 sums to 1.5 over all three but only 1.0 over its top 2; group 1 has
    # top-2 sum 1.3. A sum-over-all rule would pick group 0.
    r, x = _router_with_scores([0.5, 0.5, 0.5, 0.7, 0.6, 0.01], n_group=2, topk_group=1, top_k=2)
    assert sorted(r(x).idx_TK.tolist()[0]) == [3, 4]


def test_bias_steers_group_choice_but_not_gates():
    # Without bias group 0 wins (1.5 vs 0.4); a +1 bias on expert 3 lifts group 1 to 1.4+... > 1.5.
    scores = [0.8, 0.7, 0.2, 0.2]
    r, x = _router_with_scores(scores, n_group=2, topk_group=1, top_k=2, bias=[0.0, 0.0, 0.0, 1.2])
    out = r(x)
    assert sorted(out.idx_TK.tolist()[0]) == [2, 3]
    g = torch.tensor([0.2, 0.2], dtype=torch.float64)
    torch.testing.assert_close(out.gate_TK[0], g / g.sum())  # gates from scores, bias-free


def test_group_routing_never_picks_a_masked_expert_even_when_scores_are_negative():
    # Bias can push selection scores below zero; masked experts are -inf, so they still lose.
    r, x = _router_with_scores([0.5, 0.4, 0.3, 0.2], n_group=2, topk_group=1, top_k=2, bias=[-5.0, -5.0, 0.0, 0.0])
    assert sorted(r(x).idx_TK.tolist()[0]) == [2, 3]


def _groups_used(idx_TK: torch.Tensor, S: int) -> torch.Tensor:
    """``[T]`` number of distinct expert groups (of S contiguous experts) each token picked."""
    g = (idx_TK // S).sort(dim=1).values
    return 1 + (g[:, 1:] != g[:, :-1]).sum(1)


NEG = float("-inf")
# (id, E, n_group, topk_group, top_k, bias rule, why). The bias adds to the selection scores only;
# -inf on an expert removes it from selection as a caller masking experts would.
INF_CASES = [
    ("two_dead_groups", 8, 4, 3, 6, lambda e: NEG if e // 2 in (1, 3) else 0.0,
     "the reported case: two all-(-inf) groups, topk_group=3, K=6 -- one dead group must be chosen (they "
     "tie), and its -inf experts must fill K, not those of the other dead group"),
    ("all_dead", 12, 4, 2, 6, lambda e: NEG, "every selection score -inf: every group ties"),
    ("k_fills_dead_groups", 12, 4, 3, 9, lambda e: NEG if e // 3 != 0 else 0.0,
     "K = topk_group * S with two of the chosen groups all -inf: all 9 experts of the 3 chosen groups"),
    ("ties", 16, 4, 2, 5, lambda e: 0.0, "x = 0: every score 0.5, every group ties, every expert ties"),
    ("one_dead_member", 12, 4, 2, 6, lambda e: NEG if e % 3 == 2 else 0.0,
     "every group has one -inf member (group scores stay finite); K fills both chosen groups, -inf included"),
]


@pytest.mark.parametrize("case", INF_CASES, ids=[c[0] for c in INF_CASES])
def test_group_limit_holds_with_minus_inf_and_ties(case):
    """A token's experts span at most topk_group groups, are distinct, and come from groups whose
    score is among its topk_group best (ties allowed), whatever ties -inf selection scores make.
    The mask of excluded groups used to be -inf too, so here the top-K took experts of 4 groups."""
    _, E, G, TG, K, rule, _why = case
    torch.manual_seed(0)
    cfg = make_cfg(dtype="float64", num_experts=E, top_k=K, n_group=G, topk_group=TG, score_func="sigmoid",
                   load_balance_bias=True)
    r = Router(cfg)
    bias = torch.tensor([rule(e) for e in range(E)], dtype=torch.float64)
    r.expert_bias.copy_(bias)
    x = torch.zeros(64, cfg.dim, dtype=torch.float64) if case[0] == "ties" else torch.randn(64, cfg.dim,
                                                                                          dtype=torch.float64)
    out = r(x)
    S = E // G
    idx = out.idx_TK
    assert (_groups_used(idx, S) <= TG).all(), _groups_used(idx, S)
    assert (idx.sort(1).values[:, 1:] != idx.sort(1).values[:, :-1]).all(), "an expert picked twice"
    sel = torch.sigmoid(x @ r.weight.T) + bias
    group_TG = sel.view(-1, G, S).topk(min(2, S), -1).values.sum(-1)
    cut = group_TG.topk(TG, -1).values[:, -1:]                     # the topk_group-th best group score
    picked = group_TG.gather(1, idx // S)
    assert (picked >= cut).all()
    # Within the chosen groups the picks are the K best (no finite expert of a chosen group left out
    # for a -inf one): the smallest picked selection score is >= every unpicked one of those groups.
    chosen = torch.zeros(64, G, dtype=torch.bool).scatter_(1, idx // S, True).repeat_interleave(S, 1)
    unpicked = chosen.clone().scatter_(1, idx, False)
    worst_pick = sel.gather(1, idx).min(1).values
    best_left = torch.where(unpicked, sel, NEG).max(1).values
    assert (worst_pick >= best_left).all()
    if case[0] == "one_dead_member":
        assert (sel.gather(1, idx) == NEG).any(1).all()              # K=6 of 6 reached the -inf members


def test_group_limited_layer_matches_loop_with_minus_inf_members():
    """fp64 layer vs the per-token loop (output, losses, every gradient) when chosen groups hold
    -inf selection scores: one member of each group of 3 is -inf, K fills both chosen groups, so
    the -inf members must be picked from the chosen groups (group scores are random: no ties)."""
    torch.manual_seed(1)
    cfg = make_cfg(dtype="float64", num_experts=12, top_k=6, n_group=4, topk_group=2, score_func="sigmoid",
                   load_balance_bias=True, aux_loss_coef=0.01, z_loss_coef=1e-3)
    layer = MoELayer(cfg)
    layer.router.expert_bias.copy_(torch.tensor([NEG if e % 3 == 2 else 0.3 * (e % 5) for e in range(12)]))
    x = torch.randn(20, cfg.dim, dtype=torch.float64, requires_grad=True)
    idx = _layer_vs_loop_fp64(layer, x)
    assert (_groups_used(idx, 3) <= 2).all() and (idx % 3 == 2).sum(1).eq(2).all()


# --- NaN policy for the router losses ------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(score_func="sigmoid", n_group=4, topk_group=2)],
                         ids=["softmax", "sigmoid_groups"])
def test_router_losses_skip_non_finite_tokens(kw):
    """One NaN and one inf token: the other output rows, the aux loss and the z loss are those of the
    batch without them (finite, not NaN); every token still counts in tokens_per_expert."""
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(dtype="float64", aux_loss_coef=0.01, z_loss_coef=1e-3, num_shared_experts=1, **kw))
    x = torch.randn(12, 16, dtype=torch.float64)
    bad = x.clone()
    bad[5] = float("nan")
    bad[7, 3] = float("inf")
    keep = [t for t in range(12) if t not in (5, 7)]
    y_bad = layer(bad)
    st = layer.last_stats
    assert int(st.tokens_per_expert.sum()) == 12 * layer.cfg.top_k
    assert torch.isfinite(st.aux_loss) and torch.isfinite(st.z_loss)
    y_clean = layer(x[keep])
    clean = layer.last_stats
    assert_close_to_ref(y_bad[keep], y_clean, name="finite rows")
    assert_close_to_ref(st.aux_loss, clean.aux_loss, name="aux_loss")
    assert_close_to_ref(st.z_loss, clean.z_loss, name="z_loss")
    # The per-token loop applies the same policy.
    (_, _, aux_ref, z_ref), _ = reference_of(layer, bad)
    assert_close_to_ref(st.aux_loss, aux_ref, name="aux_loss vs loop")
    assert_close_to_ref(st.z_loss, z_ref, name="z_loss vs loop")


def test_router_losses_all_tokens_non_finite_are_zero():
    layer = MoELayer(make_cfg(aux_loss_coef=0.01, z_loss_coef=1e-3))
    layer(torch.full((4, 16), float("nan")))
    assert float(layer.last_stats.aux_loss.detach()) == 0.0 and float(layer.last_stats.z_loss.detach()) == 0.0


# --- router GEMM: bf16 operands, fp32 logits, no fp32 copy of x -----------------------------------

def _saved_by(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        out = fn()
    return out, saved


def test_bf16_router_gemm_keeps_no_fp32_copy_of_x_and_stays_accurate():
    torch.manual_seed(0)
    T, D, E = 64, 48, 8
    x64 = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w64 = (0.3 * torch.randn(E, D, dtype=torch.float64)).requires_grad_(True)
    x16 = x64.detach().bfloat16().requires_grad_(True)
    w16 = w64.detach().bfloat16().requires_grad_(True)
    logits, saved = _saved_by(lambda: router_logits(x16, w16))
    assert logits.dtype == torch.float32
    assert (torch.float32, (T, D)) not in saved, saved  # the point of the bf16 GEMM
    # Reference: fp64 on the bf16-rounded operands; PyTorch's own bf16 linear sets the error scale.
    xr, wr = x16.detach().double().requires_grad_(True), w16.detach().double().requires_grad_(True)
    ref = xr @ wr.T
    xs, ws = x16.detach().clone().requires_grad_(True), w16.detach().clone().requires_grad_(True)
    same = torch.nn.functional.linear(xs, ws)
    assert_close_to_ref(logits, ref, same, dtype=torch.float32, name="logits")
    g = torch.randn(T, E, dtype=torch.float64)
    ref.backward(g)
    logits.backward(g.float())
    same.backward(g.bfloat16())
    assert_close_to_ref(x16.grad, xr.grad, xs.grad, name="dx")
    assert_close_to_ref(w16.grad, wr.grad, ws.grad, name="dw")


def test_router_weight_dtype_can_differ_from_experts():
    """DeepSeek-V3 keeps its router fp32 in a bf16 model: router_dtype='float32'."""
    layer = MoELayer(make_cfg(dtype="bfloat16", router_dtype="float32", score_func="sigmoid"))
    assert layer.router.weight.dtype == torch.float32 and layer.w13.dtype == torch.bfloat16
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and layer.last_stats.logits_TE.dtype == torch.float32
    ref = torch.nn.functional.linear(x.float(), layer.router.weight)
    torch.testing.assert_close(layer.last_stats.logits_TE, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_router_gemm_on_gpu():
    """CUDA path (torch.mm with out_dtype=float32): same checks as the CPU test."""
    torch.manual_seed(0)
    T, D, E = 4096, 1024, 64
    x16 = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w16 = (0.02 * torch.randn(E, D, device="cuda")).bfloat16().requires_grad_(True)
    logits, saved = _saved_by(lambda: router_logits(x16, w16))
    assert logits.dtype == torch.float32 and (torch.float32, (T, D)) not in saved
    xr, wr = x16.detach().double().requires_grad_(True), w16.detach().double().requires_grad_(True)
    ref = xr @ wr.T
    xs, ws = x16.detach().clone().requires_grad_(True), w16.detach().clone().requires_grad_(True)
    same = torch.nn.functional.linear(xs, ws)
    assert_close_to_ref(logits, ref, same, dtype=torch.float32, name="logits")
    g = torch.randn(T, E, device="cuda", dtype=torch.float64)
    ref.backward(g)
    logits.backward(g.float())
    same.backward(g.bfloat16())
    assert_close_to_ref(x16.grad, xr.grad, xs.grad, name="dx")
    assert_close_to_ref(w16.grad, wr.grad, ws.grad, name="dw")


# --- config: the fields this file's features add, and the edge cases of issue 12 ------------------

@pytest.mark.parametrize("kw,match", [
    (dict(num_shared_experts=True), r"moe.num_shared_experts=True must be a non-negative integer"),
    (dict(shared_inter_dim=True), r"moe.shared_inter_dim=True must be a positive integer or None"),
    (dict(route_scale=float("inf")), r"moe.route_scale=inf must be finite"),
    (dict(route_scale=float("nan")), r"moe.route_scale=nan must be a positive number"),
    (dict(aux_loss_coef=float("inf")), r"moe.aux_loss_coef=inf must be finite"),
    (dict(z_loss_coef=float("-inf")), r"moe.z_loss_coef=-inf must be finite"),
    (dict(bias_update_rate=float("nan")), r"moe.bias_update_rate=nan must be a non-negative number"),
    (dict(init_std=float("inf")), r"moe.init_std=inf must be finite"),
    (dict(n_group=3), r"moe.n_group=3 does not divide num_experts=8"),
    (dict(n_group=True), r"moe.n_group=True must be a positive integer"),
    (dict(n_group=4, topk_group=0), r"moe.topk_group=0 must be an integer in \[1, n_group=4\] or None"),
    (dict(n_group=4, topk_group=5), r"moe.topk_group=5 must be an integer in \[1, n_group=4\]"),
    (dict(n_group=4, topk_group=True), r"moe.topk_group=True must be an integer"),
    (dict(n_group=4, topk_group=1, top_k=3), r"moe.top_k=3 exceeds the 2 experts of topk_group=1 groups of 2"),
    (dict(router_dtype="fp32"), r"moe.router_dtype='fp32' must be None or one of"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(**kw)


def test_config_expert_parallel_must_be_an_int_not_a_bool():
    with pytest.raises(ValueError, match=r"expert_parallel=True must be a positive integer"):
        make_cfg().validate(expert_parallel=True)


def test_group_limited_property():
    assert not make_cfg().group_limited
    assert not make_cfg(n_group=4).group_limited                 # topk_group None: all groups
    assert not make_cfg(n_group=4, topk_group=4).group_limited
    assert make_cfg(n_group=4, topk_group=2).group_limited
