"""The report of the scaling projection (issues 11 and 35): the inputs, measured vs projected (fit and
check points), each target recipe's weak-scaling series with per-leg bytes and its first bottleneck,
the recipe choices at 1024 GPUs, the flat vs hierarchical traffic, and the plot.
``python bench/scaling.py --project [--plot out.png] [--measured run.json ...] [--json out.json]``
calls :func:`project_main`; the model is ``bench/scaling_model.py``. The printout is Markdown.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from scaling_checks import check_measurements, describe_assumptions, measured_from_harness
from scaling_model import (CATEGORIES, GPU_COUNTS, HARNESS_PHASES, Calibration, Projection, Scenario,
                           load_calibration, load_recipe, project)

# Categories as the harness can see them: "FSDP copies" runs inside its fwd/bwd, so it joins "rest".
COMPARED = tuple(c for c in CATEGORIES if c != "FSDP copies")
REPORT_SCALES = (8, 64, 256, 1024)
GROWTH = 0.02        # a category "grows" once the step is 2% longer than at the first scale


@dataclass(frozen=True)
class Target:
    """Issue 35's MFU target at 1024 GPUs for one device, the recipe projected for it and the
    parameters the projection runs it with (``Scenario`` fields; the recipe's own where absent)."""

    hardware: str
    recipe: str
    mfu: float
    params: dict
    why: str


# The recipe parameters of each target (module docstring of scaling_layouts for the layouts).
TARGETS = (
    Target("H200", "h200_8gpu_ep8", 0.35, dict(ep=8, sharding="hybrid", grad_accum=1, preset="fused"),
           "EP=8 inside the NVLink node keeps every token row off the NICs; HSDP leaves one all-reduce of a "
           "1/8 parameter shard per step on them, hidden in the backward; one micro-batch: 16k tokens per GPU "
           "already make 17M-token batches at 1024 GPUs"),
    Target("B200", "b200_16x8", 0.30, dict(ep=32, sharding="hybrid", grad_accum=1, node_limit=2, preset="fused"),
           "EP=8 would replicate 3.5B expert parameters per GPU across nodes (28 GB of fp32 all-reduce a "
           "step over 400 Gb/s); EP=32 over 4 nodes cuts that 4x, node-limited routing (groups = nodes, a "
           "token uses 2 of 4: DeepSeek-V3's half of the nodes) bounds the NIC rows, the hierarchical "
           "exchange sends one row per (token, node); one micro-batch (17M-token batches)"),
    Target("GB200-NVL72", "b200_16x8", 0.30, dict(ep=8, sharding="hybrid", grad_accum=1, preset="fused"),
           "the rack is the node: HSDP shards dense and expert parameters over 64 GPUs of the NVLink domain, "
           "so the cross-rack all-reduce carries 1/64 of the parameters; EP=8 keeps the exchange on NVLink"),
    Target("MI300X", "mi300x_16x8", 0.35, dict(ep=8, sharding="hybrid", grad_accum=1, preset="fused"),
           "as H200: EP=8 over the xGMI mesh, HSDP, one micro-batch (24k tokens per GPU: 25M-token batches)"),
)

# Rows of the choice table at 1024 GPUs: the layouts and EP degrees a user would weigh.
CHOICES = (
    dict(ep=8, sharding="full", grad_accum=1),
    dict(ep=8, sharding="hybrid", grad_accum=1),
    dict(ep=8, sharding="hybrid", grad_accum=2),
    dict(ep=8, sharding="hybrid", grad_accum=4),
    dict(ep=16, sharding="hybrid", grad_accum=1),
    dict(ep=32, sharding="hybrid", grad_accum=1),
    dict(ep=32, sharding="hybrid", grad_accum=1, node_limit=2),
    dict(ep=32, sharding="hybrid", grad_accum=2, node_limit=2),
    dict(ep=64, sharding="hybrid", grad_accum=1, node_limit=4),
    dict(ep=64, sharding="hybrid", grad_accum=1, node_limit=2),
)
WIDE_VARIANTS = (("per_slot", None), ("rank_dedup", None), ("node_dedup", None), ("rank_dedup", 2), ("node_dedup", 2))


def _compared(phases_ms: dict) -> dict:
    out = {c: phases_ms[c] for c in COMPARED}
    out["rest"] += phases_ms.get("FSDP copies", 0.0)
    return out


def _fmt_params(params: dict) -> str:
    names = {"ep": "EP", "sharding": "", "grad_accum": "accum", "node_limit": "nodes/token", "exchange": "exchange",
             "nic_scale": "NIC x", "reduce_dtype": "reduce"}
    return ", ".join(f"{names[k]} {v}".strip() if names[k] else str(v) for k, v in params.items() if k != "preset")


def _scenario(t: Target, G: int, **over) -> Scenario:
    p = dict(t.params) | over
    ep = min(p.pop("ep"), G)
    return Scenario(t.hardware, G, ep, p.pop("preset", "fused"), **p)


def format_checks(rows: list[dict]) -> list[str]:
    out = ["| point | use | device | GPUs | EP | preset | tokens/GPU | measured ms | projected ms | error | "
           "measured tok/s/GPU | projected | measured MFU | projected MFU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mm = "-" if r["measured_mfu"] is None else f"{100 * r['measured_mfu']:.1f}%"
        out.append(f"| {r['id']} | {r['use']} | {r['hardware']} | {r['gpus']} | {r['ep']} | {r['preset']} | "
                   f"{r['tokens_per_gpu']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {100 * r['error']:+.1f}% | "
                   f"{r['measured_tps']:,.0f} | {r['predicted_tps']:,.0f} | {mm} | {100 * r['predicted_mfu']:.1f}% |")
    fit = [abs(r["error"]) for r in rows if r["use"] == "calibration"]
    chk = [abs(r["error"]) for r in rows if r["use"] == "check"]
    out.append(f"\nfit points: {len(fit)}, largest |error| {100 * max(fit, default=0):.1f}%; check points (never fitted): "
               f"{len(chk)}, largest |error| {100 * max(chk, default=0):.1f}%, mean {100 * sum(chk) / max(1, len(chk)):.1f}%")
    return out


def format_phases(rows: list[dict]) -> list[str]:
    """Per category, measured / projected ms of every point with harness phases, and the largest
    category of each (the bottleneck at that scale, measured and projected)."""
    out = ["| point | use | " + " | ".join(COMPARED) + " | largest: measured / projected |",
           "|---|---|" + "---|" * (len(COMPARED) + 1)]
    for r in rows:
        if r["measured_phases_ms"] is None:
            continue
        meas, pred = _compared(r["measured_phases_ms"]), _compared(r["projection"].phases_ms)
        cells = [f"{meas[c]:.1f} / {pred[c]:.1f}" for c in COMPARED]
        out.append(f"| {r['id']} | {r['use']} | " + " | ".join(cells) +
                   f" | {max(meas, key=meas.get)} / {max(pred, key=pred.get)} |")
    mapping = "; ".join(f"{c} = {' + '.join(HARNESS_PHASES[c])}" for c in COMPARED)
    out.append(f"\n(harness phases per category: {mapping}; projected FSDP copies counted in rest)")
    return out


def _growth(base: Projection, p: Projection) -> Optional[str]:
    """The category whose time per token grew most from ``base`` to ``p`` (None while the step
    per token is within ``GROWTH`` of the base's)."""
    tb, tp = base.detail["tokens_per_step"], p.detail["tokens_per_step"]
    if p.step_ms / tp < (1 + GROWTH) * base.step_ms / tb:
        return None
    return max(p.phases_ms, key=lambda c: p.phases_ms[c] / tp - base.phases_ms[c] / tb)


def target_series(t: Target, cal: Calibration, gpus=GPU_COUNTS) -> dict:
    """Projections of target ``t`` at each G: its parameters (fused and fused+overlap), today's
    layout (FSDP2 full sharding, flat exchange, one micro-batch) and the NCCL reference."""
    cfg = load_recipe(t.recipe)
    out: dict = {"chosen": [], "overlap": [], "today": [], "reference": []}
    for G in gpus:
        out["chosen"].append(project(cfg, _scenario(t, G), cal))
        out["overlap"].append(project(cfg, _scenario(t, G, preset="fused+overlap"), cal))
        out["today"].append(project(cfg, Scenario(t.hardware, G, min(cfg.parallel.ep, G), "fused", exchange="flat",
                                                  sharding="full", grad_accum=1), cal))
        out["reference"].append(project(cfg, _scenario(t, G, preset="reference"), cal))
    return out


def first_bottleneck(series: list[Projection]) -> str:
    base = series[0]
    for p in series[1:]:
        g = _growth(base, p)
        if g is not None:
            return f"{g} (first grows at {p.scenario.gpus} GPUs)"
    return f"none grows by {100 * GROWTH:.0f}% up to {series[-1].scenario.gpus} GPUs (largest: {series[-1].bottleneck})"


def format_target(t: Target, cal: Calibration, series: dict) -> list[str]:
    ch = series["chosen"]
    out = [f"### {t.recipe} on {t.hardware}: {_fmt_params(t.params)}",
           "",
           f"Why: {t.why}.",
           "",
           "| GPUs | EP | nodes/EP group | MFU fused | fused+overlap | today's layout (full, flat) | reference (NCCL) | "
           "tokens/s/GPU | step ms | largest category (ms) | grew most since the first row |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(ch):
        g = _growth(ch[0], p) if i else None
        out.append(f"| {p.scenario.gpus} | {p.scenario.ep} | {p.detail['ep_nodes']} | {100 * p.mfu:.1f}% | "
                   f"{100 * series['overlap'][i].mfu:.1f}% | {100 * series['today'][i].mfu:.1f}% | "
                   f"{100 * series['reference'][i].mfu:.1f}% | {p.tokens_per_s_per_gpu / 1e3:.1f}k | {p.step_ms:.0f} | "
                   f"{p.bottleneck} {p.phases_ms[p.bottleneck]:.0f} | {g or '-'} |")
    out.append(f"\nFirst bottleneck (fused): {first_bottleneck(ch)}; today's layout: {first_bottleneck(series['today'])}.")
    out += ["", "Per-leg GB sent per GPU per optimizer step (NVLink / NIC), fused:", "",
            "| GPUs | dispatch | combine | dispatch bwd | combine bwd | gradient sync | NIC rows/token/op | "
            "state GB/GPU | tokens/step (all GPUs) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in ch:
        if p.scenario.gpus not in REPORT_SCALES:
            continue
        cells = [f"{p.legs_gb[k]['nvlink']:.2f} / {p.legs_gb[k]['nic']:.2f}"
                 for k in ("dispatch", "combine", "dispatch_bwd", "combine_bwd", "grad_sync")]
        out.append(f"| {p.scenario.gpus} | " + " | ".join(cells) + f" | {p.detail['rows_per_token_nic']:.2f} | "
                   f"{p.state_gb:.1f} | {p.detail['tokens_per_step'] * p.scenario.gpus / 1e6:.1f}M |")
    return out


def format_choices(t: Target, cal: Calibration, G: int = 1024) -> list[str]:
    cfg = load_recipe(t.recipe)
    out = [f"{t.recipe} on {t.hardware} at {G} GPUs, recipe parameters a user would weigh (hierarchical exchange "
           "whenever the EP group spans nodes):", "",
           "| parameters | MFU fused | fused+overlap | state GB/GPU | tokens/step | NIC GB/step (exchange / gradients) | "
           "largest category (ms) |", "|---|---|---|---|---|---|---|"]
    seen = []
    for c in CHOICES + (t.params,):
        c = {k: v for k, v in c.items() if k != "preset"}
        if c in seen or cfg.model.moe.num_experts % c["ep"]:
            continue
        seen.append(c)
        a = project(cfg, Scenario(t.hardware, G, c["ep"], "fused", **{k: v for k, v in c.items() if k != "ep"}), cal)
        b = project(cfg, Scenario(t.hardware, G, c["ep"], "fused+overlap", **{k: v for k, v in c.items() if k != "ep"}), cal)
        nic_x = sum(a.legs_gb[k]["nic"] for k in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"))
        mark = " (chosen)" if c == {k: v for k, v in t.params.items() if k != "preset"} else ""
        out.append(f"| {_fmt_params(c)}{mark} | {100 * a.mfu:.1f}% | {100 * b.mfu:.1f}% | {a.state_gb:.1f} | "
                   f"{a.detail['tokens_per_step'] * G / 1e6:.1f}M | {nic_x:.1f} / {a.legs_gb['grad_sync']['nic']:.1f} | "
                   f"{a.bottleneck} {a.phases_ms[a.bottleneck]:.0f} |")
    return out


def format_what_if(t: Target, cal: Calibration, G: int = 1024) -> list[str]:
    """The target's 1024-GPU MFU with one input or choice changed (scenario fields; ``batch`` x:
    ``data.batch_size`` times x, i.e. x times the tokens per GPU and per step)."""
    cfg = load_recipe(t.recipe)
    rows = [("as chosen", {}), ("exchange-GEMM overlap", dict(preset="fused+overlap")),
            ("NIC 800 Gb/s", dict(nic_scale=2.0)), ("bf16 gradient reduction", dict(reduce_dtype="bf16")),
            ("2 micro-batches", dict(grad_accum=2)), ("2x tokens per GPU", dict(batch=2)),
            ("overlap + 800 Gb/s", dict(preset="fused+overlap", nic_scale=2.0)),
            ("EP 8, 2x tokens per GPU, bf16 gradient reduction", dict(ep=8, node_limit=None, batch=2, reduce_dtype="bf16"))]
    out = [f"| {t.hardware}: what moves the 1024-GPU MFU | MFU | tokens/step |", "|---|---|---|"]
    for name, over in rows:
        over = dict(over)
        x = over.pop("batch", 1)
        c = cfg if x == 1 else load_recipe(t.recipe, [f"data.batch_size={x * cfg.data.batch_size}"])
        p = project(c, _scenario(t, G, **over), cal)
        out.append(f"| {name} | {100 * p.mfu:.1f}% | {p.detail['tokens_per_step'] * G / 1e6:.1f}M |")
    return out


def format_wide(recipe: str, hardware: str, cal: Calibration, gpus=(16, 64, 256)) -> list[str]:
    cfg = load_recipe(recipe)
    E = cfg.model.moe.num_experts
    out = [f"{recipe} on {hardware}, wide EP (ep = gcd(G, E={E}) across nodes, hybrid sharding): exchange by design",
           "| GPUs | EP | traffic | nodes/token limit | NVLink rows/token | NIC rows/token | NIC GB/step | MFU fused | "
           "fused+overlap |", "|---|---|---|---|---|---|---|---|---|"]
    for G in gpus:
        ep = math.gcd(G, E)
        for kind, M in WIDE_VARIANTS:
            kw = dict(traffic=kind, node_limit=M, sharding="hybrid", grad_accum=1)
            a = project(cfg, Scenario(hardware, G, ep, "fused", **kw), cal)
            b = project(cfg, Scenario(hardware, G, ep, "fused+overlap", **kw), cal)
            nic = sum(a.legs_gb[k]["nic"] for k in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"))
            out.append(f"| {G} | {ep} | {kind} | {M or '-'} | {a.detail['rows_per_token_nvlink']:.2f} | "
                       f"{a.detail['rows_per_token_nic']:.2f} | {nic:.1f} | {100 * a.mfu:.1f}% | {100 * b.mfu:.1f}% |")
    return out


def format_targets(cal: Calibration, G: int = 1024) -> list[str]:
    out = ["| device | recipe | parameters | projected MFU at 1024 GPUs | target | verdict |", "|---|---|---|---|---|---|"]
    for t in TARGETS:
        p = project(load_recipe(t.recipe), _scenario(t, G), cal)
        gap = p.mfu - t.mfu
        verdict = "met" if gap >= 0 else f"short by {100 * -gap:.1f} points"
        out.append(f"| {t.hardware} | {t.recipe} | {_fmt_params(t.params)} | {100 * p.mfu:.1f}% | "
                   f"{100 * t.mfu:.0f}% | {verdict} |")
    return out


def plot_projection(cal: Calibration, path: str, series: dict, measured: Optional[list] = None) -> None:
    """MFU and tokens/s/GPU against GPU count for every target (lines: projected; markers:
    measured points of ``check_measurements``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"chosen": ("-", "fused EP, recipe parameters"), "overlap": ("-.", "+ exchange-GEMM overlap"),
              "today": (":", "today's layout (full sharding, flat exchange)")}
    colors = {"H200": "tab:green", "B200": "tab:blue", "GB200-NVL72": "tab:purple", "MI300X": "tab:red"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    for t in TARGETS:
        for key, (ls, label) in styles.items():
            pts = series[t.hardware][key]
            xs = [p.scenario.gpus for p in pts]
            kw = dict(ls=ls, color=colors[t.hardware], lw=1.5, label=f"{t.hardware}: {label}")
            ax1.plot(xs, [100 * p.mfu for p in pts], **kw)
            ax2.plot(xs, [p.tokens_per_s_per_gpu / 1e3 for p in pts], **kw)
        ax1.plot([1024], [100 * t.mfu], marker="_", color=colors[t.hardware], ms=14, mew=2)
    for r in measured or []:
        for ax, y, yp in ((ax1, 100 * (r["measured_mfu"] or 0), 100 * r["predicted_mfu"]),
                          (ax2, r["measured_tps"] / 1e3, r["predicted_tps"] / 1e3)):
            ax.plot([r["gpus"]], [y], "o", color="black", ms=4)
            ax.plot([r["gpus"]], [yp], "x", color="black", ms=5)
    if measured:
        ax1.plot([], [], "o", color="black", ms=4, label="measured, 1-2 x H200 (the h200_1gpu model, 32k tok/GPU)")
        ax1.plot([], [], "x", color="black", ms=5, label="projected at the measured points")
    ax1.plot([], [], "_", color="gray", ms=14, mew=2, label="issue 35 target at 1024 GPUs")
    for ax, yl in ((ax1, "MFU (%)"), (ax2, "tokens/s per GPU (thousands)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(yl)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax1.set_title("projected (lines) and measured (dots)", fontsize=10)
    ax2.set_title("weak scaling, recipe tokens per GPU", fontsize=10)
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=6.5, frameon=False)
    fig.tight_layout(rect=(0, 0.26, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def project_main(args) -> int:
    """``bench/scaling.py --project``: inputs, measured vs projected, targets, choices, traffic, plot."""
    cal = load_calibration(args.calibration)
    extra = [row for p in args.measured for row in measured_from_harness(p)]
    print("# Scaling projection (bench/scaling_model.py)\n\nEvery number below is PROJECTED unless marked measured.\n")
    print("## Inputs (each measured or assumed, with its source)\n")
    print("\n".join(describe_assumptions(cal)))
    checks = check_measurements(cal, extra)
    print("\n## Measured vs projected step time ('calibration' points are model inputs, reproduced by "
          "construction; 'check' points are predicted without being fitted)\n")
    print("\n".join(format_checks(checks)))
    print("\n## Measured / projected ms per category (harness phases)\n")
    print("\n".join(format_phases(checks)))
    print("\n## Targets at 1024 GPUs\n")
    print("\n".join(format_targets(cal)))
    series = {}
    for t in TARGETS:
        series[t.hardware] = target_series(t, cal)
        print("\n" + "\n".join(format_target(t, cal, series[t.hardware])))
        print("\n" + "\n".join(format_choices(t, cal)))
        print("\n" + "\n".join(format_what_if(t, cal)))
    print("\n## Flat vs hierarchical exchange across nodes\n")
    for t in TARGETS:
        print("\n".join(format_wide(t.recipe, t.hardware, cal)) + "\n")
    if args.plot:
        plot_projection(cal, args.plot, series, checks)
        print(f"wrote {args.plot}")
    if args.json:
        out = {"checks": [{k: v for k, v in r.items() if k != "projection"} | {"predicted_phases_ms": r["projection"].phases_ms}
                          for r in checks],
               "targets": {t.hardware: {k: [_projection_dict(p) for p in v] for k, v in series[t.hardware].items()}
                           for t in TARGETS}}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


def _projection_dict(p: Projection) -> dict:
    d = asdict(p)
    d["bottleneck"] = p.bottleneck
    return d


__all__ = ["TARGETS", "Target", "CHOICES", "project_main", "target_series", "first_bottleneck", "plot_projection"]
