"""MoELayer (single rank) against the naive per-token loop: outputs, every gradient, losses.

fp64 layer vs fp64 loop must agree to rounding; fp32 layer vs fp64 loop within twice PyTorch's own
fp32 error (the loop run in fp32), STYLE.md 6.
"""

from __future__ import annotations

import pytest
import torch

from _util import clone_layer, make_cfg, reference_of
from tlx_dist import MoELayer
from tlx_dist.testing import assert_close_to_ref

# Each case: (id, config overrides, T tokens, why it exists)
CASES = [
    ("base", dict(num_shared_experts=1, aux_loss_coef=0.01, z_loss_coef=1e-3), 24,
     "softmax top-2 with shared expert and both losses: the common configuration"),
    ("sigmoid_bias_scale", dict(score_func="sigmoid", route_scale=2.5, load_balance_bias=True,
                                num_shared_experts=2, shared_inter_dim=6, aux_loss_coef=0.01), 24,
     "DeepSeek-V3 style: sigmoid scores, normalised gates scaled, selection bias"),
    ("k1_switch", dict(top_k=1, route_norm=False, aux_loss_coef=0.02), 20,
     "K=1 without normalisation: the router is trained through the raw probability"),
    ("k_eq_e", dict(num_experts=4, top_k=4), 10, "K=E: every token visits every expert"),
    ("odd_dims_prime_e", dict(dim=7, moe_inter_dim=5, num_experts=5, top_k=3), 13,
     "odd D and F (no alignment anywhere) and a prime expert count"),
    ("prime_e13", dict(num_experts=13, top_k=3, z_loss_coef=1e-2), 17, "prime E=13"),
    ("single_token", dict(num_shared_experts=1), 1, "T=1: one token, most experts empty"),
    ("zero_token_experts", dict(num_experts=16, top_k=1, route_norm=False), 3, "T*K=3 < E=16: at least 13 experts get no rows"),
    ("empty_batch", dict(num_shared_experts=1, aux_loss_coef=0.01, z_loss_coef=1e-3), 0,
     "T=0: an empty micro-batch must not crash, and its losses are 0, not NaN"),
]


def _all_to_one(layer: MoELayer) -> None:
    # Bias selection hard towards expert 3 (selection only: gates still come from the scores).
    layer.router.expert_bias[3] = 100.0


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp64_layer_matches_loop(case):
    _, kw, T, _why = case
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(dtype="float64", **kw))
    x = torch.randn(T, layer.cfg.dim, dtype=torch.float64, requires_grad=True)
    _check_against_loop(layer, x, fp64=True)


def test_all_tokens_to_one_expert_fp64():
    """Every token's first choice is expert 3: one expert holds T rows, the others at most T."""
    torch.manual_seed(1)
    layer = MoELayer(make_cfg(dtype="float64", top_k=2, load_balance_bias=True))
    _all_to_one(layer)
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    _check_against_loop(layer, x, fp64=True)
    assert int(layer.last_stats.tokens_per_expert[3]) == 32


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp32_layer_within_torch_error(case):
    _, kw, T, _why = case
    torch.manual_seed(0)
    layer64 = MoELayer(make_cfg(dtype="float64", **kw))
    layer32 = clone_layer(layer64, "float32")
    x64 = torch.randn(T, layer64.cfg.dim, dtype=torch.float64)

    (ref, idx_ref, aux_ref, z_ref), p64 = reference_of(layer64, x64.requires_grad_(True))
    g = torch.randn_like(ref)
    ref_grads = _grads(ref, aux_ref, z_ref, g, [x64] + list(p64.values()))

    x32_loop = x64.detach().float().requires_grad_(True)
    (same, _, aux_s, z_s), p32 = reference_of(layer32, x32_loop)
    same_grads = _grads(same, aux_s, z_s, g.float(), [x32_loop] + list(p32.values()))

    x32 = x64.detach().float().requires_grad_(True)
    out = layer32(x32)
    params = [x32] + [dict(layer32.named_parameters())[n] for n in p64]
    ours_grads = _grads(out, layer32.last_stats.aux_loss, layer32.last_stats.z_loss, g.float(), params)

    assert_close_to_ref(out, ref, same, name="out")
    for n, a, r, s in zip(["x"] + list(p64), ours_grads, ref_grads, same_grads):
        assert_close_to_ref(a, r, s, name=f"grad {n}")


def _grads(out, aux, z, g, params):
    loss = (out * g).sum() + aux + z
    gs = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, gs)]


def _check_against_loop(layer: MoELayer, x: torch.Tensor, fp64: bool) -> None:
    (ref, idx_ref, aux_ref, z_ref), p = reference_of(layer, x)
    out = layer(x)
    g = torch.randn_like(out)
    assert_close_to_ref(out, ref, name="out")
    assert_close_to_ref(layer.last_stats.aux_loss, aux_ref, name="aux_loss")
    assert_close_to_ref(layer.last_stats.z_loss, z_ref, name="z_loss")
    # Routing invariants: counts sum to T*K, and equal the loop's per-expert tallies.
    counts = layer.last_stats.tokens_per_expert
    assert int(counts.sum()) == x.shape[0] * layer.cfg.top_k
    assert torch.equal(counts, torch.bincount(idx_ref.reshape(-1), minlength=layer.cfg.num_experts))

    params = dict(layer.named_parameters())
    ours = _grads(out, layer.last_stats.aux_loss, layer.last_stats.z_loss, g, [x] + [params[n] for n in p])
    refs = _grads(ref, aux_ref, z_ref, g, [x] + list(p.values()))
    for n, a, r in zip(["x"] + list(p), ours, refs):
        assert_close_to_ref(a, r, name=f"grad {n}")


def test_batched_input_shape_roundtrip():
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(num_shared_experts=1))
    x = torch.randn(3, 5, 16)
    y = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(15, 16), layer(x.reshape(15, 16)), rtol=0, atol=0)


def test_bfloat16_layer_within_torch_error():
    """bf16 layer vs the fp64 loop, bounded by the bf16 loop's own error."""
    torch.manual_seed(0)
    layer64 = MoELayer(make_cfg(dtype="float64", num_shared_experts=1))
    layer16 = clone_layer(layer64, "bfloat16")
    x = torch.randn(32, 16, dtype=torch.float64)
    (ref, idx_ref, _, _), _ = reference_of(layer64, x)
    (same, idx_same, _, _), _ = reference_of(layer16, x.to(torch.bfloat16))
    out = layer16(x.to(torch.bfloat16))
    # Routing is a discrete choice: on near-ties the bf16 loop (bf16 logits), the layer (fp32 logits
    # of bf16 inputs) and the fp64 loop may pick different experts. Compare the tokens all three
    # route alike, and require that to be most of them.
    idx_layer = layer16.router(x.to(torch.bfloat16)).idx_TK
    agree = ((idx_same.sort(1).values == idx_ref.sort(1).values).all(1)
             & (idx_layer.sort(1).values == idx_ref.sort(1).values).all(1))
    assert agree.float().mean() > 0.8
    assert_close_to_ref(out[agree], ref[agree], same[agree], name="out bf16")


def test_same_seed_same_result():
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        layer = MoELayer(make_cfg(num_shared_experts=1, aux_loss_coef=0.01))
        x = torch.randn(20, 16, requires_grad=True)
        y = layer(x)
        (y.square().sum() + layer.aux_loss).backward()
        outs.append((y.detach(), x.grad, layer.w13.grad, layer.router.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    torch.manual_seed(124)
    other = MoELayer(make_cfg(num_shared_experts=1))
    assert not torch.equal(other.w13, layer.w13)


def test_expert_init_independent_of_ep_degree():
    """Expert j's weights depend only on (seed, global id): the EP slices of an EP=1 layer."""
    torch.manual_seed(0)
    full = MoELayer(make_cfg())
    torch.manual_seed(0)
    again = MoELayer(make_cfg())
    assert torch.equal(full.w13, again.w13)
    full.reset_parameters(seed=7)
    w = full.w13.detach().clone()
    full.reset_parameters(seed=7)
    assert torch.equal(w, full.w13)
    assert w.std().item() == pytest.approx(full.cfg.init_std, rel=0.1)


def test_ksum_bound_is_one_bf16_ulp_at_the_max():
    """assert_close_ksum_bf16 allows exactly one bf16 ulp of the largest magnitude: at a max of 122
    (in [64, 128)) that is 0.5 -- 122.5 is the next bf16 after 122 -- and nothing beyond it."""
    from tlx_dist.testing import assert_close_ksum_bf16

    ref = torch.tensor([122.0, -3.0, 0.25], dtype=torch.bfloat16)
    assert_close_ksum_bf16(ref, torch.tensor([122.5, -3.0, 0.25], dtype=torch.bfloat16))
    assert_close_ksum_bf16(ref, torch.tensor([122.0, -3.015625, 0.25], dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="one bf16 ulp"):
        assert_close_ksum_bf16(ref, torch.tensor([123.0, -3.0, 0.25], dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="one bf16 ulp"):  # 1.0 apart: two ulps at 64
        assert_close_ksum_bf16(torch.tensor([64.0], dtype=torch.bfloat16), torch.tensor([65.0], dtype=torch.bfloat16))
    assert_close_ksum_bf16(torch.tensor([64.0], dtype=torch.bfloat16), torch.tensor([64.5], dtype=torch.bfloat16))


def _router_accumulator(out: torch.Tensor, weight: torch.Tensor):
    """The AccumulateGrad node of ``weight`` in ``out``'s autograd graph."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if getattr(fn, "variable", None) is weight:
            return fn
        todo.extend(f for f, _ in fn.next_functions)
    raise AssertionError("the router weight is not in the graph")


@pytest.mark.parametrize("coef", [0.0, 0.01])
def test_forward_does_not_keep_the_last_steps_graph(coef):
    """A forward starts from fresh autograd nodes for the router weight once the previous step's
    outputs are gone: the layer's own ``last_stats`` (logits and losses, in the graph) must not keep
    the old AccumulateGrad node alive into the next forward. Autograd would reuse that node with the
    stream it was made on, and a CUDA-graph capture after one eager step on the default stream then
    fails in its backward (cudaErrorStreamCaptureImplicit, as the benchmark's captures once did)."""
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(aux_loss_coef=coef, z_loss_coef=coef))
    x = torch.randn(6, layer.cfg.dim)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    _router_accumulator(y, layer.router.weight).metadata["first_step"] = True
    del y
    y2 = layer(x)
    assert "first_step" not in _router_accumulator(y2, layer.router.weight).metadata, \
        "the previous step's AccumulateGrad node was reused: something still holds its graph"
    assert layer.last_stats is not None and torch.isfinite(layer.aux_loss)


def test_launch_configs_reach_the_layers_ops():
    """``gemm_config`` (the separate pipeline's TLX tiles) and ``fused_config`` (the fused
    pipeline's launch choices) are checked at construction and handed to the ops at each forward;
    the router kernel is a plain switch on the layer's router."""
    from tlx_dist.fused import FusedConfig
    from tlx_dist.grouped_gemm import GroupedGemmConfig

    cfg = make_cfg(dtype="float64")
    torch.manual_seed(0)
    x = torch.randn(9, cfg.dim, dtype=torch.float64)
    base = MoELayer(cfg, pipeline="fused")
    tuned = MoELayer(cfg, pipeline="fused", fused_config=FusedConfig(dout_rows="gather", layout_kernel=False))
    tuned.load_state_dict(base.state_dict())
    torch.testing.assert_close(tuned(x), base(x), rtol=0, atol=0)  # row modes: the same values
    pinned = MoELayer(cfg, pipeline="separate", gemm_config=GroupedGemmConfig())
    assert not MoELayer(cfg, gemm_config=GroupedGemmConfig())._fused(x)  # a pinned tile config: separate
    # on CPU the grouped GEMM runs on a backend without tiles (fp64: the reference loop): the pinned
    # config is an error at the call, not dropped
    with pytest.raises(ValueError, match=r"config= pins the TLX kernels' tile config, but backend 'reference'"):
        pinned(x)
    with pytest.raises(ValueError, match=r"pipeline='fused' .* takes no gemm_config"):
        MoELayer(cfg, pipeline="fused", gemm_config=GroupedGemmConfig())
    with pytest.raises(ValueError, match=r"fused_config applies to the fused pipeline"):
        MoELayer(cfg, pipeline="separate", fused_config=FusedConfig())
    with pytest.raises(TypeError, match=r"gemm_config must be a GroupedGemmConfig or None, got str"):
        MoELayer(cfg, gemm_config="128x256x64")
    with pytest.raises(TypeError, match=r"fused_config must be a FusedConfig or None, got dict"):
        MoELayer(cfg, fused_config={"dout_rows": "gather"})
    sep = MoELayer(cfg, pipeline="separate")
    sep.load_state_dict(base.state_dict())
    y_kernel = sep(x)
    sep.router.kernel = False  # the torch ops (on CPU without the interpreter both are the torch ops)
    torch.testing.assert_close(sep(x), y_kernel, rtol=0, atol=0)
