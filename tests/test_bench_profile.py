"""bench/_profile.py's host profile on CPU (the benches that call it need a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _profile import host_profile  # noqa: E402


def test_host_profile_times_both_halves_and_names_the_forward():
    """Enqueue times of both halves, and the forward's own function among the profiled rows, once
    per step; the backward really ran on every step (its gradient accumulates)."""
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    syncs = []

    def my_forward():
        return (x @ w).relu()

    text = host_profile(my_forward, lambda out: out.sum().backward(), 4, lambda: syncs.append(1), top=8)
    lines = text.splitlines()
    assert lines[0].startswith("  host enqueue per step: forward ") and "backward" in lines[0]
    row = next(ln for ln in lines if "my_forward" in ln)
    assert float(row.split()[1]) == 1.0  # one call per step
    # 4 timed + 4 profiled steps, each one backward: d/dw sum(relu(x @ w)) = x^T (x @ w > 0), 8 times
    torch.testing.assert_close(w.grad, 8 * (x.T @ (x @ w > 0).float()))
    assert len(syncs) >= 2 * 4  # the GPU is drained before every timed and every profiled step
