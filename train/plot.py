"""Plots from a run's ``metrics.jsonl``: loss, throughput, and per-expert load; or several runs'
loss curves in one plot.

    python -m train.plot runs/debug_cpu/metrics.jsonl [--out runs/debug_cpu]
    python -m train.plot runs/bf16/metrics.jsonl runs/fp8/metrics.jsonl --label bf16 --label fp8 --out runs/cmp

Writes ``loss.png`` (cross-entropy and aux loss per log step), ``tokens_per_s.png`` (tokens/s per
device), ``mfu.png`` (MFU, only where it is known: a bf16 run on a GPU with a known peak) and
``expert_load.png`` (heat map of each MoE layer's share of tokens per expert over the last log
interval, rows labelled by the layer's index in the model, with max/mean over time beside it).
Given several JSONLs it writes ``loss_compare.png`` instead: each run's cross-entropy per log step
on one axis (labels default to the runs' folder names), and below it each run's relative gap to
the first run at the steps both logged (e.g. fp8 against bf16). matplotlib is imported only here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

__all__ = ["plot", "plot_compare"]


def _records(jsonl: Path) -> list[dict]:
    recs = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"{jsonl} holds no records")
    return recs


def plot(jsonl: Path, out_dir: Path) -> list[Path]:
    """Writes the plots of ``jsonl`` into ``out_dir``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    recs = _records(jsonl)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in recs]
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    l1 = ax.plot(steps, [r["loss"] for r in recs], marker=".", label="cross-entropy (left)")
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)")
    ax2 = ax.twinx()
    l2 = ax2.plot(steps, [r["aux_loss"] for r in recs], color="tab:orange", alpha=0.6, label="aux + z (right)")
    ax2.set_ylabel("aux loss")
    # One legend above the plot area: it covers neither curve nor the right axis' labels.
    ax.legend(l1 + l2, [h.get_label() for h in l1 + l2], loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=2, frameon=False)
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["tokens_per_s_per_gpu"] for r in recs], marker=".")
    ax.set_xlabel("step"), ax.set_ylabel("tokens/s per device")
    ax.set_ylim(bottom=0)
    save(fig, "tokens_per_s.png")

    if all(r.get("mfu") is not None for r in recs):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, [100 * r["mfu"] for r in recs], marker=".")
        ax.set_xlabel("step"), ax.set_ylabel("MFU (%)")
        ax.set_ylim(bottom=0)
        save(fig, "mfu.png")

    counts = recs[-1]["tokens_per_expert"]  # [moe layers][E]
    layer_ids = recs[-1].get("moe_layers") or list(range(len(counts)))
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    if counts:
        share = [[c / max(sum(row), 1) for c in row] for row in counts]
        im = a0.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(im, ax=a0, label="share of tokens")
        a0.set_yticks(range(len(counts)), [str(i) for i in layer_ids])
        a0.xaxis.set_major_locator(MaxNLocator(integer=True))
    a0.set_xlabel("expert"), a0.set_ylabel("model layer (MoE)")
    a0.set_title(f"expert load, steps {steps[-2] + 1 if len(steps) > 1 else 1}-{steps[-1]}")
    a1.plot(steps, [r["load_imbalance"] for r in recs], marker=".")
    a1.axhline(1.0, color="gray", lw=0.5)
    a1.set_xlabel("step"), a1.set_ylabel("max / mean tokens per expert")
    save(fig, "expert_load.png")
    return paths


def plot_compare(jsonls: list, labels: Optional[list] = None, out_dir: Optional[Path] = None) -> Path:
    """Writes ``loss_compare.png`` (module docstring) for ``jsonls`` into ``out_dir`` (default: beside
    the first); returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jsonls = [Path(j) for j in jsonls]
    if len(jsonls) < 2:
        raise ValueError(f"plot_compare needs at least two runs, got {len(jsonls)}")
    labels = list(labels) if labels else [j.parent.name or str(j) for j in jsonls]
    if len(labels) != len(jsonls):
        raise ValueError(f"{len(labels)} labels for {len(jsonls)} runs")
    runs = [{r["step"]: r["loss"] for r in _records(j)} for j in jsonls]
    fig, (ax, gap) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for label, run in zip(labels, runs):
        steps = sorted(run)
        ax.plot(steps, [run[s] for s in steps], marker="." if len(steps) < 60 else None, label=label)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend(frameon=False)
    base = runs[0]
    for label, run in zip(labels[1:], runs[1:]):
        common = sorted(set(base) & set(run))
        gap.plot(common, [100 * (run[s] - base[s]) / base[s] for s in common], label=f"{label} vs {labels[0]}")
    gap.axhline(0.0, color="gray", lw=0.5)
    gap.set_xlabel("step"), gap.set_ylabel(f"gap to {labels[0]} (%)")
    gap.legend(frameon=False)
    fig.tight_layout()
    out_dir = Path(out_dir) if out_dir else jsonls[0].parent
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "loss_compare.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    """``python -m train.plot``: 0 after writing the plots; a missing or unreadable file, a record
    without the plotted fields or a missing matplotlib is one ``error:`` line naming it (status 2 for
    a path that is not a file, 1 otherwise)."""
    ap = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", help="one run's metrics.jsonl, or several to overlay their loss curves")
    ap.add_argument("--label", action="append", default=None, help="a run's name in the overlay (once per JSONL)")
    ap.add_argument("--out", default="", help="output folder (default: beside the (first) JSONL)")
    a = ap.parse_args(argv)
    if a.label and len(a.jsonl) < 2:
        ap.error("--label names the runs of an overlay: give two or more JSONLs")
    jsonls = [Path(j) for j in a.jsonl]
    for jsonl in jsonls:
        if not jsonl.is_file():
            print(f"error: {jsonl} {'is not a file' if jsonl.exists() else 'does not exist'}", file=sys.stderr)
            return 2
    what = " ".join(map(str, jsonls))
    try:
        if len(jsonls) > 1:
            paths = [plot_compare(jsonls, a.label, Path(a.out) if a.out else None)]
        else:
            paths = plot(jsonls[0], Path(a.out) if a.out else jsonls[0].parent)
    except ImportError as e:
        print(f"error: cannot plot {what}: {e} (pip install matplotlib)", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # unreadable, bad JSON, missing fields
        print(f"error: cannot plot {what}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
