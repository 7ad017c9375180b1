"""bench/hier_overlap.py on CPU (the timed part needs a GPU): its command line's checks, the
inter-node rows its paced window is sized by (against the hierarchical exchange's reference
counts), and the ``--dry`` path.

On one H200 (registered as ``bench-hier-overlap`` in scripts/gpu_checks.toml):

    python3 bench/hier_overlap.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import hier_overlap as bench  # noqa: E402
from tlx_dist.comm.hier_reference import hier_dispatch_reference  # noqa: E402


@pytest.mark.parametrize("argv,flag", [
    (["--nic-gbs", "0"], "--nic-gbs"),
    (["--nic-gbs", "50,x"], "--nic-gbs"),
    (["--ranks-per-node", "3"], "--ranks-per-node"),      # does not divide W = 8
    (["--ranks-per-node", "8"], "--ranks-per-node"),      # one node: nothing crosses a NIC
    (["--rank", "8"], "--rank"),
    (["--experts", "12"], "--experts"),                   # not divisible by W = 8
    (["--topk", "0"], "--topk"),
    (["--side-sms", "0"], "--side-sms"),
])
def test_bad_arguments_name_their_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=flag):
        bench.parse_args(argv)
    assert bench.main(argv + ["--dry", "--no-results"]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("W,L", [(8, 4), (4, 2), (8, 2)])
def test_nic_rows_are_the_references(W, L):
    """Rows in at each relay: over all relays, the reference's NIC rows out of every sender; with
    two nodes each relay's are its one counterpart's exactly (the owner's other-node rows are checked
    against its receive plan on the GPU)."""
    args = bench.parse_args(["--world", str(W), "--ranks-per-node", str(L), "--tokens", "64", "--dim", "8",
                             "--experts", str(4 * W), "--topk", "3", "--seed", "5"])
    idxs = bench.routing(args)
    xs = [torch.zeros(64, 8) for _ in range(W)]
    ref = hier_dispatch_reference(xs, idxs, 4 * W, L)
    nic_in = bench.nic_rows_in(idxs, 4 * W, W, L)
    assert sum(nic_in) == int(ref.counts.nic_rows_W.sum())
    if W // L == 2:
        assert nic_in == [int(ref.counts.nic_rows_W[(v + L) % W]) for v in range(W)]


def test_window_is_the_busiest_relays_bytes_at_the_rate():
    args = bench.parse_args(["--tokens", "256", "--dim", "1024", "--nic-gbs", "25,50"])
    idxs = bench.routing(args)
    nic = bench.nic_rows_in(idxs, args.experts, 8, 4)
    want = max(nic[:4]) * 1024 * 2 / 50e9 * 1e3
    assert bench.window_ms(args, idxs, 50.0) == pytest.approx(want)
    assert bench.window_ms(args, idxs, 25.0) == pytest.approx(2 * want)


def test_dry_prints_the_plan(capsys):
    assert bench.main(["--dry", "--tokens", "128", "--nic-gbs", "25,50", "--no-results"]) == 0
    out = capsys.readouterr().out
    assert "W=8 as 2 x 4" in out and "paced window at 25 GB/s" in out and "paced window at 50 GB/s" in out
