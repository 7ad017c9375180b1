"""tlx_dist.integrations.hf: transformers sparse-MoE blocks patched to HFMoELayer (tier T0, CPU).

Tiny random configs built in code (no download). Per architecture: block outputs, router logits and
every parameter gradient of the patched block against the original block, both in fp32, under the
STYLE.md 6 rule applied *both ways* around an fp64 reference (``max|ours - ref64| <= 2*max|hf -
ref64| + atol`` and the same with ours and hf swapped): one direction alone would let a conversion
bug hide behind an fp64 reference built from the converted config. Then whole models: logits, loss,
aux loss and router logits; state-dict export and unpatch; a few fine-tuning steps.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")  # safety net only: CI installs the hf extra

from tlx_dist import moe_reference  # noqa: E402
from tlx_dist.integrations.hf import HFMoELayer, hf_state_dict, patch_moe, supported_blocks, unpatch_moe  # noqa: E402
from tlx_dist.testing import assert_close_to_ref  # noqa: E402

ARCHS = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3"]

_TOKENS = dict(vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def tiny_config(arch: str, **kw):
    """A two- or three-layer model config of ``arch`` with D=32 (small enough for a CPU test)."""
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, **_TOKENS)
    if arch == "mixtral":
        cls, base = transformers.MixtralConfig, dict(base, intermediate_size=24, num_local_experts=8,
                                                      num_experts_per_tok=2)
    elif arch == "olmoe":
        cls, base = transformers.OlmoeConfig, dict(base, intermediate_size=24, num_experts=8, num_experts_per_tok=2)
    elif arch == "qwen2_moe":
        cls, base = transformers.Qwen2MoeConfig, dict(base, intermediate_size=48, moe_intermediate_size=24,
                                                      shared_expert_intermediate_size=40, num_experts=8,
                                                      num_experts_per_tok=2)
    elif arch == "qwen3_moe":
        cls, base = transformers.Qwen3MoeConfig, dict(base, intermediate_size=48, moe_intermediate_size=24,
                                                      num_experts=8, num_experts_per_tok=2, head_dim=8,
                                                      norm_topk_prob=True)
    elif arch == "deepseek_v3":
        cls, base = transformers.DeepseekV3Config, dict(
            base, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
            moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            n_shared_experts=2, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    else:
        raise ValueError(arch)
    base.update(kw)
    return cls(**base)


def block_class(arch: str) -> type:
    return next(c for c, a in supported_blocks().items() if a.name == arch)


@torch.no_grad()
def randomize(module: torch.nn.Module, router_std: float = 0.5) -> None:
    """Weights drawn so that routing is spread and outputs are O(1): router rows N(0, router_std),
    everything else N(0, 1/sqrt(fan_in)); DeepSeek-V3's correction bias N(0, 0.1) so it matters."""
    for name, p in module.named_parameters():
        if name.endswith("gate.weight") and p.shape[0] > 1:
            p.normal_(0.0, router_std)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.1)


def make_block(arch: str, experts_implementation: str = "eager", **kw) -> torch.nn.Module:
    """One random block; ``experts_implementation`` as transformers names it ("eager": the loop,
    "grouped_mm": what a model gets by default on a recent torch)."""
    torch.manual_seed(0)
    block = block_class(arch)(tiny_config(arch, experts_implementation=experts_implementation, **kw))
    randomize(block)
    return block


# --- fp64 reference of a block, from its transformers-layout weights ------------------------------

def ref64_block(layer: HFMoELayer, p: dict, x_TD: torch.Tensor):
    """The project's fp64 per-token loop on the block's own (HF-layout, fp64 leaf) tensors, under
    the routing semantics ``layer.cfg`` says the block has; plus Qwen2-MoE's gated shared expert.
    Returns ``(out_TD, logits_TE, idx_TK)``."""
    cfg = dataclasses.replace(layer.cfg, dtype="float64", router_dtype=None)
    shared_w13 = shared_w2 = None
    if "shared_experts.gate_proj.weight" in p:
        shared_w13 = torch.cat([p["shared_experts.gate_proj.weight"].T, p["shared_experts.up_proj.weight"].T], 1)
        shared_w2 = p["shared_experts.down_proj.weight"].T
    bias = p["gate.e_score_correction_bias"].detach() if "gate.e_score_correction_bias" in p else None
    # Per-expert lists, not [E, ...] tensors: the loop indexes one expert per (token, k), and indexing
    # a tensor would build a full [E, D, 2F] gradient for each of those in the backward.
    w13 = list(p["experts.gate_up_proj"].transpose(1, 2).unbind(0))
    w2 = list(p["experts.down_proj"].transpose(1, 2).unbind(0))
    out, idx, _, _ = moe_reference(x_TD, p["gate.weight"], w13, w2, cfg, shared_w13, shared_w2, bias)
    if "shared_expert_gate.weight" in p:
        h = F.silu(x_TD @ p["shared_expert.gate_proj.weight"].T) * (x_TD @ p["shared_expert.up_proj.weight"].T)
        out = out + torch.sigmoid(x_TD @ p["shared_expert_gate.weight"].T) * (h @ p["shared_expert.down_proj.weight"].T)
    return out, x_TD @ p["gate.weight"].T, idx


def our_grads_hf_layout(layer: HFMoELayer) -> dict:
    """The patched layer's parameter gradients, renamed and transposed to the block's layout."""
    g = {"gate.weight": layer.router.weight.grad, "experts.gate_up_proj": layer.w13.grad.transpose(1, 2),
         "experts.down_proj": layer.w2.grad.transpose(1, 2)}
    if layer.shared_w13 is not None:
        Fs = layer.cfg.shared_dim
        g["shared_experts.gate_proj.weight"] = layer.shared_w13.grad[:, :Fs].T
        g["shared_experts.up_proj.weight"] = layer.shared_w13.grad[:, Fs:].T
        g["shared_experts.down_proj.weight"] = layer.shared_w2.grad.T
    for prefix in ("shared_expert", "shared_expert_gate"):
        mod = getattr(layer, prefix)
        if mod is not None:
            g.update({f"{prefix}.{n}": q.grad for n, q in mod.named_parameters()})
    return g


def both_ways(ours, hf, ref64, name, dtype=None):
    if ours.dtype == torch.float64:
        # fp64 cases: ours at fp64's floor; the original block (which keeps its routing weights in
        # fp32 internally) against the same reference at fp32's floor, so the reference built from
        # the converted config is still checked against transformers' block.
        assert_close_to_ref(ours, ref64, name=f"{name} (ours, fp64)")
        assert_close_to_ref(hf, ref64, dtype=torch.float32, name=f"{name} (hf, fp64 inputs)")
        return
    assert_close_to_ref(ours, ref64, hf, dtype=dtype, name=f"{name} (ours vs hf error)")
    assert_close_to_ref(hf, ref64, ours, dtype=dtype, name=f"{name} (hf vs our error)")


# (id, arch, config overrides, (B, S), why)
BLOCK_CASES = [
    ("mixtral", "mixtral", {}, (2, 13), "softmax top-2, always renormalised, fp32 gate weights"),
    ("olmoe", "olmoe", {}, (2, 13), "softmax top-2 without renormalisation (norm_topk_prob=False)"),
    ("qwen2_moe", "qwen2_moe", {}, (2, 13), "sigmoid-gated shared expert kept beside the routed experts"),
    ("qwen3_moe", "qwen3_moe", {}, (2, 13), "norm_topk_prob=True"),
    ("qwen3_moe_grouped_mm", "qwen3_moe", dict(experts_implementation="grouped_mm"), (2, 13),
     "the original block on transformers' grouped_mm experts, what a model gets by default"),
    ("deepseek_v3", "deepseek_v3", {}, (2, 13),
     "sigmoid, correction bias, 2 of 4 groups by top-2 sum, routed_scaling_factor 2.5, 2 shared experts"),
    ("deepseek_v3_one_group", "deepseek_v3", dict(topk_group=1), (2, 13),
     "topk_group=1: every token's 4 experts come from one group of 4"),
    ("qwen3_odd_prime", "qwen3_moe", dict(hidden_size=15, num_attention_heads=5, num_key_value_heads=5, head_dim=3,
                                          moe_intermediate_size=7, num_experts=7, num_experts_per_tok=3),
     (1, 11), "odd D and F, prime E=7, K=3"),
    ("olmoe_k_eq_e", "olmoe", dict(num_experts=4, num_experts_per_tok=4), (2, 5), "K=E: every expert for every token"),
    # In fp64: with one token, each routed expert's logit gradient is one difference of two
    # D-term dot products (K=2 renormalised), a single cancellation whose fp32 rounding varies by
    # summation order. Compared against the fp64 reference at fp64's floor instead, which checks the
    # empty experts' exact zero gradients and every other gradient more tightly; the fp32 statistics
    # are the other cases' business.
    ("mixtral_single_token", "mixtral", {}, (1, 1), "T=1: most experts get no token (zero gradients)",
     torch.float64),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
def test_block_outputs_logits_and_grads_match_hf(case):
    _, arch, kw, (B, S), _why, *rest = case
    dt = rest[0] if rest else torch.float32
    hf = make_block(arch, **kw).to(dt)
    ours = HFMoELayer.from_hf_block(copy.deepcopy(hf))
    D = hf.gate.weight.shape[1]
    torch.manual_seed(1)
    x64 = torch.randn(B, S, D, dtype=torch.float64)
    g64 = torch.randn(B, S, D, dtype=torch.float64)

    p64 = {k: v.detach().double().requires_grad_(v.dtype.is_floating_point and k != "gate.e_score_correction_bias")
           for k, v in hf.state_dict().items()}
    xr = x64.reshape(-1, D).clone().requires_grad_(True)
    ref, ref_logits, _ = ref64_block(ours, p64, xr)
    (ref * g64.reshape(-1, D)).sum().backward()

    xh = x64.to(dt, copy=True).requires_grad_(True)
    out_hf = hf(xh)
    logits_hf = hf.gate(xh.detach())[0]
    (out_hf * g64.to(dt)).sum().backward()

    xo = x64.to(dt, copy=True).requires_grad_(True)
    out = ours(xo)
    assert out.shape == (B, S, D) and out.dtype == dt
    (out * g64.to(dt)).sum().backward()

    both_ways(out.reshape(-1, D), out_hf.reshape(-1, D), ref, "block output")
    both_ways(ours.last_stats.logits_TE, logits_hf, ref_logits, "router logits")
    both_ways(xo.grad, xh.grad, xr.grad.view(B, S, D), "grad x")
    ours_g = our_grads_hf_layout(ours)
    hf_g = {k: v.grad for k, v in hf.named_parameters()}
    assert set(ours_g) == set(hf_g)
    for k in hf_g:
        hg = torch.zeros_like(p64[k]) if hf_g[k] is None else hf_g[k]
        og = torch.zeros_like(hg) if ours_g[k] is None else ours_g[k]
        both_ways(og, hg, p64[k].grad, f"grad {k}")


# --- whole models -----------------------------------------------------------------------------

def tiny_model(arch: str, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **kw))
    randomize(model)
    return model


def fp64_copy(model):
    """The model in float64 (transformers' grouped_mm experts take no float64: use its eager loop)."""
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")
    return ref


def _batch(seed=0, B=2, S=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (B, S), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_model_matches_hf_model(arch):
    """Logits, loss (with the aux loss), aux loss and every layer's router logits; the fp64 model is
    the reference (its routers still cast to fp32 in transformers, so it is ~fp32-exact there)."""
    hf = tiny_model(arch)
    ours = patch_moe(copy.deepcopy(hf))
    n_moe = sum(type(m).__name__ == block_class(arch).__name__ for m in hf.modules())
    assert sum(isinstance(m, HFMoELayer) for m in ours.modules()) == n_moe > 0
    assert not any(type(m) is block_class(arch) for m in ours.modules())
    ids = _batch()
    ref = fp64_copy(hf)(input_ids=ids, labels=ids, output_router_logits=True)
    a = ours(input_ids=ids, labels=ids, output_router_logits=True)
    b = hf(input_ids=ids, labels=ids, output_router_logits=True)
    both_ways(a.logits, b.logits, ref.logits, "logits")
    both_ways(a.loss, b.loss, ref.loss, "loss")
    assert len(a.router_logits) == len(b.router_logits) == n_moe
    for i, (ra, rb, rr) in enumerate(zip(a.router_logits, b.router_logits, ref.router_logits)):
        both_ways(ra, rb, rr, f"router_logits[{i}]")
    if arch == "deepseek_v3":  # transformers computes no aux loss for it
        assert a.aux_loss is None and b.aux_loss is None
    else:
        both_ways(a.aux_loss, b.aux_loss, ref.aux_loss, "aux_loss")
        assert float(b.aux_loss.detach()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_export_and_unpatch_round_trip(arch):
    hf = tiny_model(arch)
    sd = hf.state_dict()
    ours = patch_moe(copy.deepcopy(hf))
    exported = hf_state_dict(ours)
    assert set(exported) == set(sd)
    for k, v in sd.items():  # transposes and copies only: bit-exact, original dtypes
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    ids = _batch(1)
    y = ours(input_ids=ids).logits
    back = unpatch_moe(ours)
    assert not any(isinstance(m, HFMoELayer) for m in back.modules())
    assert sum(type(m) is block_class(arch) for m in back.modules()) == sum(type(m) is block_class(arch)
                                                                            for m in hf.modules())
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k
    torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=0)
    both_ways(y, hf(input_ids=ids).logits, fp64_copy(hf)(input_ids=ids).logits, "patched logits")


def test_router_logits_recorded_whether_hooks_were_installed_before_or_after_patching():
    """transformers installs its output-recorder hooks once, lazily, by class. A model that already
    returned router logits before patch_moe (hooks on the old routers) must still return one entry
    per MoE layer after it, and again after unpatch_moe (the new routers need hooks too)."""
    hf = tiny_model("qwen3_moe")
    ids = _batch(2)
    ref = hf(input_ids=ids, output_router_logits=True).router_logits
    assert len(ref) == 2
    patch_moe(hf)
    assert len(hf(input_ids=ids, output_router_logits=True).router_logits) == 2
    unpatch_moe(hf)
    again = hf(input_ids=ids, output_router_logits=True).router_logits
    assert len(again) == 2
    for a, b in zip(again, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh = patch_moe(tiny_model("qwen3_moe"))  # never ran before patching
    assert len(fresh(input_ids=ids, output_router_logits=True).router_logits) == 2


def test_deepseek_keeps_fp32_router_in_bf16_model():
    hf = tiny_model("deepseek_v3").to(torch.bfloat16)
    for m in hf.modules():  # transformers' _keep_in_fp32_modules_strict, as from_pretrained applies it
        if type(m).__name__ == "DeepseekV3TopkRouter":
            m.float()
    ours = patch_moe(copy.deepcopy(hf))
    layer = next(m for m in ours.modules() if isinstance(m, HFMoELayer))
    assert layer.router.weight.dtype == torch.float32 and layer.w13.dtype == torch.bfloat16
    assert layer.cfg.router_dtype == "float32" and layer.cfg.group_limited
    ids = _batch(3)
    assert torch.isfinite(ours(input_ids=ids).logits).all()
    exported = hf_state_dict(ours)
    for k, v in hf.state_dict().items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k


def test_deepseek_fp64_bias_round_trips_exactly():
    """An fp64 model whose correction bias holds values fp32 cannot (fresh fp64 draws): patch,
    export and unpatch give back every tensor bit for bit, the bias included."""
    hf = fp64_copy(tiny_model("deepseek_v3"))
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    sd = hf.state_dict()
    assert any(k.endswith("e_score_correction_bias") and not torch.equal(v.float().double(), v) for k, v in sd.items())
    ours = patch_moe(copy.deepcopy(hf))
    exported = hf_state_dict(ours)
    for k, v in sd.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    back = unpatch_moe(ours)
    for k, v in back.state_dict().items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k
    ids = _batch(5)
    torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_fine_tuning_lowers_loss_like_hf(arch):
    """Eight AdamW steps on one fixed batch (loss includes the aux loss where the model has one):
    the patched model's loss falls as the original's does, step for step."""
    hf = tiny_model(arch)
    ours = patch_moe(copy.deepcopy(hf))
    ids = _batch(4, B=4, S=16)
    curves = []
    for model in (hf, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        losses = []
        for _ in range(8):
            loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        curves.append(losses)
    hf_curve, our_curve = curves
    assert our_curve[-1] < our_curve[0] - 0.1 and hf_curve[-1] < hf_curve[0] - 0.1, curves
    # Same init, data and optimizer: the curves differ only by fp32 rounding (measured ~1.2e-7 of
    # the loss after 8 steps); 1e-5 leaves room for Adam amplifying it and is 1e4 below the fall.
    for step, (a, b) in enumerate(zip(our_curve, hf_curve)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, curves)
    # And the trained weights export back to the transformers layout.
    fresh = tiny_model(arch)
    fresh.load_state_dict(hf_state_dict(ours))
    torch.testing.assert_close(fresh(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


# --- errors -------------------------------------------------------------------------------------

def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch_moe("not a model")
    dense = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, **_TOKENS))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM holds no supported sparse-MoE block .* already patched: 0"):
        patch_moe(dense)
    model = patch_moe(tiny_model("olmoe"))
    with pytest.raises(ValueError, match=r"already patched: 2"):
        patch_moe(model)
    with pytest.raises(ValueError, match="holds no HFMoELayer"):
        unpatch_moe(dense)
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 is not supported"):
        patch_moe(tiny_model("mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match=r"config.hidden_act is not silu"):
        patch_moe(tiny_model("qwen3_moe", hidden_act="gelu"))
    with pytest.raises(TypeError, match=r"Linear is not a supported sparse-MoE block"):
        HFMoELayer.from_hf_block(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model is itself a block"):
        patch_moe(make_block("olmoe"))


# --- expert parallelism (gloo, 2 ranks) ---------------------------------------------------------

def _ep_rank(rank: int, world: int, arch: str):
    import torch.distributed as dist
    model = patch_moe(tiny_model(arch), ep_group=dist.group.WORLD)
    layer = next(m for m in model.modules() if isinstance(m, HFMoELayer))
    ids = _batch(10 + rank)
    logits = model(input_ids=ids, output_router_logits=True).logits.detach()
    exported = hf_state_dict(model)  # collective: gathers the experts of every rank
    unpatch_moe(model)               # collective too
    # The original model's logits in this process too: the exactness check below must not compare
    # across processes with different thread counts (other GEMM blockings, other fp32 roundings).
    return dict(ids=ids, logits=logits, exported=exported, local=layer.num_local_experts,
                unpatched=model(input_ids=ids).logits.detach(), original=tiny_model(arch)(input_ids=ids).logits.detach())


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe"])
def test_expert_parallel_patch_export_unpatch(arch):
    """Each of 2 ranks keeps half the experts and routes its own batch through the all-to-all
    dispatcher: same logits as the original model; export and unpatch gather all experts back."""
    from _dist import run_world
    results = run_world(_ep_rank, 2, arch)
    hf = tiny_model(arch)
    sd = hf.state_dict()
    E = next(m for m in hf.modules() if type(m) is block_class(arch)).gate.weight.shape[0]
    for r in results:
        assert r["local"] == E // 2
        both_ways(r["logits"], hf(input_ids=r["ids"]).logits, fp64_copy(hf)(input_ids=r["ids"]).logits, "EP logits")
        assert set(r["exported"]) == set(sd)
        for k, v in sd.items():
            assert torch.equal(r["exported"][k], v), k
        torch.testing.assert_close(r["unpatched"], r["original"], rtol=0, atol=0)


def test_bench_separates_routing_flips_from_numerical_error():
    """bench/hf_block.py's sanity columns: a token whose top-K set differs between bf16 and fp32
    router logits is counted as a flip, and the rel diff is taken over the other tokens only."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import hf_block
    finally:
        sys.path.pop(0)
    # scores far apart in both precisions: no flips (a tie's bf16 order is up to topk)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 0.0], [0.5, 0.25], [0.0, 2.0]], dtype=torch.bfloat16)
    flips = hf_block.routing_flips(x, w, 2)
    assert flips.dtype == torch.bool and flips.tolist() == [False, False]
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = torch.tensor([[9.0, 9.0], [3.0, 4.04]])
    err, n = hf_block.compare(out, ref, torch.tensor([True, False]))
    assert n == 1 and abs(err - 0.04 / 4.0) < 1e-6  # the flipped row's error is left out
    err_all, n0 = hf_block.compare(out, ref, torch.tensor([False, False]))
    assert n0 == 0 and abs(err_all - 8.0 / 4.0) < 1e-6  # |9 - 1| / max|ref|
