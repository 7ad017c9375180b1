"""The report of the scaling projection (issue 11): measured vs projected tables, projected
weak-scaling tables with the largest category at each scale, the wide-EP traffic comparison and the
plot. ``python bench/scaling.py --project [--plot out.png] [--measured run.json ...] [--json out.json]``
calls :func:`project_main`; the model itself is ``bench/scaling_model.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from scaling_model import (CATEGORIES, GPU_COUNTS, HARNESS_PHASES, PRESETS, Calibration, Projection, Scenario,
                           check_measurements, describe_assumptions, load_calibration, load_recipe,
                           measured_from_harness, project, scaling_rows)

REPORT_RECIPES = (("h200_8gpu_ep8", "H200"), ("b200_multinode", "B200"), ("b200_multinode", "GB200-NVL72"),
                  ("mi300x_multinode", "MI300X"))
PLOT_RECIPES = (("h200_8gpu_ep8", "H200"), ("b200_multinode", "B200"), ("mi300x_multinode", "MI300X"))
WIDE_RECIPES = PLOT_RECIPES + (("b200_multinode", "GB200-NVL72"),)
WIDE_VARIANTS = (("per_slot", None), ("rank_dedup", None), ("rank_dedup", 4), ("node_dedup", 4))
# Categories as the harness can see them: "FSDP copies" runs inside its fwd/bwd, so it joins "rest".
COMPARED = tuple(c for c in CATEGORIES if c != "FSDP copies")


def _compared(phases_ms: dict) -> dict:
    out = {c: phases_ms[c] for c in COMPARED}
    out["rest"] += phases_ms.get("FSDP copies", 0.0)
    return out


def format_checks(rows: list[dict]) -> list[str]:
    out = ["| point | use | device | GPUs | EP | preset | tokens/GPU | measured ms | projected ms | error | "
           "measured tok/s/GPU | projected | measured MFU | projected MFU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mm = "-" if r["measured_mfu"] is None else f"{100 * r['measured_mfu']:.1f}%"
        out.append(f"| {r['id']} | {r['use']} | {r['hardware']} | {r['gpus']} | {r['ep']} | {r['preset']} | "
                   f"{r['tokens_per_gpu']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {100 * r['error']:+.1f}% | "
                   f"{r['measured_tps']:,.0f} | {r['predicted_tps']:,.0f} | {mm} | {100 * r['predicted_mfu']:.1f}% |")
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


def format_scaling(recipe: str, hardware: str, cal: Calibration) -> list[str]:
    rows = scaling_rows(recipe, hardware, cal)
    by = {(p.scenario.gpus, p.scenario.preset): p for p in rows}
    presets = list(PRESETS)
    out = [f"{recipe} on {hardware} (recipe layout: EP={rows[0].scenario.ep} inside a node, FSDP2 data parallel "
           f"across nodes), projected tokens/s/GPU and MFU, largest category:",
           "| GPUs | " + " | ".join(presets) + " | largest (ms): " + " / ".join(presets) +
           " | grew most since the first row: reference / fused+overlap |",
           "|---|" + "---|" * (len(presets) + 2)]
    first = min(p.scenario.gpus for p in rows)
    for G in GPU_COUNTS:
        if (G, presets[0]) not in by:
            continue
        cells = [f"{by[(G, p)].tokens_per_s_per_gpu / 1e3:.1f}k {100 * by[(G, p)].mfu:.1f}%" for p in presets]
        big = [f"{by[(G, p)].bottleneck} {by[(G, p)].phases_ms[by[(G, p)].bottleneck]:.0f}" for p in presets]
        out.append(f"| {G} | " + " | ".join(cells) + " | " + " / ".join(big) + " | " +
                   f"{_growth(by[(first, 'reference')], by[(G, 'reference')])} / "
                   f"{_growth(by[(first, 'fused+overlap')], by[(G, 'fused+overlap')])} |")
    return out


def format_changes(recipe: str, hardware: str, cal: Calibration, G: int) -> str:
    """What the deduplicated exchange, the fused pipeline and overlap change at G GPUs."""
    cfg = load_recipe(recipe)
    p = {k: project(cfg, Scenario(hardware, G, cfg.parallel.ep, k), cal) for k in PRESETS}

    def cat(k: str, c: str) -> float:
        return p[k].phases_ms[c]
    return (f"{recipe} on {hardware} at {G} GPUs: dedup vs reference: exchange "
            f"{cat('reference', 'exchange'):.0f} -> {cat('dedup', 'exchange'):.0f} ms "
            f"(step {p['reference'].step_ms:.0f} -> {p['dedup'].step_ms:.0f}); fused vs dedup: experts "
            f"{cat('dedup', 'experts'):.0f} -> {cat('fused', 'experts'):.0f} ms, exchange "
            f"{cat('dedup', 'exchange'):.0f} -> {cat('fused', 'exchange'):.0f} ms (step {p['fused'].step_ms:.0f}); "
            f"overlap: exchange -> {cat('fused+overlap', 'exchange'):.0f} ms (step {p['fused+overlap'].step_ms:.0f})")


def _growth(base: Projection, p: Projection) -> str:
    """The category whose time grew most from ``base`` to ``p`` ("-" if the step grew < 2%)."""
    if p.step_ms < 1.02 * base.step_ms:
        return "-"
    k = max(p.phases_ms, key=lambda c: p.phases_ms[c] - base.phases_ms[c])
    return f"{k} +{p.phases_ms[k] - base.phases_ms[k]:.0f} ms"


def format_wide(recipe: str, hardware: str, cal: Calibration, gpus=(16, 64, 256)) -> list[str]:
    cfg = load_recipe(recipe)
    E = cfg.model.moe.num_experts
    out = [f"{recipe} on {hardware}, wide EP (ep = min(G, E={E}) across nodes): exchange per step by traffic design",
           "| GPUs | EP | traffic | node limit M | NIC rows/token | link GB/step | link ms/step | MFU fused | MFU fused+overlap |",
           "|---|---|---|---|---|---|---|---|---|"]
    for G in gpus:
        ep = math.gcd(G, E)
        for kind, M in WIDE_VARIANTS:
            a = project(cfg, Scenario(hardware, G, ep, "fused", traffic=kind, node_limit=M), cal)
            b = project(cfg, Scenario(hardware, G, ep, "fused+overlap", traffic=kind, node_limit=M), cal)
            out.append(f"| {G} | {ep} | {kind} | {M or '-'} | {a.detail['rows_per_token_inter']:.2f} | "
                       f"{a.exchange_gb:.1f} | {a.detail['exchange_link_ms']:.0f} | {100 * a.mfu:.1f}% | {100 * b.mfu:.1f}% |")
    return out


def plot_projection(cal: Calibration, path: str, measured: Optional[list] = None) -> None:
    """MFU and tokens/s/GPU against GPU count for ``PLOT_RECIPES`` (lines: projected; markers:
    measured points of ``check_measurements``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"reference": ("--", "reference (NCCL all-to-all, separate ops)"),
              "dedup": (":", "dedup exchange (today's symm path)"),
              "fused+overlap": ("-", "fused pipeline + dedup + overlap")}
    colors = {"H200": "tab:green", "B200": "tab:blue", "MI300X": "tab:red"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for recipe, hw in PLOT_RECIPES:
        rows = scaling_rows(recipe, hw, cal, presets=tuple(styles))
        for preset, (ls, label) in styles.items():
            pts = [p for p in rows if p.scenario.preset == preset]
            xs = [p.scenario.gpus for p in pts]
            kw = dict(ls=ls, color=colors[hw], lw=1.6, label=f"{hw} {recipe}: {label}")
            ax1.plot(xs, [100 * p.mfu for p in pts], **kw)
            ax2.plot(xs, [p.tokens_per_s_per_gpu / 1e3 for p in pts], **kw)
    for r in measured or []:
        for ax, y, yp in ((ax1, 100 * (r["measured_mfu"] or 0), 100 * r["predicted_mfu"]),
                          (ax2, r["measured_tps"] / 1e3, r["predicted_tps"] / 1e3)):
            ax.plot([r["gpus"]], [y], "o", color="black", ms=5)
            ax.plot([r["gpus"]], [yp], "x", color="black", ms=6)
    if measured:
        ax1.plot([], [], "o", color="black", ms=5, label="measured, 1-2 x H200 (h200_1gpu model: 8 layers, 32k tok/GPU; "
                 "fused, all-to-all and symm paths)")
        ax1.plot([], [], "x", color="black", ms=6, label="projected at the measured points")
    for ax, yl in ((ax1, "MFU (%)"), (ax2, "tokens/s per GPU (thousands)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(yl)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax1.set_title("projected (lines) and measured (dots)", fontsize=10)
    ax2.set_title("weak scaling, recipe layout (EP=8 per node, FSDP2 across)", fontsize=10)
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.24, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def project_main(args, rec=None) -> int:
    """``bench/scaling.py --project``: assumptions, measured vs projected, scaling tables, plot;
    ``rec`` (a ``_results.Recorder``) gets one row per projected scaling point."""
    cal = load_calibration(args.calibration)
    extra = [row for p in args.measured for row in measured_from_harness(p)]
    print("# Scaling projection (bench/scaling_model.py): every number below is PROJECTED unless marked measured\n")
    print("\n".join(describe_assumptions(cal)))
    checks = check_measurements(cal, extra)
    print("\n## Measured vs projected step time ('calibration' points are model inputs, reproduced by "
          "construction; 'check' points are predicted without being fitted)\n")
    print("\n".join(format_checks(checks)))
    print("\n## Measured / projected ms per category (harness phases)\n")
    print("\n".join(format_phases(checks)))
    print("\n## Projected weak scaling\n")
    for recipe, hw in REPORT_RECIPES:
        print("\n".join(format_scaling(recipe, hw, cal)))
        print(format_changes(recipe, hw, cal, 8) + "\n")
    for recipe, hw in WIDE_RECIPES:
        print("\n".join(format_wide(recipe, hw, cal)) + "\n")
    if args.plot:
        plot_projection(cal, args.plot, checks)
        print(f"wrote {args.plot}")
    for recipe, hw in REPORT_RECIPES if rec is not None else ():
        for p in scaling_rows(recipe, hw, cal):  # projected, not measured: no spread
            sc = p.scenario
            rec.row("step", sc.preset, dict(recipe=recipe, hardware=sc.hardware, gpus=sc.gpus, ep=sc.ep), p.step_ms,
                    unit="ms", projected=True, tokens_per_s_per_gpu=p.tokens_per_s_per_gpu, mfu=p.mfu,
                    exchange_gb=p.exchange_gb, bottleneck=p.bottleneck, phases_ms=p.phases_ms)
    if args.json:
        out = {"checks": [{k: v for k, v in r.items() if k != "projection"} | {"predicted_phases_ms": r["projection"].phases_ms}
                          for r in checks],
               "scaling": [_projection_dict(p) for rec, hw in REPORT_RECIPES for p in scaling_rows(rec, hw, cal)]}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


def _projection_dict(p: Projection) -> dict:
    from dataclasses import asdict
    d = asdict(p)
    d["bottleneck"] = p.bottleneck
    return d
