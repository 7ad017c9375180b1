"""bench/moe_layer.py's LigerMoE provider on CPU (tier T0): the provider list and its one-line skip
where LigerMoE cannot run, the fp8 / bf16 / torchrun default sets, the runtime set up only when the
provider runs, and the weight-layout conversion checked through a torch emulation of LigerMoE's
documented math against the naive fp64 reference layer (tlx_dist.moe_reference)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _liger_cute  # noqa: E402
import moe_layer  # noqa: E402

from tlx_dist import MoEConfig, moe_reference  # noqa: E402

LIGER = moe_layer.LIGER
DEFAULT = ",".join(moe_layer.PROVIDERS)


def test_liger_cute_is_listed_in_both_modes_with_the_issue_shapes():
    assert LIGER == "liger_cute"
    assert LIGER in moe_layer.PROVIDERS and LIGER in moe_layer.EP_PROVIDERS
    assert LIGER not in moe_layer.FP8_PROVIDERS  # LigerMoE is bf16 only
    for name in ("qwen3-30b-a3b", "olmoe", "mixtral"):
        assert moe_layer.SHAPES[name] == moe_layer.EP_SHAPES[name]
    assert moe_layer.SHAPES["mixtral"] == (4096, 14336, 8, 2)


def _absent():
    return "liger_cute_kernels is not installed (pip install liger-cute-kernels liger-kernel)"


@pytest.mark.parametrize("world, rest", [(1, ["fused", "separate", "torchtitan"]),
                                         (2, ["fused_ep", "fused_ep_regions", "symm", "all_to_all"])])
def test_absent_liger_is_dropped_with_one_line_and_the_others_stay(capsys, world, rest):
    got = moe_layer.select_providers(DEFAULT, "bf16", world, optional={LIGER: _absent})
    assert got == rest
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{LIGER} skipped: {_absent()}"]


def test_the_real_availability_check_names_what_is_missing_here(capsys):
    # This box has no GPU (and no liger-cute-kernels): the real checks drop both optional anchors.
    why = _liger_cute.available()
    assert why and "\n" not in why
    if torch.cuda.is_available():
        pytest.skip("the CPU-box case only")
    got = moe_layer.select_providers(DEFAULT, "bf16", 1)
    assert got == ["fused", "separate", "torchtitan"]
    assert capsys.readouterr().out.splitlines() == [f"{LIGER} skipped: {why}"]


def test_available_liger_is_kept_and_the_fp8_defaults_are_unchanged(capsys):
    ok = {LIGER: lambda: "", "scaled_grouped_mm": lambda: ""}
    assert moe_layer.select_providers(DEFAULT, "bf16", 1, optional=ok) == list(moe_layer.PROVIDERS)
    assert moe_layer.select_providers(DEFAULT, "bf16", 2, optional=ok) == list(moe_layer.EP_PROVIDERS)
    # --precision fp8 with the default list: the FP8 set, LigerMoE not in it (bf16 only)
    assert moe_layer.select_providers(DEFAULT, "fp8", 1, optional=ok) == ["fused", "fp8", "scaled_grouped_mm"]
    # an explicit list is kept as given, in its order, whatever the precision
    assert moe_layer.select_providers(f"{LIGER},fused", "fp8", 1, optional=ok) == [LIGER, "fused"]
    assert capsys.readouterr().out == ""
    no_sgm = {"scaled_grouped_mm": lambda: "needs an sm_90+ GPU", LIGER: _absent}
    assert moe_layer.select_providers(DEFAULT, "fp8", 1, optional=no_sgm) == ["fused", "fp8"]
    assert capsys.readouterr().out.splitlines() == ["scaled_grouped_mm skipped: needs an sm_90+ GPU"]


def test_the_runtime_is_made_only_for_the_provider_and_sized_for_the_largest_problem(monkeypatch, capsys):
    made = []
    monkeypatch.setattr(_liger_cute, "LigerRuntime", lambda **kw: made.append(kw) or "rt")
    names = ["olmoe", "mixtral", "not-a-shape"]
    assert moe_layer.liger_runtime(["fused"], moe_layer.SHAPES, names, {4096, 16384}) is None
    assert moe_layer.liger_runtime([LIGER], moe_layer.SHAPES, names, set()) is None  # nothing to run
    assert made == []
    assert moe_layer.liger_runtime(["fused", LIGER], moe_layer.SHAPES, names, {8192, 16384}, group="g") == "rt"
    assert made == [dict(max_tokens=16384, hidden=4096, num_experts=64, top_k=8, group="g")]
    assert capsys.readouterr().out == ""


def test_a_failed_runtime_setup_drops_the_provider_with_one_line(monkeypatch, capsys):
    def boom(**kw):
        raise RuntimeError("LCK configure rejected: rank 0: no tuned table")

    monkeypatch.setattr(_liger_cute, "LigerRuntime", boom)
    providers = ["fused", LIGER, "torchtitan"]
    assert moe_layer.liger_runtime(providers, moe_layer.SHAPES, ["olmoe"], {16384}) is None
    assert providers == ["fused", "torchtitan"]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"{LIGER} skipped: its runtime setup failed: RuntimeError")


def _routed(T, D, Fe, E, K, seed, **cfg_kw):
    """x, router, w13, w2 in fp64, the naive reference's output and routing, and its gates."""
    g = torch.Generator().manual_seed(seed)
    cfg = MoEConfig(dim=D, moe_inter_dim=Fe, num_experts=E, top_k=K, **cfg_kw)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    wr = torch.randn(E, D, generator=g, dtype=torch.float64) * D ** -0.5
    w13 = torch.randn(E, D, 2 * Fe, generator=g, dtype=torch.float64) * D ** -0.5
    w2 = torch.randn(E, Fe, D, generator=g, dtype=torch.float64) * Fe ** -0.5
    out, idx, _, _ = moe_reference(x, wr, w13, w2, cfg)
    scores = torch.softmax(x @ wr.T, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(x @ wr.T)
    gate = scores.gather(1, idx)
    if cfg.route_norm:
        gate = gate / (gate.sum(-1, keepdim=True) + 1e-20)
    return x, w13, w2, out, idx, gate * cfg.route_scale


CASES = [  # (T, D, F, E, K, cfg): why each exists
    (9, 16, 12, 8, 2, {}),                              # the plain case
    (7, 10, 5, 7, 3, {}),                               # odd D and F, prime E: no half can line up by luck
    (5, 12, 6, 4, 1, {}),                               # K = 1: one expert per token
    (4, 8, 6, 4, 4, {}),                                # K = E: every expert on every token
    (1, 16, 8, 6, 2, {}),                               # a single token
    (6, 8, 4, 5, 2, dict(score_func="sigmoid", route_scale=2.5)),  # gates that do not sum to 1
]


@pytest.mark.parametrize("T, D, Fe, E, K, kw", CASES)
def test_converted_weights_give_the_reference_layer_output_in_fp64(T, D, Fe, E, K, kw):
    x, w13, w2, out, idx, gate = _routed(T, D, Fe, E, K, seed=T * 31 + E, **kw)
    gate_EID, up_EID, down_EDI = _liger_cute.to_liger_weights(w13, w2)
    assert gate_EID.shape == (E, Fe, D) and up_EID.shape == (E, Fe, D) and down_EDI.shape == (E, D, Fe)
    assert all(w.is_contiguous() and w.dtype == torch.float64 for w in (gate_EID, up_EID, down_EDI))
    y = _liger_cute.liger_moe_ref(x, idx, gate, gate_EID, up_EID, down_EDI)
    torch.testing.assert_close(y, out, rtol=1e-12, atol=1e-12)  # fp64: only summation order differs
    # the halves the other way round (gate <-> up) is a different layer: the check can fail
    wrong = _liger_cute.liger_moe_ref(x, idx, gate, up_EID, gate_EID, down_EDI)
    assert (wrong - out).abs().max() > 1e-3 * out.abs().max()


def test_gradients_map_back_to_our_layouts():
    x, w13, w2, _, idx, gate = _routed(6, 10, 6, 5, 2, seed=3)
    g_TD = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ours = [w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)]
    dw13, dw2 = torch.autograd.grad(_ours(x, idx, gate, *ours), ours, g_TD)
    theirs = [w.requires_grad_(True) for w in _liger_cute.to_liger_weights(w13, w2)]
    y = _liger_cute.liger_moe_ref(x, idx, gate, *theirs)
    got13, got2 = _liger_cute.from_liger_grads(*torch.autograd.grad(y, theirs, g_TD))
    torch.testing.assert_close(got13, dw13, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got2, dw2, rtol=1e-12, atol=1e-12)
    # the layouts round-trip exactly
    back13, back2 = _liger_cute.from_liger_grads(*_liger_cute.to_liger_weights(w13, w2))
    assert torch.equal(back13, w13) and torch.equal(back2, w2)
    assert _liger_cute.from_liger_grads(*theirs[:2])[1] is None


@pytest.mark.parametrize("T, D, Fe, E, K, kw", CASES)
def test_the_bench_reference_is_the_reference_layer_and_its_ep_shares_sum_to_it(T, D, Fe, E, K, kw):
    x, w13, w2, out, idx, gate = _routed(T, D, Fe, E, K, seed=T * 7 + K, **kw)
    whole = _liger_cute.experts_ref(x, idx, gate, w13, w2, dtype=torch.float64)
    torch.testing.assert_close(whole.double(), out, rtol=1e-6, atol=1e-6)  # fp32 output of fp64 math
    if E % 2 == 0:  # two EP ranks: each adds its own experts' share
        e = E // 2
        shares = [_liger_cute.experts_ref(x, idx, gate, w13[r * e:(r + 1) * e], w2[r * e:(r + 1) * e],
                                          first_expert=r * e, dtype=torch.float64) for r in range(2)]
        torch.testing.assert_close(shares[0] + shares[1], whole, rtol=1e-6, atol=1e-6)
    # zero-token experts (none picked) add nothing and do not fail
    none = _liger_cute.experts_ref(x, torch.full_like(idx, E), gate, w13, w2, dtype=torch.float64)
    assert torch.equal(none, torch.zeros_like(none))


def test_check_close_accepts_bf16_level_error_and_rejects_a_wrong_or_nan_output():
    x, w13, w2, _, idx, gate = _routed(32, 64, 48, 8, 2, seed=5)
    x, w13, w2 = x.float(), w13.float(), w2.float()
    ref = _liger_cute.experts_ref(x, idx, gate, w13, w2)
    twin = _liger_cute.experts_ref(x, idx, gate, w13, w2, dtype=torch.bfloat16).to(torch.bfloat16)
    err, bad = _liger_cute.check_close(ref.to(torch.bfloat16), ref, twin)  # one rounding: well inside
    assert bad is None and err > 0
    err, bad = _liger_cute.check_close(twin, ref, twin)
    assert bad is None
    assert _liger_cute.check_close((ref * 1.1).to(torch.bfloat16), ref, twin)[1].startswith("output off")
    nan = ref.clone()
    nan[3, 5] = float("nan")
    assert _liger_cute.check_close(nan, ref, twin)[1] is not None


def test_bad_weights_name_the_argument():
    with pytest.raises(ValueError, match="w13_EDF2"):
        _liger_cute.to_liger_weights(torch.zeros(2, 4, 5), torch.zeros(2, 2, 4))  # odd 2F
    with pytest.raises(ValueError, match="w2_EFD"):
        _liger_cute.to_liger_weights(torch.zeros(2, 4, 6), torch.zeros(2, 4, 3))  # w2 transposed
    with pytest.raises(ValueError, match="3-D"):
        _liger_cute.to_liger_weights(torch.zeros(4, 6), torch.zeros(3, 4))


class _FakeRuntime:
    """Stands in for LigerRuntime on CPU: records each call and computes LigerMoE's math."""
    group = None

    def __init__(self):
        self.calls = []

    def moe_fused(self, x, idx, gate, gate_EID, up_EID, down_EDI, num_experts, top_k, pg):
        self.calls.append((idx, gate, num_experts, top_k, pg))
        return _liger_cute.liger_moe_ref(x, idx, gate.to(x.dtype), gate_EID, up_EID, down_EDI)


def _ours(x, idx, gate, w13, w2):
    """Our layout's SwiGLU MoE, token by token (differentiable)."""
    Fe = w2.shape[1]
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for k in range(idx.shape[1]):
            h = x[t] @ w13[idx[t, k]]
            y = y + gate[t, k] * ((F.silu(h[:Fe]) * h[Fe:]) @ w2[idx[t, k]])
        rows.append(y)
    return torch.stack(rows)


def test_the_provider_runs_liger_on_the_layers_routing_and_maps_dw13_back():
    from tlx_dist import MoELayer

    cfg = MoEConfig(dim=12, moe_inter_dim=6, num_experts=5, top_k=2, dtype="float64", init_std=0.3)
    layer = MoELayer(cfg)
    rt = _FakeRuntime()
    liger = _liger_cute.LigerExperts(rt, layer.w13, layer.w2, cfg.num_experts, cfg.top_k)
    assert all(p.is_leaf and p.requires_grad and p.is_contiguous() for p in liger.params)
    x = torch.randn(7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).requires_grad_(True)
    out = moe_layer.provider_fn(layer, LIGER, liger=liger)(x)
    route = layer.router(x)
    (idx, gate, E, K, pg), = rt.calls
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), route.idx_TK)
    assert gate.dtype == torch.bfloat16 and torch.equal(gate, route.gate_TK.to(torch.bfloat16))  # LigerMoE takes bf16 gates
    assert (E, K, pg) == (5, 2, None)
    w13 = layer.w13.detach().clone().requires_grad_(True)
    ref = _ours(x.detach(), idx.long(), gate.double(), w13, layer.w2.detach())
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g_TD = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(liger.dw13(out, g_TD), torch.autograd.grad(ref, w13, g_TD)[0], rtol=1e-12, atol=1e-12)
