"""Scaling benchmark harness and projection model (issues 11 and 35), on CPU.

T0: the phase attribution of the harness; the exchange traffic per leg (flat, hierarchical, per
slot) against brute-force enumeration of every routing on small cases, and the group-limited
router's Monte Carlo against the rule written out per token; the layouts' collectives and the
overlap rule; the projection against the committed measurements (within 10%, fit and check points),
that check points feed nothing, and its invariants (more NIC bandwidth never lowers MFU, the
hierarchical exchange never moves more NIC bytes than the flat one and equals it on one node,
gradient accumulation amortizes under HSDP); its errors. T1: the harness itself under a one-process
run, and a 2-node x 2-process torchrun on loopback (gloo), as tests/test_train_dist.py launches them.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from _train import ROOT, TINY, _env, free_port

sys.path.insert(0, str(ROOT / "bench"))
import scaling  # noqa: E402
import scaling_checks as sc  # noqa: E402
import scaling_layouts as sl  # noqa: E402
import scaling_model as sm  # noqa: E402
import scaling_report as rep  # noqa: E402
import scaling_traffic as st  # noqa: E402

SCRIPT = str(ROOT / "bench" / "scaling.py")
# The tiny training-test model (tests/_train.py), 2 sequences per rank, few timed steps.
HARNESS_ARGS = ["--config", str(ROOT / "configs" / "debug_cpu.toml")] + \
    [a for o in TINY + ["data.batch_size=2"] for a in ("--override", o)] + \
    ["--steps", "2", "--rounds", "1", "--warmup", "1", "--no-results"]


# ------------------------------------------------------------------------------ phase attribution

def test_attribute_partitions_the_timeline():
    marks = [("+", "fwd"), ("+", "attention"), ("+", "experts"), ("+", "dispatch"), ("-", "dispatch"),
             ("-", "experts"), ("-", "attention"), ("-", "fwd"), ("+", "optimizer"), ("-", "optimizer")]
    stamps = [0.0, 1.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 9.5, 12.0]
    got = scaling.attribute(marks, stamps)
    assert got == {"fwd": 1.0 + 1.0, "attention.fwd": 2.0 + 1.0, "experts.fwd": 1.0 + 1.0,
                   "dispatch.fwd": 2.0, "other": 0.5, "optimizer": 2.5}
    assert math.isclose(sum(got.values()), stamps[-1] - stamps[0])


def test_attribute_interleaved_and_stray_closes():
    # Why: the autograd engine may run a phase's closing marker after a later phase opened
    # (interleaved branches), and a closing marker may fire for a phase that never opened (a
    # tensor whose forward ran with the clock off). Neither may lose or double-count time.
    marks = [("+", "bwd"), ("+", "combine"), ("+", "route"), ("-", "combine"), ("-", "experts"),
             ("-", "route"), ("-", "bwd")]
    stamps = [0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 7.0]
    got = scaling.attribute(marks, stamps)
    assert got == {"bwd": 1.0 + 1.0, "combine.bwd": 1.0, "route.bwd": 2.0 + 1.0 + 1.0}
    assert math.isclose(sum(got.values()), 7.0)


def test_attribute_bad_input():
    with pytest.raises(ValueError, match="2 marks but 1"):
        scaling.attribute([("+", "a"), ("-", "a")], [0.0])
    with pytest.raises(ValueError, match="mark op"):
        scaling.attribute([("*", "a"), ("-", "a")], [0.0, 1.0])


# ------------------------------------------------------------------------------ traffic model

def _subsets(E, K):
    return list(itertools.combinations(range(E), K))


def _brute_rows(E, K, ep, g):
    """Rows per token per op of each design, counted on every K-subset of the E experts (uniform
    top-K) and every source rank, exactly (Fractions): per slot, per distinct rank, per distinct
    node with the landing rank (same local index) forwarding to the node's other hit ranks."""
    e, n = E // ep, ep // g
    acc = {k: [Fraction(0), Fraction(0)] for k in st.TRAFFIC}
    subs = _subsets(E, K)
    for src in range(ep):
        a, i = divmod(src, g)
        for s in subs:
            ranks = [x // e for x in s]
            for r in ranks:
                if r != src:
                    acc["per_slot"][0 if r // g == a else 1] += 1
            hit = set(ranks) - {src}
            own = sum(1 for r in hit if r // g == a)
            remote = {r // g for r in hit if r // g != a}
            acc["rank_dedup"][0] += own
            acc["rank_dedup"][1] += len(hit) - own
            fwd = sum(1 for r in hit if r // g != a and r % g != i)
            acc["node_dedup"][0] += own + fwd
            acc["node_dedup"][1] += len(remote)
    tot = len(subs) * ep
    return {k: (v[0] / tot, v[1] / tot) for k, v in acc.items()}


@pytest.mark.parametrize("E,K,ep,g", [
    (8, 2, 4, 2),      # two nodes of two ranks, two experts a rank
    (12, 3, 6, 3),     # two nodes of three ranks
    (12, 3, 6, 2),     # three nodes: the forward goes to the other two nodes
    (8, 8, 4, 2),      # K = E: every rank and node is hit by every token
    (6, 1, 6, 2),      # K = 1: nothing to deduplicate, one row per op
    (8, 3, 8, 4),      # one expert per rank: rank dedup saves nothing over per-slot
    (12, 4, 4, 4),     # one node: no NIC rows, hierarchical = flat
    (16, 4, 4, 1),     # one rank per node: every peer is remote, no forward
])
def test_exchange_rows_match_brute_force(E, K, ep, g):
    want = _brute_rows(E, K, ep, g)
    p_rank, p_node = st.hit_probabilities(E, K, ep, g)
    e = E // ep
    subs = _subsets(E, K)
    assert math.isclose(p_rank[0], float(Fraction(sum(1 for s in subs if any(x // e == 0 for x in s)), len(subs))))
    assert math.isclose(p_node[0], float(Fraction(sum(1 for s in subs if any(x // (g * e) == 0 for x in s)), len(subs))))
    for kind in st.TRAFFIC:
        legs = st.exchange_rows(kind, E, K, ep, g)
        assert math.isclose(legs.nvlink, float(want[kind][0]), abs_tol=1e-12), (kind, legs, want[kind])
        assert math.isclose(legs.nic, float(want[kind][1]), abs_tol=1e-12), (kind, legs, want[kind])
        assert math.isclose(legs.nodes_hit, ep // g * p_node[0])


def _router_loop_hits(E, K, ep, g, n_group, topk_group, score_func, tokens):
    """The router's group-limited rule written out per token in plain Python, on the same seeded
    logits as ``scaling_traffic``'s Monte Carlo: (hits per rank, hits per node) counts."""
    import torch
    gen = torch.Generator().manual_seed(st.MC_SEED)
    logits = torch.randn(tokens, E, generator=gen)
    scores = (logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()).tolist()
    S, e = E // n_group, E // ep
    hr, hn = [0] * ep, [0] * (ep // g)
    for row in scores:
        gsc = [sum(sorted(row[j * S:(j + 1) * S], reverse=True)[:min(2, S)]) for j in range(n_group)]
        keep = set(sorted(range(n_group), key=lambda j: -gsc[j])[:topk_group])
        pool = [x for x in range(E) if x // S in keep]
        top = sorted(pool, key=lambda x: -row[x])[:K]
        for r in {x // e for x in top}:
            hr[r] += 1
        for b in {x // (g * e) for x in top}:
            hn[b] += 1
    return hr, hn


@pytest.mark.parametrize("E,K,ep,g,n_group,topk_group,score", [
    (16, 4, 8, 2, 4, 2, "sigmoid"),     # groups = nodes, a token on <= 2 of 4 nodes (DeepSeek-V3 style)
    (24, 6, 6, 2, 3, 1, "softmax"),     # one node per token: every expert of a token on one node
    (16, 3, 4, 2, 8, 3, "sigmoid"),     # groups finer than nodes (8 groups, 2 nodes)
])
def test_group_limited_hits_match_the_rule_written_out(monkeypatch, E, K, ep, g, n_group, topk_group, score):
    # The Monte Carlo counts hits with tensor ops through tlx_dist.router.group_limited_topk; the
    # same logits through a per-token loop must give the same counts exactly.
    tokens = 512
    monkeypatch.setattr(st, "MC_TOKENS", tokens)
    st._router_hits.cache_clear()
    try:
        p_rank, p_node = st.hit_probabilities(E, K, ep, g, st.Routing(n_group, topk_group, score))
    finally:
        st._router_hits.cache_clear()
    hr, hn = _router_loop_hits(E, K, ep, g, n_group, topk_group, score, tokens)
    assert [round(p * tokens) for p in p_rank] == hr
    assert [round(p * tokens) for p in p_node] == hn
    assert all(math.isclose(p * tokens, round(p * tokens), abs_tol=1e-6) for p in p_rank + p_node)


def test_group_limited_rows_bounds():
    # groups = nodes: every token reaches between 1 and topk_group nodes, so the expected count is too
    E, K, ep, g = 128, 8, 32, 8
    for M in (1, 2, 3):
        legs = st.exchange_rows("node_dedup", E, K, ep, g, st.Routing(4, M, "sigmoid"))
        assert 1.0 <= legs.nodes_hit <= M + 1e-9
        assert legs.nic <= (ep // g - 1) / (ep // g) * M + 1e-9   # the token's own node is free
    one = st.exchange_rows("node_dedup", E, K, ep, g, st.Routing(4, 1, "sigmoid"))
    assert math.isclose(one.nodes_hit, 1.0)
    # the chosen node is uniform over the 4 (symmetric routing): 3/4 of the tokens leave their node
    assert abs(one.nic - 0.75) < 4 * math.sqrt(0.75 * 0.25 / st.MC_TOKENS)
    # The router keeps each chosen group's top-2: it reaches more of its allowed nodes than a uniform
    # K-draw from their experts would (the docstring's reason for not using that closed form).
    # (8 nodes of 8 experts, 4 per token, K=8: a uniform draw from the 32 reaches 3.72 of them.)
    four = st.exchange_rows("node_dedup", 64, 8, 32, 4, st.Routing(8, 4, "sigmoid"))
    pool, per_node = 4 * 8, 8
    uniform = 4 * (1 - math.comb(pool - per_node, 8) / math.comb(pool, 8))
    assert four.nodes_hit > uniform + 0.1


def test_hierarchical_never_more_nic_rows_and_one_node_is_flat():
    routings = (st.Routing(), st.Routing(8, 4, "sigmoid"), st.Routing(4, 2, "softmax"))
    for E, K, ep, g in [(64, 8, 16, 8), (64, 8, 64, 8), (128, 8, 32, 8), (64, 6, 8, 8), (32, 8, 32, 4)]:
        for ro in routings:
            if ro.n_group > 1 and E % ro.n_group:
                continue
            flat = st.exchange_rows("rank_dedup", E, K, ep, g, ro)
            hier = st.exchange_rows("node_dedup", E, K, ep, g, ro)
            slot = st.exchange_rows("per_slot", E, K, ep, g, ro)
            assert hier.nic <= flat.nic + 1e-12 and flat.nic + flat.nvlink <= slot.nic + slot.nvlink + 1e-12
            if ep == g:
                assert (hier.nvlink, hier.nic) == (flat.nvlink, flat.nic) and hier.nic == 0.0


def test_traffic_bad_input():
    with pytest.raises(ValueError, match="traffic='bogus'"):
        st.exchange_rows("bogus", 64, 8, 8, 8)
    with pytest.raises(ValueError, match="ep=7"):
        st.exchange_rows("per_slot", 64, 8, 7, 7)
    with pytest.raises(ValueError, match="top_k=9"):
        st.exchange_rows("per_slot", 8, 9, 2, 2)
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        st.exchange_rows("per_slot", 64, 8, 8, 3)
    with pytest.raises(ValueError, match="n_group=3"):
        st.exchange_rows("node_dedup", 64, 8, 16, 8, st.Routing(3, 1))
    with pytest.raises(ValueError, match="topk_group=0"):
        st.exchange_rows("node_dedup", 64, 8, 16, 8, st.Routing(4, 0))
    with pytest.raises(ValueError, match="leaves 4 experts"):
        st.exchange_rows("node_dedup", 64, 8, 64, 8, st.Routing(16, 1))
    with pytest.raises(ValueError, match="score_func='relu'"):
        st.exchange_rows("node_dedup", 64, 8, 16, 8, st.Routing(2, 1, "relu"))


# ------------------------------------------------------------------------------ layouts

_BW = {"nvlink": 300e9, "nic": 40e9}
_HOP = {"nvlink": 3e-6, "nic": 5e-6}
_PARAMS = {"dense_units": [1e7] * 4 + [2e6], "moe_layers": 4, "experts": 8e8, "replicated": 4e6}


def test_collective_formulas():
    assert sl.ring_ag_rs_s(8e9, 1, 1e9, 1e-3) == 0.0 and sl.all_reduce_s(8e9, 1, 1e9, 1e-3) == 0.0
    assert math.isclose(sl.ring_ag_rs_s(4e9, 4, 1e9, 1e-3), 3.0 + 3e-3)
    # small message over many ranks: the tree's log latency wins; large over few: the ring's bytes
    assert math.isclose(sl.all_reduce_s(1e3, 1024, 1e9, 1e-5), 2e-6 + 2 * 10 * 1e-5)
    assert math.isclose(sl.all_reduce_s(1e9, 2, 1e9, 1e-5), 2 * 1e9 * 0.5 / 1e9 + 2e-5)
    assert sl.node_size(1024, 72) == 64 and sl.node_size(4, 8) == 4 and sl.node_size(24, 8) == 8


def test_layouts_one_node_keep_off_the_nic():
    for layout in sl.SHARDINGS:
        for ep in (1, 2, 8):
            plan = sl.plan_layout(layout, 8, ep, 8, _PARAMS, _BW, _HOP)
            assert plan.bytes_per_step("nic", 4) == 0.0 and all(u.link == "nvlink" for u in plan.units)
    # one node: both shardings hold the same shards (hybrid = full inside a node)
    f, h = (sl.plan_layout(x, 8, 8, 8, _PARAMS, _BW, _HOP) for x in sl.SHARDINGS)
    assert math.isclose(f.held_params, h.held_params) and f.fsdp_params == h.fsdp_params


def test_hybrid_amortizes_over_grad_accum_and_full_does_not():
    for ep in (8, 16, 64):
        h = sl.plan_layout("hybrid", 256, ep, 8, _PARAMS, _BW, _HOP)
        f = sl.plan_layout("full", 256, ep, 8, _PARAMS, _BW, _HOP)
        # hybrid: what crosses nodes is the all-reduce of the last micro-batch (and finish_grads);
        # full: the all-gathers cross nodes every micro-batch, the reduce-scatter on the last
        assert h.bytes_per_step("nic", 1) == h.bytes_per_step("nic", 8) > 0
        assert all(u.when in ("step", "post") for u in h.units if u.link == "nic")
        gathers = sum(u.nbytes for u in f.units if u.link == "nic" and u.when in ("fwd", "bwd"))
        per = {w: sum(1 for u in f.units if u.when == w) for w in ("fwd", "bwd", "step")}
        assert gathers > 0 and per["fwd"] == per["bwd"] == per["step"]   # AG fwd, AG bwd, RS last
        assert math.isclose(f.bytes_per_step("nic", 8) - f.bytes_per_step("nic", 1), 7 * gathers, rel_tol=1e-12)
        assert h.bytes_per_step("nic", 1) < f.bytes_per_step("nic", 1)
    # experts: sharded over EP and the in-node part of EDP; the all-reduce carries that shard
    h8 = sl.plan_layout("hybrid", 256, 8, 8, _PARAMS, _BW, _HOP)
    h64 = sl.plan_layout("hybrid", 256, 64, 8, _PARAMS, _BW, _HOP)
    assert h8.detail["expert_shard"] == 1 and h8.detail["expert_replicas"] == 32
    assert math.isclose(h8.detail["held_experts"], 8e8 / 8) and math.isclose(h64.detail["held_experts"], 8e8 / 64)
    h2 = sl.plan_layout("hybrid", 256, 2, 8, _PARAMS, _BW, _HOP)
    assert h2.detail["expert_shard"] == 4 and math.isclose(h2.detail["held_experts"], 8e8 / 8)
    bf = sl.plan_layout("hybrid", 256, 8, 8, _PARAMS, _BW, _HOP, "bfloat16")
    assert math.isclose(bf.bytes_per_step("nic", 1), h8.bytes_per_step("nic", 1) / 2)


def test_bf16_reduction_keeps_fp32_sums_as_train_does():
    # train/parallelize.set_gradient_sync: under bf16 reduction a fully sharded unit reduce-scatters
    # every micro-batch (its sum over micro-batches is the fp32 sharded gradient); under fp32 only
    # the last. HSDP reduce-scatters every micro-batch either way, and keeps a partial sum of its
    # shard between micro-batches (the elements keep_accumulation_fp32 casts under bf16).
    for G in (8, 256):
        f32 = sl.plan_layout("full", G, 8, 8, _PARAMS, _BW, _HOP)
        f16 = sl.plan_layout("full", G, 8, 8, _PARAMS, _BW, _HOP, "bfloat16")
        assert {u.when for u in f32.units if u.nbytes and u.what != "router/shared all-reduce over ep"} == {"fwd", "bwd", "step"}
        assert "step" not in {u.when for u in f16.units}
        assert sum(u.when == "bwd" for u in f16.units) == 2 * sum(u.when == "bwd" for u in f32.units)
        assert f32.detail["accumulation_params"] > 0 and f16.detail["accumulation_params"] == 0.0
        assert f16.detail["partial_sum_params"] == f32.detail["partial_sum_params"] == 0.0
        # per step, 4 bf16 reduce-scatters carry twice the bytes of one fp32 one; the gathers are the same
        rs32 = sum(u.nbytes for u in f32.units if u.when == "step")
        rs16 = sum(u.nbytes for u in f16.units if u.when == "bwd") - sum(u.nbytes for u in f32.units if u.when == "bwd")
        assert math.isclose(4 * rs16, 2 * rs32, rel_tol=1e-12)
    h = sl.plan_layout("hybrid", 256, 8, 8, _PARAMS, _BW, _HOP, "bfloat16")
    assert math.isclose(h.detail["partial_sum_params"], h.held_params - h.detail["local_dense"] - h.detail["local_moe"])
    assert h.detail["accumulation_params"] == h.detail["partial_sum_params"]


def test_exposed_rule():
    u = sl.Unit
    plan = sl.LayoutPlan("hybrid", 8, 1.0, 0.0, (u("a", "fwd", "nvlink", 1, 0.2), u("a", "fwd", "nvlink", 1, 0.3),
                                               u("b", "bwd", "nvlink", 1, 0.5), u("c", "step", "nic", 1, 1.0),
                                               u("d", "post", "nvlink", 1, 0.05)))
    idle = {"nvlink": 0.0, "nic": 0.0}
    # comm within the compute: only the largest unit shows (the first gather / the last reduction)
    e = sl.exposed_comm_s(plan, 1, 10.0, 10.0, idle, idle)
    assert math.isclose(e["fwd"], 0.3) and math.isclose(e["last_bwd"], 1.0) and e["bwd"] == 0.0
    assert math.isclose(e["total"], 0.3 + 1.0 + 0.05) and math.isclose(e["comm"], 0.5 + 0.5 + 1.0 + 0.05)
    # comm past the compute: the excess shows too; the exchange's NIC time shrinks the window
    e = sl.exposed_comm_s(plan, 1, 0.1, 1.2, idle, {"nvlink": 0.0, "nic": 0.7})
    assert math.isclose(e["fwd"], 0.5 - 0.1 + 0.3) and math.isclose(e["last_bwd"], 1.5 - 0.5 + 1.0)
    # grad_accum: every micro-batch gathers and reduces in node, the step's all-reduce once
    e4 = sl.exposed_comm_s(plan, 4, 0.1, 0.2, idle, idle)
    assert math.isclose(e4["fwd"], 4 * (0.5 - 0.1 + 0.3)) and math.isclose(e4["bwd"], 3 * (0.5 - 0.2 + 0.5))
    assert math.isclose(e4["last_bwd"], 1.5 - 0.2 + 1.0)


def test_reduce_dtype_comes_from_the_recipe(cal):
    # Scenario.reduce_dtype=None is the recipe's parallel.reduce_dtype; b200_16x8 sets bfloat16
    b16 = sm.load_recipe("b200_16x8")
    b32 = sm.load_recipe("b200_16x8", ["parallel.reduce_dtype=float32"])
    assert b16.parallel.reduce_dtype == "bfloat16"
    for G in (64, 1024):
        a = sm.project(b16, sm.Scenario("B200", G, 8, "fused"), cal)
        b = sm.project(b32, sm.Scenario("B200", G, 8, "fused", reduce_dtype="bfloat16"), cal)
        c = sm.project(b32, sm.Scenario("B200", G, 8, "fused"), cal)
        assert a.step_ms == b.step_ms and a.legs_gb == b.legs_gb and a.detail["reduce_dtype"] == "bfloat16"
        assert c.detail["reduce_dtype"] == "float32"
        # HSDP, one micro-batch: every gradient byte on the NICs halves, and the step is no longer
        assert math.isclose(a.legs_gb["grad_sync"]["nic"], c.legs_gb["grad_sync"]["nic"] / 2, rel_tol=1e-12)
        assert a.step_ms <= c.step_ms
    with pytest.raises(ValueError, match="reduce_dtype='bf16' must be one of"):
        sm.project(b16, sm.Scenario("B200", 8, 8, reduce_dtype="bf16"), cal)


def test_targets_project_the_recipe_files(cal):
    # A target's parameters are its recipe's, never overridden: the chosen series runs with the
    # file's EP, sharding, micro-batches, reduce dtype and tokens per GPU, and every recipe is a
    # multi-node one (hybrid sharding).
    for t in rep.TARGETS:
        cfg = sm.load_recipe(t.recipe)
        assert cfg.parallel.sharding == "hybrid", t.recipe
        p = rep.target_series(t, cal, gpus=(1024,))["chosen"][0]
        assert (p.scenario.sharding, p.scenario.grad_accum, p.scenario.reduce_dtype, p.scenario.node_limit) == (None,) * 4
        d = p.detail
        assert (p.scenario.ep, d["sharding"], d["grad_accum"], d["reduce_dtype"]) == (
            cfg.parallel.ep, cfg.parallel.sharding, cfg.train.grad_accum, cfg.parallel.reduce_dtype), t.recipe
        assert d["tokens_per_step"] == cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum
        assert rep.recipe_params(cfg)["tokens"] == cfg.data.batch_size * cfg.data.seq_len


def test_memory_estimate(cal, tmp_path):
    # A7: the profile.memory point reproduces by construction; the other measured peaks are
    # predicted within 15% (the estimate counts the state exactly and scales one measured
    # activation rate); activations grow linearly with the tokens of a micro-batch, not with grad_accum
    rows = sc.check_memory(cal)
    assert {r["use"] for r in rows} == {"calibration", "check"} and len(rows) >= 3
    for r in rows:
        assert abs(r["error"]) < (1e-9 if r["use"] == "calibration" else 0.15), r
    base = sm.load_recipe("b200_16x8")
    a = sm.project(base, sm.Scenario("B200", 64, 8, "fused"), cal)
    b = sm.project(sm.load_recipe("b200_16x8", [f"data.batch_size={2 * base.data.batch_size}"]),
                   sm.Scenario("B200", 64, 8, "fused"), cal)
    c = sm.project(base, sm.Scenario("B200", 64, 8, "fused", grad_accum=4), cal)
    assert math.isclose(b.activation_gb, 2 * a.activation_gb) and a.activation_gb > 0
    assert c.activation_gb == a.activation_gb and b.state_gb == a.state_gb
    # grad_accum > 1 under HSDP keeps an fp32 partial sum of the held shard between micro-batches
    assert c.state_gb > a.state_gb
    # a check point's peak feeds nothing; the memory point's moves the estimate
    d = _cal_json()
    for m in d["measurements"]:
        if "peak_mem_gib" in m and m["id"] != d["profile"]["memory"]:
            m["peak_mem_gib"] *= 2
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    assert sm.project(base, sm.Scenario("B200", 64, 8, "fused"), sm.load_calibration(path)).activation_gb == a.activation_gb
    next(m for m in d["measurements"] if m["id"] == d["profile"]["memory"])["peak_mem_gib"] *= 1.1
    path.write_text(json.dumps(d))
    assert sm.project(base, sm.Scenario("B200", 64, 8, "fused"), sm.load_calibration(path)).activation_gb > a.activation_gb


def test_layout_bad_input():
    with pytest.raises(ValueError, match="sharding='zero3'"):
        sl.plan_layout("zero3", 8, 8, 8, _PARAMS, _BW, _HOP)
    with pytest.raises(ValueError, match="gpus=12 must be a multiple of ep=8"):
        sl.plan_layout("hybrid", 12, 8, 8, _PARAMS, _BW, _HOP)
    with pytest.raises(ValueError, match="reduce_dtype='fp16'"):
        sl.plan_layout("hybrid", 16, 8, 8, _PARAMS, _BW, _HOP, "fp16")


# ------------------------------------------------------------------------------ projection

@pytest.fixture(scope="module")
def cal():
    return sm.load_calibration()


def _cal_json() -> dict:
    return json.loads(Path(sm.DEFAULT_CALIBRATION).read_text())


def test_projection_reproduces_measured_points(cal):
    """Every measured 1- and 2-GPU point within 10%: the two one-GPU profile paths are the fit
    (reproduced by construction, up to the phases the fused profile supplies for both); every
    other point -- harness and training loop, symmetric exchange with separate or fused expert
    ops, NCCL all-to-all -- is predicted out of sample."""
    rows = sc.check_measurements(cal)
    checks = {(r["gpus"], r["preset"]) for r in rows if r["use"] == "check"}
    assert {(2, "dedup"), (2, "reference"), (2, "fused"), (1, "fused")} <= checks
    assert {(r["gpus"], r["preset"]) for r in rows if r["use"] == "calibration"} == {(1, "fused"), (1, "reference")}
    for r in rows:
        assert abs(r["error"]) < 0.10, (r["id"], r["measured_ms"], r["predicted_ms"])
        if r["measured_mfu"] is not None:   # the model's MFU is the loop's (same flops_per_token)
            expect = r["measured_tps"] / r["predicted_tps"] * r["predicted_mfu"]
            assert abs(expect - r["measured_mfu"]) < 0.002, r["id"]
    # the row-form op at its check point (never fitted) within 10% as well
    for tokens, op, use, meas, fit in sm.row_op_fit(cal)["checks"]:
        assert abs(fit / meas - 1) < (1e-9 if use == "calibration" else 0.10), (tokens, op)


def test_check_points_feed_no_parameter(tmp_path):
    # Out of sample means the check points cannot move a prediction: rewrite every check point's
    # measurement (throughput, phases, the row-form check op) and every projection must stay the
    # same; move a fit point instead and the projections that use it must change.
    base = sm.load_calibration()
    want = {r["id"]: r["predicted_ms"] for r in sc.check_measurements(base)}
    d = _cal_json()
    for m in d["measurements"]:
        if m["use"] == "check":
            m["tokens_per_s_per_gpu"] *= 1.5
            m["phases_ms"] = {k: 3 * v for k, v in m.get("phases_ms", {}).items()}
    for pt in d["row_exchange_profile"]["points"]:
        if pt["use"] == "check":
            pt["dispatch_us"] *= 2
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    got = {r["id"]: r["predicted_ms"] for r in sc.check_measurements(sm.load_calibration(path))}
    assert got == want
    for m in d["measurements"]:
        if m["id"] == d["profile"]["separate"]:
            m["phases_ms"]["combine.bwd"] *= 2
    for pt in d["row_exchange_profile"]["points"]:
        if pt["use"] == "calibration" and pt["tokens"] > 1000:
            pt["combine_us"] *= 1.5
    path.write_text(json.dumps(d))
    moved = {r["id"]: r["predicted_ms"] for r in sc.check_measurements(sm.load_calibration(path))}
    ref2 = [m["id"] for m in d["measurements"] if m["gpus"] == 2 and m["preset"] == "reference"]
    fused2 = [m["id"] for m in d["measurements"] if m["gpus"] == 2 and m["preset"] == "fused"]
    assert ref2 and all(moved[i] > want[i] for i in ref2)
    assert fused2 and all(moved[i] > want[i] for i in fused2)


def test_projection_calibration_identity(cal):
    # At the profiled runs the categories must come back as measured: a check that the rates were
    # derived from, and are applied with, the same counts (parameter casts included).
    p = cal.profile
    cfg = sm.load_recipe(p["recipe"], p["overrides"])
    fused = sm.group_phases(cal.measurement(p["fused"])["phases_ms"])
    pr = sm.project(cfg, sm.Scenario(cal.hardware, 1, 1, "fused"), cal)
    for cat in sm.CATEGORIES:
        assert math.isclose(pr.phases_ms[cat], fused[cat], rel_tol=1e-9, abs_tol=1e-9), cat
    assert math.isclose(pr.step_ms, sum(fused.values()), rel_tol=1e-9)
    sep = sm.group_phases(cal.measurement(p["separate"])["phases_ms"])
    pr = sm.project(cfg, sm.Scenario(cal.hardware, 1, 1, "reference"), cal)
    for cat in ("experts", "exchange"):
        assert math.isclose(pr.phases_ms[cat], sep[cat], rel_tol=1e-9), cat
    # one GPU, either layout: nothing over a link; one micro-batch is the profile, more only spread
    # the per-step costs (optimizer, norm, parameter refresh) over more tokens
    one = sm.project(cfg, sm.Scenario(cal.hardware, 1, 1, "fused"), cal)
    for layout in sm.SHARDINGS:
        for A in (1, 3):
            q = sm.project(cfg, sm.Scenario(cal.hardware, 1, 1, "fused", sharding=layout, grad_accum=A), cal)
            assert q.exchange_gb == 0.0 and q.legs_gb["grad_sync"] == {"nvlink": 0.0, "nic": 0.0}
            if A == 1:
                assert math.isclose(q.step_ms, one.step_ms, rel_tol=1e-12)
            else:
                assert q.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu


def test_group_phases_covers_the_harness():
    # Every label the harness writes for a step must land in one model category, once.
    cats = sm.group_phases({k: 1.0 for k in EXPECTED_STEP | {"other"}})
    assert sum(cats.values()) == len(EXPECTED_STEP) + 1 and cats["FSDP copies"] == 0.0
    assert cats["exchange"] == 4 and cats["experts"] == 4 and cats["rest"] == 3
    with pytest.raises(ValueError, match="phase 'warp.fwd'"):
        sm.group_phases({"warp.fwd": 1.0})
    with pytest.raises(ValueError, match=r"\['optimizer'\]=-1"):
        sm.group_phases({"optimizer": -1})


def test_route_rows_match_the_profile():
    # The cumsum rate is per histogram row: these are the rows of the profiled shapes (E=256,
    # K=8: 8-token blocks; the h200_1gpu shape E=64: 32-token blocks; BLOCK_T never exceeds 64).
    assert sm._route_rows(16384, 256, 8) == 2048 and sm._route_rows(4096, 256, 8) == 512
    assert sm._route_rows(32768, 64, 8) == 1024 and sm._route_rows(100, 8, 1) == 2
    assert sm._route_rows(1, 256, 8) == 1


# the design points the monotonicity tests sweep: (recipe, device, G, scenario fields)
_SWEEP = [(t.recipe, t.hardware, G, kw) for t in rep.TARGETS for G in (64, 1024) for kw in (
    dict(ep=8, sharding="full"), dict(ep=8, sharding="hybrid", grad_accum=2), dict(ep=32, sharding="hybrid", node_limit=2),
    dict(ep=64, sharding="hybrid"))]


def _proj(cal, recipe, hw, G, preset="fused", **kw):
    kw = dict(kw)
    ep = kw.pop("ep")
    return sm.project(sm.load_recipe(recipe), sm.Scenario(hw, G, ep, preset, **kw), cal)


@pytest.mark.parametrize("preset", ["reference", "fused", "fused+overlap"])
def test_projection_more_nic_bandwidth_never_lowers_mfu(cal, preset):
    for recipe, hw, G, kw in _SWEEP:
        a = _proj(cal, recipe, hw, G, preset, **kw)
        b = _proj(cal, recipe, hw, G, preset, nic_scale=2.0, **kw)
        assert b.mfu >= a.mfu * (1 - 1e-12), (recipe, hw, G, kw, a.mfu, b.mfu)
        if a.legs_gb["grad_sync"]["nic"] or a.detail["rows_per_token_nic"]:
            # whatever crosses the NIC is now cheaper: some phase must not have grown
            assert b.step_ms <= a.step_ms


def test_projection_hierarchical_vs_flat(cal):
    for recipe, hw, G, kw in _SWEEP:
        flat = _proj(cal, recipe, hw, G, exchange="flat", **kw)
        hier = _proj(cal, recipe, hw, G, exchange="hierarchical", **kw)
        for op in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"):
            assert hier.legs_gb[op]["nic"] <= flat.legs_gb[op]["nic"] + 1e-12, (recipe, hw, G, kw, op)
        auto = _proj(cal, recipe, hw, G, exchange="auto", **kw)
        assert auto.detail["traffic"] == ("node_dedup" if auto.detail["ep_nodes"] > 1 else "rank_dedup")
    # one node: the hierarchical exchange is the flat one, to the bit
    for t in rep.TARGETS:
        flat = _proj(cal, t.recipe, t.hardware, 8, ep=8, exchange="flat")
        hier = _proj(cal, t.recipe, t.hardware, 8, ep=8, exchange="hierarchical")
        assert flat.phases_ms == hier.phases_ms and flat.legs_gb == hier.legs_gb


def test_projection_grad_accum_amortizes(cal):
    # hybrid: per-step costs (optimizer, the cross-node all-reduce, the norm) spread over more
    # micro-batches, per-micro-batch costs stay: tokens/s never drops as grad_accum grows
    for recipe, hw, G, kw in _SWEEP:
        kw = {k: v for k, v in kw.items() if k != "grad_accum"}
        if kw["sharding"] != "hybrid":
            continue
        mfu = [_proj(cal, recipe, hw, G, grad_accum=A, **kw).mfu for A in (1, 2, 4)]
        assert mfu == sorted(mfu), (recipe, hw, G, kw, mfu)


def test_projection_is_a_function_of_its_inputs(cal):
    # the node-limited routing's hits come from a seeded Monte Carlo: recomputed from scratch they
    # are the same numbers, so is every projection
    a = _proj(cal, "b200_16x8", "B200", 1024, ep=32, sharding="hybrid", node_limit=2)
    st._router_hits.cache_clear()
    b = _proj(cal, "b200_16x8", "B200", 1024, ep=32, sharding="hybrid", node_limit=2)
    assert a.step_ms == b.step_ms and a.legs_gb == b.legs_gb


def test_projection_invariants(cal):
    from train.metrics import flops_per_token
    for t in rep.TARGETS:
        cfg = sm.load_recipe(t.recipe)
        fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        for G in (8, 64, 1024):
            for layout in sm.SHARDINGS:
                proj = {p: sm.project(cfg, sm.Scenario(t.hardware, G, 8, p, sharding=layout), cal) for p in sm.PRESETS}
                # The deduplicated exchange never moves more than per-slot traffic and its local
                # kernels are cheaper than the measured one-rank all-to-all; overlap only hides time.
                assert proj["dedup"].step_ms <= proj["reference"].step_ms, (t.recipe, t.hardware, G)
                # (equal when nothing is hidden, up to the last bit of sums taken in another order:
                # the b200_16x8 recipe's 4 micro-batches on GB200 at 1024 GPUs)
                assert proj["fused+overlap"].step_ms <= proj["fused"].step_ms * (1 + 1e-12), (t.recipe, t.hardware, G)
                for pr in proj.values():
                    assert set(pr.phases_ms) == set(sm.CATEGORIES)
                    assert math.isclose(pr.step_ms, sum(pr.phases_ms.values()))
                    assert math.isclose(pr.mfu, pr.tokens_per_s_per_gpu * fpt / (sm.HARDWARE[t.hardware].peak_tflops * 1e12))
                    assert all(v >= 0 for v in pr.phases_ms.values())
                    assert math.isclose(pr.exchange_gb, sum(pr.legs_gb[op][ln] for op in
                                        ("dispatch", "combine", "dispatch_bwd", "combine_bwd") for ln in ("nvlink", "nic")))
    # one GPU moves nothing over links, and the fused pipeline has no exchange phase there
    cfg1 = sm.load_recipe("h200_1gpu")
    for preset in sm.PRESETS:
        one = sm.project(cfg1, sm.Scenario("H200", 1, 1, preset), cal)
        assert one.exchange_gb == 0.0 and one.detail["exchange_link_ms"] == 0.0
    assert sm.project(cfg1, sm.Scenario("H200", 1, 1, "fused"), cal).phases_ms["exchange"] == 0.0


def test_projection_bad_input(cal, tmp_path):
    cfg = sm.load_recipe("h200_8gpu_ep8")
    with pytest.raises(ValueError, match="hardware='TPU'"):
        sm.project(cfg, sm.Scenario("TPU", 8, 8), cal)
    with pytest.raises(ValueError, match="gpus=12 must be a positive multiple of ep=8"):
        sm.project(cfg, sm.Scenario("H200", 12, 8), cal)
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        sm.project(cfg, sm.Scenario("H200", 6, 3), cal)
    with pytest.raises(ValueError, match="preset='fast'"):
        sm.project(cfg, sm.Scenario("H200", 8, 8, "fast"), cal)
    with pytest.raises(ValueError, match="exchange='ring'"):
        sm.project(cfg, sm.Scenario("H200", 8, 8, exchange="ring"), cal)
    with pytest.raises(ValueError, match="sharding='zero3'"):
        sm.project(cfg, sm.Scenario("H200", 8, 8, sharding="zero3"), cal)
    with pytest.raises(ValueError, match="grad_accum=0"):
        sm.project(cfg, sm.Scenario("H200", 8, 8, grad_accum=0), cal)
    with pytest.raises(ValueError, match="nic_scale=0"):
        sm.project(cfg, sm.Scenario("H200", 8, 8, nic_scale=0), cal)
    with pytest.raises(ValueError, match="node_limit=0"):
        sm.project(cfg, sm.Scenario("H200", 64, 64, node_limit=0), cal)
    with pytest.raises(ValueError, match="traffic='bogus'"):
        sm.project(cfg, sm.Scenario("H200", 8, 8, traffic="bogus"), cal)
    with pytest.raises(ValueError, match="layout='tall'"):
        sc.scaling_rows("h200_8gpu_ep8", "H200", cal, layout="tall")
    with pytest.raises(ValueError, match="no such file"):
        sm.load_recipe("no_such_recipe")
    good = _cal_json()

    def use_of(d, mid):
        return next(m for m in d["measurements"] if m["id"] == mid)

    def pts(d):
        return d["row_exchange_profile"]["points"]

    for mutate, msg in [(lambda d: d.pop("profile"), "field 'profile' is missing"),
                        (lambda d: d.pop("exchange_profile"), "field 'exchange_profile' is missing"),
                        (lambda d: d.pop("row_exchange_profile"), "field 'row_exchange_profile' is missing"),
                        # a check point may not be promoted to a calibration input by naming it
                        (lambda d: d["profile"].update(fused="h200x2_ep2_fast"), "profile.fused='h200x2_ep2_fast' must be"),
                        (lambda d: d["profile"].update(separate="nope"), "profile.separate='nope' names no measurement"),
                        (lambda d: [use_of(d, d["profile"]["separate"])["phases_ms"].pop(k) for k in
                                    ("combine.fwd", "combine.bwd", "dispatch.fwd", "dispatch.bwd")],
                         r"no time in phases \['exchange'\]"),
                        (lambda d: d["exchange_profile"]["kernels_us"].pop("expand"), "kernels_us.expand=None"),
                        (lambda d: d["exchange_profile"]["kernels_us"].update(send_tokens=1.0), "scale-up bandwidth"),
                        (lambda d: d["assumptions"]["imbalance"].pop("source"), "assumptions.imbalance.source"),
                        (lambda d: d["assumptions"]["host_sync_ms"].update(status="guessed"), "host_sync_ms.status"),
                        # no NIC efficiency above what DeepEP and UCCL-EP report
                        (lambda d: d["assumptions"]["link_efficiency_out"].update(value=0.9), "link_efficiency_out=0.9"),
                        (lambda d: pts(d)[1].update(use="calibration"), "exactly 2 'calibration' points"),
                        (lambda d: pts(d)[0].update(use="maybe"), r"points\[0\].use='maybe'"),
                        (lambda d: pts(d)[2].update(combine_us=-1), r"points\[2\].combine_us=-1"),
                        # a rate above the link's datasheet bandwidth is not a measurement of it
                        (lambda d: pts(d)[2].update(dispatch_us=100.0), "dispatch: the fit points give"),
                        (lambda d: d["measurements"][0].pop("gpus"), r"measurements\[0\].gpus is missing"),
                        (lambda d: d["measurements"][1].update(preset="turbo"), r"measurements\[1\].preset='turbo'"),
                        (lambda d: d["measurements"][2].update(use="maybe"), r"measurements\[2\].use='maybe'"),
                        (lambda d: d["measurements"][3].update(id=d["measurements"][2]["id"]), "is not unique"),
                        (lambda d: d["measurements"][2]["phases_ms"].update(bogus=1.0), "phase 'bogus'"),
                        (lambda d: d["profile"].pop("memory"), "profile.memory=None must name a measurement"),
                        (lambda d: d["profile"].update(memory="h200x1_fast"), "profile.memory='h200x1_fast' must name"),
                        (lambda d: use_of(d, d["profile"]["memory"]).update(peak_mem_gib=-1), "peak_mem_gib must be"),
                        (lambda d: use_of(d, d["profile"]["memory"]).update(peak_mem_gib=1.0),
                         "is not above its counted state")]:
        d = json.loads(json.dumps(good))
        mutate(d)
        path = tmp_path / "cal.json"
        path.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=msg):
            c = sm.load_calibration(path)
            sc.check_measurements(c)   # rate-level errors (the send-kernel bandwidth) surface here


def test_measured_from_harness(cal, tmp_path):
    """A harness JSON from a GPU run turns into checked points (preset from the dispatcher)."""
    res = {"meta": {"device_name": "NVIDIA H200", "world": 2, "config": "configs/h200_1gpu.toml",
                    "overrides": ["parallel.ep=2"]},
           "step": {"paths": {
               "fast": {"dispatcher": "SymmDispatcher", "pipeline": "separate", "fused_pipeline": False,
                        "tokens_per_s_per_gpu": 105105.0, "mfu": 0.429, "phases_ms": {"optimizer": 16.5}},
               "reference": {"dispatcher": "AllToAllDispatcher", "pipeline": "separate", "fused_pipeline": False,
                             "tokens_per_s_per_gpu": 79555.0, "mfu": 0.325, "phases_ms": {"optimizer": 16.1}},
               "fused_ep": {"dispatcher": "SymmDispatcher", "pipeline": "fused", "fused_pipeline": True,
                            "tokens_per_s_per_gpu": 104000.0, "mfu": 0.42, "phases_ms": {"optimizer": 16.3}}}}}
    path = tmp_path / "h200x2.json"
    path.write_text(json.dumps(res))
    rows = sc.measured_from_harness(path)
    assert [r["preset"] for r in rows] == ["dedup", "reference", "fused"]
    checks = sc.check_measurements(cal, rows)
    for name, committed in (("fast", "h200x2_ep2_fast"), ("reference", "h200x2_ep2_reference")):
        new = next(c for c in checks if c["id"] == f"h200x2:{name}")
        base = next(c for c in checks if c["id"] == committed)
        assert math.isclose(new["predicted_ms"], base["predicted_ms"])   # same scenario as the committed point
        assert new["measured_phases_ms"]["optimizer"] == res["step"]["paths"][name]["phases_ms"]["optimizer"]
    res["meta"]["device_name"] = "cpu"
    path.write_text(json.dumps(res))
    with pytest.raises(ValueError, match="matches no projected device"):
        sc.measured_from_harness(path)


def test_project_cli_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "scaling.png", tmp_path / "proj.json"
    p = subprocess.run([sys.executable, SCRIPT, "--project", "--plot", str(png), "--json", str(js), "--results-dir",
                        str(tmp_path / "results")], cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "PROJECTED unless marked measured" in out and "[measured]" in out and "[assumed" in out
    cal = sm.load_calibration()
    for m in cal.measurements:
        assert f"| {m['id']} | {m['use']} |" in out
    for t in rep.TARGETS:
        assert f"### {t.recipe} on {t.hardware}" in out and f"| {t.hardware} | {t.recipe} |" in out
    assert "row form dispatch T=4096 [check]" in out and "First bottleneck (fused)" in out
    assert png.exists() and 0 < png.stat().st_size < 250_000
    d = json.loads(js.read_text())
    assert len(d["checks"]) == len(cal.measurements)
    assert set(d["targets"]) == {t.hardware for t in rep.TARGETS}
    assert {s["scenario"]["gpus"] for s in d["targets"]["H200"]["chosen"]} == set(sm.GPU_COUNTS)
    md, = (tmp_path / "results").glob("scaling_projected_*.md")   # bench/_results.py: the printed report ...
    assert "PROJECTED unless marked measured" in md.read_text()
    rows = [json.loads(l) for l in md.with_suffix(".jsonl").read_text().splitlines()]   # ... and its rows
    n_points = sum(len(v) for t in d["targets"].values() for v in t.values())
    assert len(rows) == n_points and {r["machine"] for r in rows} == {"projected"}


# ------------------------------------------------------------------------------ harness (T1)

EXPECTED_STEP = {"attention.fwd", "attention.bwd", "route.fwd", "route.bwd", "dispatch.fwd", "dispatch.bwd",
                 "combine.fwd", "combine.bwd", "experts.fwd", "experts.bwd", "dense_ffn.fwd", "dense_ffn.bwd",
                 "grad_reduce", "optimizer", "fwd", "bwd"}
EXPECTED_LAYER = {"route.fwd", "route.bwd", "dispatch.fwd", "dispatch.bwd", "combine.fwd", "combine.bwd",
                  "experts.fwd", "experts.bwd"}


def _check_path(r: dict, tokens: int, expected: set) -> None:
    assert expected <= set(r["phases_ms"]), sorted(expected - set(r["phases_ms"]))
    assert all(v >= 0 for v in r["phases_ms"].values())
    assert r["step_ms"] > 0 and math.isclose(r["tokens_per_s_per_gpu"], tokens / (r["step_ms"] / 1e3))
    assert r["mfu"] is None  # CPU: no peak, never guessed
    for step in r["phases_ms_steps"]:
        assert sum(step.values()) > 0 and expected <= set(step)


def test_harness_one_process(tmp_path):
    """One rank on CPU: the fast path is the one-rank path (LocalDispatcher), the reference the
    all-to-all dispatcher on a one-rank gloo group; both for the step and the layer."""
    out = tmp_path / "one.json"
    args = [a for a in HARNESS_ARGS if a != "--no-results"] + ["--results-dir", str(tmp_path / "results")]
    p = subprocess.run([sys.executable, SCRIPT, *args, "--json", str(out)], cwd=ROOT, env=_env(1),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    jsonl, = (tmp_path / "results").glob("scaling_cpu_*.jsonl")   # bench/_results.py's rows: one per mode and path
    rows = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert sorted((r["op"], r["provider"]) for r in rows) == sorted((m, p) for m in ("step", "layer") for p in d[m]["paths"])
    assert all(r["median"] == d[r["op"]]["paths"][r["provider"]]["step_ms"] and r["unit"] == "ms" for r in rows)
    assert d["meta"]["world"] == 1 and d["meta"]["timer"] == "wall_clock"
    tokens = 2 * 32
    for mode, expected in (("step", EXPECTED_STEP), ("layer", EXPECTED_LAYER)):
        paths = d[mode]["paths"]
        assert paths["fast"]["dispatcher"] == "LocalDispatcher"
        assert paths["reference"]["dispatcher"] == "AllToAllDispatcher"
        assert paths["reference"]["pipeline"] == "separate" and not paths["reference"]["fused_pipeline"]
        for r in paths.values():
            _check_path(r, tokens, expected)
    assert "[step] fast" in p.stdout and "[layer] reference" in p.stdout


def test_harness_bad_args():
    p = subprocess.run([sys.executable, SCRIPT, "--paths", "fast,warp"], cwd=ROOT, env=_env(1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--paths='fast,warp'" in p.stderr
    p = subprocess.run([sys.executable, SCRIPT, "--steps", "0"], cwd=ROOT, env=_env(1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--steps=0" in p.stderr


@pytest.mark.release  # the training loop's own 2-node loopback test stays in the fast tier
def test_harness_two_nodes_two_procs_loopback(tmp_path):
    """Two torchrun 'nodes' on 127.0.0.1 with 2 processes each (gloo): the step at EP=2 x DP=2,
    the layer at EP=4 across both nodes; the fast path is skipped on CPU and says why."""
    port, out = free_port(), tmp_path / "mn.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=2",
           "--master-addr=127.0.0.1", f"--master-port={port}"]
    args = [SCRIPT, *HARNESS_ARGS, "--override", "parallel.ep=2", "--json", str(out)]
    procs = [subprocess.Popen(cmd + [f"--node-rank={i}"] + args, cwd=ROOT, env=_env(1), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-5000:]
    d = json.loads(out.read_text())
    m = d["meta"]
    assert (m["world"], m["nnodes"], m["local_world_size"]) == (4, 2, 2)
    assert (d["step"]["ep"], d["step"]["dp"]) == (2, 2)
    assert d["layer"]["ep"] == 4
    for mode, expected in (("step", EXPECTED_STEP), ("layer", EXPECTED_LAYER)):
        assert list(d[mode]["paths"]) == ["reference"] and "CUDA" in d[mode]["skipped"]["fast"]
        r = d[mode]["paths"]["reference"]
        assert len(r["step_ms_per_rank"]) == 4
        _check_path(r, 2 * 32, expected)
    assert "[step] reference" in outs[0] and "[step]" not in outs[1]   # rank 0 prints only


# ------------------------------------------------------------------------------ harness on GPUs (T3 / T5)

def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 1, reason="needs a CUDA GPU")
def test_harness_one_gpu(tmp_path):
    """CUDA events, bf16: the one-rank fast path (fused TLX pipeline where it runs) and the NCCL
    all-to-all reference on a one-rank group, step and layer."""
    out = tmp_path / "gpu1.json"
    p = subprocess.run([sys.executable, SCRIPT, *HARNESS_ARGS, "--json", str(out)], cwd=ROOT, env=_env(1),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["meta"]["timer"] == "cuda_events"
    known = any(k in d["meta"]["device_name"].upper() for k in ("H100", "H200", "B200", "MI300X"))
    for mode, expected in (("step", EXPECTED_STEP), ("layer", EXPECTED_LAYER)):
        paths = d[mode]["paths"]
        assert paths["fast"]["dispatcher"] == "LocalDispatcher"
        assert paths["reference"]["dispatcher"] == "AllToAllDispatcher"
        for name, r in paths.items():
            # the fused pipeline never calls the dispatcher: no dispatch/combine phases there
            exp = expected - {"dispatch.fwd", "dispatch.bwd", "combine.fwd", "combine.bwd"} \
                if r["fused_pipeline"] else expected
            assert exp <= set(r["phases_ms"]), (mode, name, sorted(exp - set(r["phases_ms"])))
            assert (r["mfu"] is not None) == known
            assert r["step_ms"] > 0 and r["instrumented_step_ms"] > 0


@pytest.mark.multigpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 CUDA GPUs")
def test_harness_two_gpus_symm(tmp_path):
    """torchrun on 2 GPUs of one node: the fast path is the deduplicated symmetric exchange."""
    out = tmp_path / "gpu2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT,
           *HARNESS_ARGS, "--override", "parallel.ep=2", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    for mode, expected in (("step", EXPECTED_STEP), ("layer", EXPECTED_LAYER)):
        paths = d[mode]["paths"]
        assert paths["fast"]["dispatcher"] == "SymmDispatcher"
        assert paths["reference"]["dispatcher"] == "AllToAllDispatcher"
        for r in paths.values():
            assert expected <= set(r["phases_ms"])
            assert len(r["step_ms_per_rank"]) == 2
