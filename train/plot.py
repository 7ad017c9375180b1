"""Plots from a run's ``metrics.jsonl``: loss, MFU, and per-expert load.

    python -m train.plot runs/debug_cpu/metrics.jsonl [--out runs/debug_cpu]

Writes ``loss.png`` (loss and aux loss per log step), ``mfu.png`` (MFU, or tokens/s per GPU where
MFU is n/a, e.g. on CPU) and ``expert_load.png`` (heat map of each MoE layer's share of tokens per
expert over the last log interval, with max/mean over time beside it). matplotlib is imported only
here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(jsonl: Path, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"{jsonl} holds no records")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in recs]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["loss"] for r in recs], label="cross-entropy")
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["aux_loss"] for r in recs], color="tab:orange", alpha=0.6, label="aux + z")
    ax2.set_ylabel("aux loss")
    fig.legend(loc="upper right")
    fig.tight_layout()
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    if all(r.get("mfu") is not None for r in recs):
        ax.plot(steps, [100 * r["mfu"] for r in recs])
        ax.set_ylabel("MFU (%)")
    else:
        ax.plot(steps, [r["tokens_per_s_per_gpu"] for r in recs])
        ax.set_ylabel("tokens/s per device (MFU n/a)")
    ax.set_xlabel("step")
    fig.tight_layout()
    paths.append(out_dir / "mfu.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    counts = recs[-1]["tokens_per_expert"]  # [layers][E]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    if counts:
        share = [[c / max(sum(row), 1) for c in row] for row in counts]
        im = a0.imshow(share, aspect="auto", cmap="viridis")
        fig.colorbar(im, ax=a0, label="share of tokens")
    a0.set_xlabel("expert"), a0.set_ylabel("MoE layer"), a0.set_title(f"expert load, step {steps[-1]}")
    a1.plot(steps, [r["load_imbalance"] for r in recs])
    a1.axhline(1.0, color="gray", lw=0.5)
    a1.set_xlabel("step"), a1.set_ylabel("max / mean tokens per expert")
    fig.tight_layout()
    paths.append(out_dir / "expert_load.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--out", default="", help="output folder (default: beside the JSONL)")
    a = ap.parse_args(argv)
    for p in plot(Path(a.jsonl), Path(a.out) if a.out else Path(a.jsonl).parent):
        print(p)


if __name__ == "__main__":
    main()
