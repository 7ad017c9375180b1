"""``parallel.reduce_dtype = "bfloat16"`` on gloo (tier T1): 4 processes posing as 2 nodes x 2.

One training step of the TINY debug model (global batch of 8 sequences) is run with fp32 and with
bf16 gradient communication, in two layouts that between them take every path a gradient can cross:
``hybrid_ep2`` (dense parameters HSDP 2 x 2: a reduce-scatter inside the node, an all-reduce across
nodes; experts one copy per node, all-reduced across nodes; router / shared experts then
all-reduced over ep by ``finish_grads``) and ``full_ep2`` (FSDP2 over all 4 ranks for the dense
parameters, over the 2 ranks of an ep index for the MoE layers). Both runs compute bitwise the same
local gradients (same weights, same data, one step), so they differ only in the reductions.

Bound (derived here, not fitted). A reduced element is the sum of N = W * A contributions c_i (W = 4
ranks, A micro-batches). Every value the bf16 path rounds -- a contribution cast to bf16 for the
link, the result of each add inside a reduce-scatter or all-reduce, an fp32 partial sum cast back to
bf16 before the next collective (the HSDP sum over micro-batches before its all-reduce; the router's
sum before the all-reduce over ep), an AVG division -- is a partial sum of the c_i, so its magnitude
is at most S = sum_i |c_i|, and round-to-nearest bf16 moves it by at most u * S, u = 2^-8 (8
significant bits). The casts of the contributions together move the sum by at most u * S (their
magnitudes add up to S); a reduction tree over N contributions has at most N - 1 adds; at most 2
casts back and 2 divisions lie on any element's path. Hence, per element,

    |g_bf16 - g_fp32| <= (N + 4) * u * S + atol,

at most 8 * 2^-8 * S at A = 1 and 12 * 2^-8 * S at A = 2, with S bounded from above by the
fp64 single-process model: S <= (1/8) * sum over the 8 sequences of |that sequence's gradient|
(the objective is the mean over equal-length sequences, and |sum| <= sum of |.| for any grouping
of the sequences into ranks and micro-batches). atol = 2^-20 of the tensor's largest gradient
covers the fp32 rounding of the fp32 run itself. A reduction over the wrong group, a missing
1/ep, a micro-batch counted twice are off by O(1) of the gradient (S is a few times |g| here).

That bf16 really crossed the links is asserted too: at ``hybrid_ep2`` every bf16-run gradient is a
bf16 value (FSDP2 casts each bf16 reduction result to fp32 unchanged; the only later operation, the
division by ep = 2, is exact), which the fp32 run's gradients are not. And the accumulation over
micro-batches stays fp32: before the second micro-batch, every HSDP unit's partial sum (whose
reduce dtype is bf16) is fp32, and a fully sharded unit already holds its reduce-scattered fp32
gradient (under fp32 reduction it holds none: it skips the reduce-scatter as before). The fp32 path
is the default and is bitwise the same whether ``parallel.reduce_dtype`` is set or not.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_world
from _train import DEBUG, assert_bf16_reduction_bound, bf16_valued, sequence_grad_magnitudes, step_grads

WORLD = 4
NODES = ["parallel.ranks_per_node=2"]
LAYOUTS = {"hybrid_ep2": ["parallel.sharding=hybrid", "parallel.ep=2"], "full_ep2": ["parallel.ep=2"]}
# (layout, parallel.reduce_dtype or None for the default, grad_accum)
RUNS = [("hybrid_ep2", None, 1), ("hybrid_ep2", "float32", 1), ("hybrid_ep2", "bfloat16", 1),
        ("hybrid_ep2", None, 2), ("hybrid_ep2", "bfloat16", 2), ("full_ep2", None, 2), ("full_ep2", "bfloat16", 2)]


def _probe(model) -> dict:
    """What FSDP2 holds between two micro-batches: the dtypes of the HSDP units' partial sums (and
    the reduce dtype they come from), and how many parameters of 1-D units hold a sharded gradient."""
    from torch.distributed.fsdp import FSDPModule

    from train.parallelize import _partial_reductions
    parts = [(pg._partial_reduce_output.dtype, pg._reduce_dtype) for pg in _partial_reductions(model)
             if pg._partial_reduce_output is not None]
    one_d = [p for m in model.modules() if isinstance(m, FSDPModule)
             and m._get_fsdp_state()._fsdp_param_group.mesh_info.mesh.ndim == 1
             for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
    return {"partials": parts, "one_d": len(one_d), "one_d_with_grad": sum(p.sharded_param.grad is not None
                                                                           for p in one_d)}


def _runs(rank, world):
    out = {}
    for layout, rd, accum in RUNS:
        over = NODES + LAYOUTS[layout] + ([f"parallel.reduce_dtype={rd}"] if rd else [])
        out[layout, rd, accum] = step_grads(over, world, accum, "cpu", probe=_probe if accum > 1 else None)
    return out


def test_bf16_reduction_within_the_rounding_bound_and_fp32_accumulation():
    res = run_world(_runs, WORLD, start_method="forkserver")
    r0 = res[0]
    S = sequence_grad_magnitudes()
    for layout, rd, accum in RUNS:
        for r in res[1:]:   # every rank ends with the same global gradient
            assert all(torch.equal(r[layout, rd, accum]["grads"][n], g) for n, g in r0[layout, rd, accum]["grads"].items())
        if rd != "bfloat16":
            continue
        ref, got = r0[layout, None, accum]["grads"], r0[layout, rd, accum]["grads"]
        assert_bf16_reduction_bound(got, ref, S, WORLD * accum, f"{layout} accum={accum}")
        if layout == "hybrid_ep2":
            assert all(bf16_valued(g) for g in got.values()), f"{layout} accum={accum}: a gradient that is not bf16"
            assert sum(bf16_valued(g) for g in ref.values()) < len(ref) // 2, "the fp32 run's gradients are bf16 too"

    # The default is fp32, bit for bit.
    a, b = r0["hybrid_ep2", None, 1], r0["hybrid_ep2", "float32", 1]
    assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]) and a["norm"] == b["norm"]

    # Accumulation over micro-batches (probes taken before the second micro-batch, on every rank).
    for r in res:
        (h32,), (h16,) = r["hybrid_ep2", None, 2]["probes"], r["hybrid_ep2", "bfloat16", 2]["probes"]
        assert h32["partials"] and {d for d, _ in h32["partials"]} == {torch.float32}
        assert h16["partials"] and all(d == torch.float32 and rd == torch.bfloat16 for d, rd in h16["partials"]), \
            h16["partials"]
        (f32,), (f16,) = r["full_ep2", None, 2]["probes"], r["full_ep2", "bfloat16", 2]["probes"]
        assert f32["one_d"] > 0 and f32["one_d_with_grad"] == 0          # fp32: no reduce-scatter before the last
        assert f16["one_d_with_grad"] == f16["one_d"] == f32["one_d"]    # bf16: reduce-scattered each micro-batch


def test_reduce_dtype_is_validated():
    from train.config import load_config
    for bad in ("bf16", "float16", "fp32"):
        with pytest.raises(ValueError, match=f"parallel.reduce_dtype='{bad}' must be one of 'float32', 'bfloat16'"):
            load_config(DEBUG, [f"parallel.reduce_dtype={bad}"])
    with pytest.raises(ValueError, match="parallel.reduce_dtype=16 must be of type str"):
        load_config(DEBUG, ["parallel.reduce_dtype=16"])
    assert load_config(DEBUG).parallel.reduce_dtype == "float32"
