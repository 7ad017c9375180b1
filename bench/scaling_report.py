"""The report of the scaling projection (issues 11 and 35): the inputs, measured vs projected (fit and
check points, step time and peak memory), each target recipe's weak-scaling series with per-leg
bytes and its first bottleneck, the recipe choices at 1024 GPUs, the flat vs hierarchical traffic,
and the plot. A target projects a shipped multi-node recipe as written: its EP degree, sharding,
``grad_accum``, ``reduce_dtype``, tokens per GPU and routing are the file's, never overridden here.
``python bench/scaling.py --project [--plot out.png] [--measured run.json ...] [--json out.json]``
calls :func:`project_main`; the model is ``bench/scaling_model.py``. The printout is Markdown.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from scaling_checks import check_measurements, check_memory, describe_assumptions, measured_from_harness
from scaling_model import (CATEGORIES, GPU_COUNTS, HARDWARE, HARNESS_PHASES, Calibration, Projection, Scenario,
                           load_calibration, load_recipe, project)

# Categories as the harness can see them: "FSDP copies" runs inside its fwd/bwd, so it joins "rest".
COMPARED = tuple(c for c in CATEGORIES if c != "FSDP copies")
REPORT_SCALES = (8, 64, 256, 1024)
GROWTH = 0.02        # a category "grows" once the step is 2% longer than at the first scale


@dataclass(frozen=True)
class Target:
    """Issue 35's MFU target at 1024 GPUs for one device and the shipped recipe projected for it, with
    the parameters the recipe file sets (``recipe_params``)."""

    hardware: str
    recipe: str
    mfu: float
    why: str


TARGETS = (
    Target("H200", "h200_8x8", 0.35,
           "EP=8 inside the NVLink node keeps every token row off the NICs; HSDP leaves one all-reduce of a "
           "1/8 parameter shard per optimizer step on them, hidden in the last micro-batch's backward"),
    Target("B200", "b200_16x8", 0.30,
           "EP=8 inside the node keeps the token rows on NVLink; each GPU then holds 1/8 of the experts whole "
           "(3.5B parameters), whose gradients HSDP all-reduces across nodes once per step: in bf16 that is half "
           "the bytes, and 32k tokens per GPU in one micro-batch give the backward that hides it twice the "
           "length; 32k tokens is what the 180 GB hold next to 60 GB of fp32 state (the memory column)"),
    Target("GB200-NVL72", "b200_16x8", 0.30,
           "the rack is the node: HSDP shards dense and expert parameters over 64 GPUs of the NVLink domain, "
           "so the cross-rack all-reduce carries 1/64 of the parameters; EP=8 keeps the exchange on NVLink"),
    Target("MI300X", "mi300x_16x8", 0.35,
           "as H200: EP=8 over the xGMI mesh, HSDP, the cross-node all-reduce once per step of 2 micro-batches"),
)

# Rows of the choice table at 1024 GPUs: the layouts and EP degrees a user would weigh (the recipe's
# reduce dtype and tokens per GPU; TOKEN_CHOICES varies those).
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
# Sequences per GPU and micro-batch (data.batch_size) the token table tries, at the recipe's layout.
TOKEN_CHOICES = (2, 4, 6, 8, 12, 16)
WIDE_VARIANTS = (("per_slot", None), ("rank_dedup", None), ("node_dedup", None), ("rank_dedup", 2), ("node_dedup", 2))


def _compared(phases_ms: dict) -> dict:
    out = {c: phases_ms[c] for c in COMPARED}
    out["rest"] += phases_ms.get("FSDP copies", 0.0)
    return out


def recipe_params(cfg) -> dict:
    """What a recipe sets that the projection reads: EP degree, sharding, micro-batches, gradient
    reduce dtype, tokens per GPU and micro-batch, and the routing's group limit (if any)."""
    p, moe = cfg.parallel, cfg.model.moe
    out = dict(ep=p.ep, sharding=p.sharding, grad_accum=cfg.train.grad_accum, reduce_dtype=p.reduce_dtype,
               tokens=cfg.data.batch_size * cfg.data.seq_len)
    if moe.group_limited:
        out["groups"] = f"{moe.topk_group} of {moe.n_group}"
    return out


def _fmt_params(params: dict) -> str:
    names = {"ep": "EP", "sharding": "", "grad_accum": "accum", "node_limit": "nodes/token", "exchange": "exchange",
             "nic_scale": "NIC x", "reduce_dtype": "reduce", "groups": "expert groups"}
    out = []
    for k, v in params.items():
        if k == "preset":
            continue
        if k == "tokens":
            out.append(f"{v // 1024}k tokens/GPU")
        else:
            out.append(f"{names[k]} {v}".strip() if names[k] else str(v))
    return ", ".join(out)


def _scenario(t: Target, G: int, **over) -> Scenario:
    """The recipe as written (every Scenario field None: the recipe's), ``over`` changed."""
    ep = min(over.pop("ep", load_recipe(t.recipe).parallel.ep), G)
    return Scenario(t.hardware, G, ep, over.pop("preset", "fused"), **over)


def _memory(p: Projection) -> str:
    """State + activations per GPU (GB) and whether they fit the device's HBM."""
    total, hbm = p.state_gb + p.activation_gb, HARDWARE[p.scenario.hardware].hbm_gb
    return f"{p.state_gb:.0f} + {p.activation_gb:.0f} = {total:.0f}{'' if total <= hbm else ' (over ' + f'{hbm:g})'}"


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
    """Projections of target ``t`` at each G: the recipe as written (fused and fused+overlap), the
    layout before issue 35 (FSDP2 full sharding, flat exchange, one micro-batch, fp32 reduction) and
    the NCCL reference."""
    cfg = load_recipe(t.recipe)
    out: dict = {"chosen": [], "overlap": [], "today": [], "reference": []}
    for G in gpus:
        out["chosen"].append(project(cfg, _scenario(t, G), cal))
        out["overlap"].append(project(cfg, _scenario(t, G, preset="fused+overlap"), cal))
        out["today"].append(project(cfg, Scenario(t.hardware, G, min(cfg.parallel.ep, G), "fused", exchange="flat",
                                                  sharding="full", grad_accum=1, reduce_dtype="float32"), cal))
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
    out = [f"### {t.recipe} on {t.hardware}: {_fmt_params(recipe_params(load_recipe(t.recipe)))}",
           "",
           f"Why: {t.why}.",
           "",
           "| GPUs | EP | nodes/EP group | MFU fused | fused+overlap | today's layout (full, flat, fp32) | reference (NCCL) | "
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
            "state + activations GB/GPU (est.) | tokens/step (all GPUs) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in ch:
        if p.scenario.gpus not in REPORT_SCALES:
            continue
        cells = [f"{p.legs_gb[k]['nvlink']:.2f} / {p.legs_gb[k]['nic']:.2f}"
                 for k in ("dispatch", "combine", "dispatch_bwd", "combine_bwd", "grad_sync")]
        out.append(f"| {p.scenario.gpus} | " + " | ".join(cells) + f" | {p.detail['rows_per_token_nic']:.2f} | "
                   f"{_memory(p)} | {p.detail['tokens_per_step'] * p.scenario.gpus / 1e6:.1f}M |")
    return out


def format_choices(t: Target, cal: Calibration, G: int = 1024) -> list[str]:
    cfg = load_recipe(t.recipe)
    rp = recipe_params(cfg)
    mine = dict(ep=rp["ep"], sharding=rp["sharding"], grad_accum=rp["grad_accum"])
    out = [f"{t.recipe} on {t.hardware} at {G} GPUs, layouts a user would weigh (the recipe's reduce dtype "
           f"{rp['reduce_dtype']} and {rp['tokens'] // 1024}k tokens per GPU; hierarchical exchange whenever the EP "
           "group spans nodes):", "",
           "| parameters | MFU fused | fused+overlap | state + activations GB/GPU (est.) | tokens/step | "
           "NIC GB/step (exchange / gradients) | largest category (ms) |", "|---|---|---|---|---|---|---|"]
    seen = []
    for c in (mine,) + CHOICES:
        if c in seen or cfg.model.moe.num_experts % c["ep"]:
            continue
        seen.append(c)
        kw = {k: v for k, v in c.items() if k != "ep"}
        a = project(cfg, Scenario(t.hardware, G, c["ep"], "fused", **kw), cal)
        b = project(cfg, Scenario(t.hardware, G, c["ep"], "fused+overlap", **kw), cal)
        nic_x = sum(a.legs_gb[k]["nic"] for k in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"))
        mark = " (the recipe)" if c == mine else ""
        out.append(f"| {_fmt_params(c)}{mark} | {100 * a.mfu:.1f}% | {100 * b.mfu:.1f}% | {_memory(a)} | "
                   f"{a.detail['tokens_per_step'] * G / 1e6:.1f}M | {nic_x:.1f} / {a.legs_gb['grad_sync']['nic']:.1f} | "
                   f"{a.bottleneck} {a.phases_ms[a.bottleneck]:.0f} |")
    return out


def format_tokens(t: Target, cal: Calibration, G: int = 1024) -> list[str]:
    """Tokens per GPU and reduce dtype at the recipe's layout: MFU, the global batch and whether
    the state and the estimated activations fit the device (A7)."""
    cfg = load_recipe(t.recipe)
    rp = recipe_params(cfg)
    S = cfg.data.seq_len
    out = [f"{t.recipe} on {t.hardware} at {G} GPUs, tokens per GPU (data.batch_size x {S}) and gradient reduce "
           f"dtype at the recipe's layout ({_fmt_params({k: rp[k] for k in ('ep', 'sharding', 'grad_accum')})}):", "",
           "| data.batch_size | tokens/GPU | tokens/step | MFU, float32 reduction | MFU, bfloat16 reduction | "
           f"state + activations GB/GPU (est., of {HARDWARE[t.hardware].hbm_gb:g}) |", "|---|---|---|---|---|---|"]
    for b in sorted(set(TOKEN_CHOICES) | {cfg.data.batch_size}):
        c = load_recipe(t.recipe, [f"data.batch_size={b}"])
        p = {rd: project(c, _scenario(t, G, reduce_dtype=rd), cal) for rd in ("float32", "bfloat16")}
        mark = " (the recipe)" if b == cfg.data.batch_size else ""
        out.append(f"| {b}{mark} | {b * S // 1024}k | {p['float32'].detail['tokens_per_step'] * G / 1e6:.1f}M | "
                   f"{100 * p['float32'].mfu:.1f}% | {100 * p['bfloat16'].mfu:.1f}% | {_memory(p[rp['reduce_dtype']])} |")
    return out


def format_what_if(t: Target, cal: Calibration, G: int = 1024) -> list[str]:
    """The target's 1024-GPU MFU with one input or choice of the recipe changed (scenario fields)."""
    cfg = load_recipe(t.recipe)
    rp = recipe_params(cfg)
    other = "float32" if rp["reduce_dtype"] == "bfloat16" else "bfloat16"
    rows = [("the recipe", {}), ("exchange-GEMM overlap", dict(preset="fused+overlap")),
            ("NIC 800 Gb/s", dict(nic_scale=2.0)), (f"{other} gradient reduction", dict(reduce_dtype=other)),
            (f"{2 * rp['grad_accum']} micro-batches", dict(grad_accum=2 * rp["grad_accum"])),
            ("overlap + 800 Gb/s", dict(preset="fused+overlap", nic_scale=2.0))]
    out = [f"| {t.hardware}: what moves the 1024-GPU MFU | MFU | tokens/step |", "|---|---|---|"]
    for name, over in rows:
        p = project(cfg, _scenario(t, G, **over), cal)
        out.append(f"| {name} | {100 * p.mfu:.1f}% | {p.detail['tokens_per_step'] * G / 1e6:.1f}M |")
    return out


def format_wide(recipe: str, hardware: str, cal: Calibration, gpus=(16, 64, 256)) -> list[str]:
    cfg = load_recipe(recipe)
    E = cfg.model.moe.num_experts
    out = [f"{recipe} on {hardware}, wide EP (ep = gcd(G, E={E}) across nodes, hybrid sharding, one micro-batch, the "
           "recipe's tokens per GPU and reduce dtype): exchange by design",
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
    out = ["| device | recipe | parameters (from the recipe file) | projected MFU at 1024 GPUs | target | verdict | "
           "tokens/step | state + activations GB/GPU (est.) |", "|---|---|---|---|---|---|---|---|"]
    for t in TARGETS:
        cfg = load_recipe(t.recipe)
        p = project(cfg, _scenario(t, G), cal)
        gap = p.mfu - t.mfu
        verdict = "met" if gap >= 0 else f"short by {100 * -gap:.1f} points"
        out.append(f"| {t.hardware} | {t.recipe} | {_fmt_params(recipe_params(cfg))} | {100 * p.mfu:.1f}% | "
                   f"{100 * t.mfu:.0f}% | {verdict} | {p.detail['tokens_per_step'] * G / 1e6:.1f}M | {_memory(p)} |")
    return out


def format_memory(rows: list[dict]) -> list[str]:
    out = ["| point | use | GPUs | tokens/GPU | measured peak GiB | counted state GiB | activations GiB (est.) | "
           "estimated GiB | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['id']} | {r['use']} | {r['gpus']} | {r['tokens_per_gpu']} | {r['measured_gib']:.2f} | "
                   f"{r['state_gib']:.1f} | {r['activations_gib']:.1f} | {r['estimated_gib']:.1f} | "
                   f"{100 * r['error']:+.1f}% |")
    return out


def plot_projection(cal: Calibration, path: str, series: dict, measured: Optional[list] = None) -> None:
    """MFU and tokens/s/GPU against GPU count for every target (lines: projected; markers:
    measured points of ``check_measurements``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"chosen": ("-", "fused EP, recipe parameters"), "overlap": ("-.", "+ exchange-GEMM overlap"),
              "today": (":", "today's layout (full sharding, flat exchange, fp32)")}
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


def project_main(args, rec=None) -> int:
    """``bench/scaling.py --project``: inputs, measured vs projected, targets, choices, traffic, plot;
    ``rec`` (a ``_results.Recorder``) gets one row per projected point of each target's series."""
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
    memory = check_memory(cal)
    print("\n## Measured vs estimated peak memory (counted state + activations, A7)\n")
    print("\n".join(format_memory(memory)))
    print("\n## Targets at 1024 GPUs\n")
    print("\n".join(format_targets(cal)))
    series = {}
    for t in TARGETS:
        series[t.hardware] = target_series(t, cal)
        print("\n" + "\n".join(format_target(t, cal, series[t.hardware])))
        print("\n" + "\n".join(format_choices(t, cal)))
        print("\n" + "\n".join(format_tokens(t, cal)))
        print("\n" + "\n".join(format_what_if(t, cal)))
    print("\n## Flat vs hierarchical exchange across nodes\n")
    for t in TARGETS:
        print("\n".join(format_wide(t.recipe, t.hardware, cal)) + "\n")
    if args.plot:
        plot_projection(cal, args.plot, series, checks)
        print(f"wrote {args.plot}")
    for t in TARGETS if rec is not None else ():
        for kind, points in series[t.hardware].items():
            for p in points:  # projected, not measured: no spread
                sc = p.scenario
                rec.row("step", f"{kind}:{sc.preset}", dict(recipe=t.recipe, hardware=sc.hardware, gpus=sc.gpus, ep=sc.ep),
                        p.step_ms, unit="ms", projected=True, tokens_per_s_per_gpu=p.tokens_per_s_per_gpu, mfu=p.mfu,
                        exchange_gb=p.exchange_gb, bottleneck=p.bottleneck, phases_ms=p.phases_ms)
    if args.json:
        out = {"checks": [{k: v for k, v in r.items() if k != "projection"} | {"predicted_phases_ms": r["projection"].phases_ms}
                          for r in checks], "memory": memory,
               "targets": {t.hardware: {k: [_projection_dict(p) for p in v] for k, v in series[t.hardware].items()}
                           for t in TARGETS}}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


def _projection_dict(p: Projection) -> dict:
    d = asdict(p)
    d["bottleneck"] = p.bottleneck
    return d


__all__ = ["TARGETS", "Target", "CHOICES", "TOKEN_CHOICES", "recipe_params", "project_main", "target_series",
           "first_bottleneck", "plot_projection"]
