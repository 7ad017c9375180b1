"""Measured vs projected, the projection series, the printed assumptions and the harness-result
reader of the scaling projection (``bench/scaling_model.py``; report: ``bench/scaling_report.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from scaling_model import (GPU_COUNTS, HARDWARE, PRESETS, ROOT, Calibration, Projection, Scenario, _rates, group_phases,
                           load_recipe, memory_point_state_gb, project, row_op_fit)

__all__ = ["check_measurements", "check_memory", "scaling_rows", "describe_assumptions", "measured_from_harness"]


def check_measurements(cal: Calibration, extra: Optional[list] = None) -> list[dict]:
    """Measured vs predicted for every measured point (calibration JSON + ``extra`` harness
    results in the same format). ``use`` says whether the point was a calibration input; points
    with ``phases_ms`` also get ``measured_phases_ms`` (summed into the model's categories). A point
    is projected with the layout it ran with (``sharding``, ``grad_accum``; default: FSDP2 full
    sharding, one micro-batch) and the flat exchange (every measured run was on one node)."""
    rows = []
    for m in list(cal.measurements) + list(extra or []):
        cfg = load_recipe(m["recipe"], m["overrides"])
        ep = cfg.parallel.ep
        sc = Scenario(m["hardware"], int(m["gpus"]), ep, m["preset"], exchange="flat",
                      sharding=m.get("sharding", "full"), grad_accum=int(m.get("grad_accum", 1)))
        pr = project(cfg, sc, cal)
        T = cfg.data.batch_size * cfg.data.seq_len * sc.grad_accum
        meas_ms = T / m["tokens_per_s_per_gpu"] * 1e3
        rows.append({"id": m["id"], "use": m["use"], "hardware": m["hardware"], "gpus": m["gpus"], "ep": ep,
                     "preset": m["preset"], "tokens_per_gpu": T, "measured_ms": meas_ms, "predicted_ms": pr.step_ms,
                     "error": pr.step_ms / meas_ms - 1, "measured_tps": m["tokens_per_s_per_gpu"],
                     "predicted_tps": pr.tokens_per_s_per_gpu, "measured_mfu": m.get("mfu"),
                     "predicted_mfu": pr.mfu, "source": m["source"], "projection": pr,
                     "measured_phases_ms": group_phases(m["phases_ms"]) if "phases_ms" in m else None})
    return rows


def check_memory(cal: Calibration) -> list[dict]:
    """Measured vs estimated peak memory (GiB) of every measured point with ``peak_mem_gib``: the
    counted state + the activation estimate (A7). The ``profile.memory`` point sets the activation
    rate (use "calibration", reproduced by construction); the others are checks."""
    act_bytes = _rates(cal).act_bytes
    rows = []
    for m in cal.measurements:
        if "peak_mem_gib" not in m:
            continue
        state_gb, T, width = memory_point_state_gb(m)
        act = act_bytes * T * width
        est = (state_gb * 1e9 + act) / 2 ** 30
        rows.append({"id": m["id"], "use": "calibration" if m["id"] == cal.profile["memory"] else "check",
                     "gpus": m["gpus"], "tokens_per_gpu": T, "measured_gib": m["peak_mem_gib"],
                     "state_gib": state_gb * 1e9 / 2 ** 30, "activations_gib": act / 2 ** 30, "estimated_gib": est,
                     "error": est / m["peak_mem_gib"] - 1})
    return rows


def scaling_rows(recipe: str, hardware: str, cal: Calibration, presets=tuple(PRESETS), gpus=GPU_COUNTS,
                 layout: str = "recipe", **scenario) -> list[Projection]:
    """Projections of ``recipe`` on ``hardware`` for each G and preset. ``layout``: "recipe" (the
    recipe's ep) or "wide" (ep = gcd(G, E): experts spread over up to G GPUs, tokens cross nodes).
    ``scenario``: further ``Scenario`` fields (exchange, node_limit, sharding, grad_accum, ...), the
    recipe's own values where left out."""
    if layout not in ("recipe", "wide"):
        raise ValueError(f"layout={layout!r} must be 'recipe' or 'wide'")
    cfg = load_recipe(recipe)
    E = cfg.model.moe.num_experts
    out = []
    for G in gpus:
        ep = cfg.parallel.ep if layout == "recipe" else math.gcd(G, E)
        if G % ep:
            continue
        for p in presets:
            out.append(project(cfg, Scenario(hardware, G, ep, p, **scenario), cal))
    return out


def describe_assumptions(cal: Calibration) -> list[str]:
    """Every input of the model, marked measured or assumed with its source, and the rates derived."""
    p, x, rx = cal.profile, cal.exchange, cal.row_exchange
    try:
        where = Path(cal.path).resolve().relative_to(ROOT)
    except ValueError:
        where = cal.path
    lines = [f"- calibration: {where}",
             f"- profile [{p['status']}] {p['recipe']} {' '.join(p['overrides'])} on {cal.hardware}: fused = "
             f"{p['fused']}, separate = {p['separate']}; {p['source']}",
             f"- profile.memory [measured] {p['memory']}: {p['memory_source']}",
             f"- exchange_profile [{x['status']}] W={x['world']} T={x['tokens']} D={x['dim']} E={x['experts']} "
             f"K={x['top_k']}, us per pair: " + ", ".join(f"{k} {v}" for k, v in x["kernels_us"].items())
             + f"; {x['source']}",
             f"- row_exchange_profile [{rx['status']}] W={rx['world']} D={rx['dim']} E={rx['experts']} K={rx['top_k']}, "
             "us per op (dispatch / combine): " + ", ".join(f"T={pt['tokens']} {pt['dispatch_us']} / {pt['combine_us']} "
                                                           f"({pt['use']})" for pt in rx["points"]) + f"; {rx['source']}"]
    for k, a in cal.assumptions.items():
        lines.append(f"- {k} = {a['value']} [{a['status']}] {a['source']}")
    for hw in HARDWARE.values():
        lines.append(f"- device {hw.name} [assumed: vendor datasheet] peak {hw.peak_tflops:g} TFLOP/s bf16, HBM "
                     f"{hw.hbm_tb_s:g} TB/s, {hw.hbm_gb:g} GB, scale-up {hw.up_gb_s:g} GB/s per direction "
                     f"({hw.up_topology}, {hw.domain} GPUs), NIC {hw.out_gb_s:g} GB/s; hop latency "
                     f"{hw.up_latency_us:g} / {hw.out_latency_us:g} us [assumed: typical NCCL LL hops]; {hw.source}")
    r = _rates(cal)
    hbm = HARDWARE[cal.hardware].hbm_tb_s
    lines.append(f"- derived on {cal.hardware}: routed experts at {r.eta_fused:.1%} of peak with the fused pipeline, "
                 f"{r.eta_sep:.1%} as separate ops; attention blocks {r.eta_attn:.1%}; backward share of attention "
                 f"{r.bwd_share_attn:.1%}, of experts {r.bwd_share_experts:.1%}; route {r.route_bytes_per_elem:.1f} "
                 f"and rest {r.rest_bytes_per_elem:.1f} B per element; optimizer {r.opt_bytes_per_param:.1f} B/param, "
                 f"grad norm {r.norm_bytes_per_param:.1f} B/param; one-rank all-to-all {r.a2a_passes:.1f} passes of the "
                 f"expanded rows per MoE layer; NCCL / send-kernel NVLink efficiency {r.link_efficiency_up:.3f}; "
                 f"separate pipeline's symmetric kernels (TB/s of expanded rows): expand {r.expand_eff * hbm:.2f}, "
                 f"reduce_send {r.reduce_eff * hbm:.2f}, reduce_recv {r.recv_eff * hbm:.2f}; barrier wait "
                 f"{r.barrier_s * 1e6:.0f} us per op; row form: dispatch {r.row_fixed_s[0] * 1e6:.1f} us + payload at "
                 f"{r.row_eff_up[0]:.3f} of NVLink, combine {r.row_fixed_s[1] * 1e6:.1f} us + {r.row_eff_up[1]:.3f}; "
                 f"activations {r.act_bytes:.2f} B per token and activation-width element")
    for tokens, op, use, meas, fit in row_op_fit(cal)["checks"]:
        lines.append(f"- row form {op} T={tokens} [{use}]: measured {meas:.1f} us, model {fit:.1f} us "
                     f"({100 * (fit / meas - 1):+.1f}%)")
    return lines


def _hardware_of(device_name: str) -> str:
    name = device_name.upper().replace(" ", "")
    for key in sorted(HARDWARE, key=len, reverse=True):
        if key.replace("-", "") in name.replace("-", ""):
            return key
    raise ValueError(f"device_name={device_name!r} matches no projected device {sorted(HARDWARE)}")


def measured_from_harness(path) -> list[dict]:
    """Measurement entries (the calibration's format) from a ``bench/scaling.py`` JSON's step
    results, one per path, with the measured phases attached."""
    path = Path(path)
    d = json.loads(path.read_text())
    if "step" not in d:
        raise ValueError(f"{path}: no 'step' results (run bench/scaling.py with --mode step or both)")
    meta = d["meta"]
    hw = _hardware_of(meta["device_name"])
    rows = []
    for name, r in d["step"]["paths"].items():
        if r["dispatcher"] == "AllToAllDispatcher":
            preset = "reference"
        elif r["dispatcher"] == "SymmDispatcher":
            preset = "fused" if r.get("fused_pipeline") else "dedup"
        else:   # one rank: no exchange; the pipeline decides
            preset = "fused" if r.get("fused_pipeline") else "reference"
        rows.append({"id": f"{path.stem}:{name}", "use": "check", "hardware": hw, "gpus": meta["world"],
                     "recipe": meta["config"], "overrides": meta["overrides"], "preset": preset,
                     "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "mfu": r["mfu"],
                     "source": f"{path} ({name}: {r['dispatcher']}, pipeline {r['pipeline']})",
                     "phases_ms": r["phases_ms"]})
    return rows
