"""Plots from a run's ``metrics.jsonl``: loss, throughput, and per-expert load.

    python -m train.plot runs/debug_cpu/metrics.jsonl [--out runs/debug_cpu]

Writes ``loss.png`` (cross-entropy and aux loss per log step), ``tokens_per_s.png`` (tokens/s per
device), ``mfu.png`` (MFU, only where it is known: a bf16 run on a GPU with a known peak) and
``expert_load.png`` (heat map of each MoE layer's share of tokens per expert over the last log
interval, rows labelled by the layer's index in the model, with max/mean over time beside it).
matplotlib is imported only here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["plot"]


def plot(jsonl: Path, out_dir: Path) -> list[Path]:
    """Writes the plots of ``jsonl`` into ``out_dir``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    recs = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"{jsonl} holds no records")
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


def main(argv=None) -> int:
    """``python -m train.plot``: 0 after writing the plots; a missing or unreadable file, a record
    without the plotted fields or a missing matplotlib is one ``error:`` line naming it (status 2 for
    a path that is not a file, 1 otherwise)."""
    ap = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--out", default="", help="output folder (default: beside the JSONL)")
    a = ap.parse_args(argv)
    jsonl = Path(a.jsonl)
    if not jsonl.is_file():
        print(f"error: {jsonl} {'is not a file' if jsonl.exists() else 'does not exist'}", file=sys.stderr)
        return 2
    try:
        paths = plot(jsonl, Path(a.out) if a.out else jsonl.parent)
    except ImportError as e:
        print(f"error: cannot plot {jsonl}: {e} (pip install matplotlib)", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # unreadable, bad JSON, missing fields
        print(f"error: cannot plot {jsonl}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
