"""Tier T1 for the training loop: EP parity, a 2-node x 2-process torchrun on loopback, and
kill-and-resume, all gloo on CPU in subprocesses.

Tolerance for the parity checks (EP=1 vs EP=2, and 1 rank vs a 2x2 mesh): the runs compute the
same function of the same global batch; they differ only in fp32 summation order (per-rank
gradient partial sums added by all-reduce / reduce-scatter instead of inside one GEMM, loss
averaged over ranks). That is a relative error of a few ulps per step (~1e-6 measured at step 1);
Adam's normalisation and 20 steps let it grow; measured here, the largest 20-step gap was 2.3e-7.
Losses are compared at rtol=2e-5: headroom for other CPUs' summation orders, yet far below the
~1e-2 step-to-step change of the loss, so a wrong gradient scale or reduction group fails it.
Resume is compared *exactly*: the same processes repeat the same ops in the same order.
"""

from __future__ import annotations

import pytest
import torch

from _train import TINY, free_port, popen_pretrain, pretrain_cmd, run_pretrain

STEPS = 20
RTOL = 2e-5


@pytest.fixture(scope="module")
def ep1_losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep1")
    losses, out = run_pretrain(TINY + [f"train.steps={STEPS}", "data.batch_size=8"], tmp, "ep1")
    return losses


def _close(a, b, what):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    gap = ((a - b).abs() / b.abs()).max().item()
    assert torch.allclose(a, b, rtol=RTOL, atol=0), f"{what}: max rel gap {gap:.2e} > {RTOL}\n{a}\n{b}"
    return gap


@pytest.mark.slow
def test_ep1_vs_ep2_losses_match(ep1_losses, tmp_path):
    ep2, out = run_pretrain(TINY + [f"train.steps={STEPS}", "data.batch_size=4", "parallel.ep=2"],
                            tmp_path, "ep2", nproc=2)
    assert "dp=1 x ep=2" in out
    assert len(ep1_losses) == len(ep2) == STEPS
    _close(ep2, ep1_losses, "EP=2 vs EP=1")
    assert ep1_losses[-1] < ep1_losses[0] - 0.5  # and it is learning


@pytest.mark.slow
@pytest.mark.parametrize("sharding,accum", [("full", 1), pytest.param("hybrid", 2, marks=pytest.mark.release)])
def test_two_nodes_two_procs_loopback(ep1_losses, tmp_path, sharding, accum):
    """Two torchrun 'nodes' (--nnodes=2 --node-rank=0/1) on 127.0.0.1, 2 processes each: mesh
    dp=2 x ep=2, so experts are FSDP-sharded over dp and exchanged over ep. 2 sequences per rank
    = the same global batch of 8 as the one-rank run, so the losses must match it too. Hybrid:
    the node layout comes from torchrun's LOCAL_WORLD_SIZE, dense parameters are HSDP over
    (2 nodes, 2 ranks), experts replicated across the nodes, and 2 micro-batches of 1 sequence."""
    steps = 3
    port = free_port()
    ov = TINY + [f"train.steps={steps}", f"data.batch_size={2 // accum}", "parallel.ep=2", "train.log_every=1",
                 f"parallel.sharding={sharding}", f"train.grad_accum={accum}"]
    out_file = tmp_path / "mn.json"
    procs = [popen_pretrain(pretrain_cmd(ov, out_file if i == 0 else None, nproc=2, node=(i, 2, port)))
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except Exception:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-5000:]
    assert f"world=4 (dp=2 x ep=2) nodes=2 sharding={sharding} grad_accum={accum}" in outs[0]
    assert "step 3/3" in outs[0] and "step" not in outs[1].replace("steps", "")  # rank 0 prints only
    import json
    mn = json.loads(out_file.read_text())
    _close(mn, ep1_losses[:steps], "2 nodes x 2 procs (dp=2, ep=2) vs one rank")


@pytest.mark.slow
# bf16 in the release tier (the bf16 parameter path at EP=2 is also test_bf16_ep2_vs_ep1's, fast)
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.release)])
def test_kill_and_resume_continues_same_losses(tmp_path, dtype):
    """EP=2 (expert shards get per-ep-rank checkpoint keys): an uninterrupted run, then a run
    that checkpoints every 4 steps and dies hard (os._exit) at step 10, then a resume from step 8.
    bf16 is the GPU recipes' parameter path (fp32 masters, persistent bf16 compute copies that the
    resume must refresh from the loaded masters). checkpoint.keep=1 leaves one checkpoint."""
    steps, base = 14, TINY + ["data.batch_size=4", "parallel.ep=2", f"train.dtype={dtype}"]
    ref, _ = run_pretrain(base + [f"train.steps={steps}"], tmp_path, "ref", nproc=2)
    ck = [f"checkpoint.dir='{tmp_path / 'ck'}'", "checkpoint.every=4", "checkpoint.keep=1"]
    _, out = run_pretrain(base + ck + [f"train.steps={steps}", "train.crash_at_step=10"], tmp_path, "crash",
                          nproc=2, expect_rc=1)
    assert (tmp_path / "ck" / "latest").read_text() == "8"
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_8"]  # keep=1 pruned step_4
    resumed, out = run_pretrain(base + ck + [f"train.steps={steps}"], tmp_path, "resume", nproc=2)
    assert "resumed from" in out and "step_8" in out
    assert len(resumed) == steps - 8
    assert resumed == ref[8:], f"resumed {resumed}\nreference {ref[8:]}"


def _finished_runs_exit_zero(runs: int) -> None:
    import subprocess

    from _train import ROOT, _env
    from conftest import note

    ov = TINY + ["train.steps=3", "data.batch_size=4", "parallel.ep=2"]
    failed = []
    for i in range(runs):
        note(f"run {i + 1} of {runs}, {len(failed)} failed so far")
        p = subprocess.run(pretrain_cmd(ov, None, nproc=2), cwd=ROOT, env=_env(1), capture_output=True,
                           text=True, timeout=300)
        text = p.stdout + p.stderr
        if p.returncode != 0 or "terminate called" in text or "SIGABRT" in text:
            failed.append((i, p.returncode, text[-1500:]))
        assert "step 3/3" in p.stdout, text[-3000:]
    assert not failed, f"{len(failed)} of {runs} finished runs did not exit cleanly; first:\n{failed[0]}"


@pytest.mark.slow
def test_finished_runs_exit_zero():
    """Two finished 2-process runs exit 0 (the fast tier's share of the soak below)."""
    _finished_runs_exit_zero(2)


@pytest.mark.release
def test_finished_runs_exit_zero_every_time():
    """Issue 16: a finished 2-process run used to abort at interpreter exit (SIGABRT from a gloo
    worker thread taking the GIL during finalization) in 6 of 31 runs. 24 runs of the 3-step job
    miss a 1-in-10 abort with probability 0.9**24 = 8% (0.6% at the measured ~1-in-5 rate); set
    TLX_DIST_EXIT_RUNS for a longer soak (scripts/stress_exit.sh does the same from the shell)."""
    import os

    _finished_runs_exit_zero(int(os.environ.get("TLX_DIST_EXIT_RUNS", "24")))


@pytest.mark.slow
def test_bf16_ep2_vs_ep1(tmp_path):
    """The GPU recipes' parameter path on CPU: bf16 compute with fp32 masters, at EP=2 (attention
    etc. FSDP2-sharded over 2 ranks, MoE layers outside FSDP with persistent bf16 compute copies)
    vs one rank (nothing FSDP-wrapped, every parameter with a compute copy).

    Tolerances: bf16 activations are rounded in a different order on 1 and 2 ranks (other GEMM
    blockings for batch 8 vs 4), so the runs drift apart by bf16 rounding. Measured over 20 steps:
    losses 2.2e-4 relative, grad norms 4.7e-4. Limits at ~8x those: losses 2e-3, grad norms 4e-3.
    The grad norm is the sharper check: Adam is nearly invariant to a gradient's scale, so a wrong
    reduction factor barely moves the loss -- skipping the expert gradients' division by ep moved
    the grad norm by 1.3e-2 (and the losses by < 2.2e-4) in the same setting."""
    import json
    common = TINY + ["train.steps=20", "train.dtype=bf16", "train.log_every=1", "metrics.tensorboard=false"]
    one, _ = run_pretrain(common + ["data.batch_size=8", f"metrics.out_dir='{tmp_path / 'one'}'"], tmp_path, "one")
    two, out = run_pretrain(common + ["data.batch_size=4", "parallel.ep=2", f"metrics.out_dir='{tmp_path / 'two'}'"],
                            tmp_path, "two", nproc=2)
    assert "dp=1 x ep=2" in out and "dtype=bf16" in out
    a, b = torch.tensor(two, dtype=torch.float64), torch.tensor(one, dtype=torch.float64)
    assert torch.allclose(a, b, rtol=2e-3, atol=0), (a, b)
    norms = [[json.loads(l)["grad_norm"] for l in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
             for d in ("two", "one")]
    a, b = torch.tensor(norms[0], dtype=torch.float64), torch.tensor(norms[1], dtype=torch.float64)
    assert len(a) == 20 and torch.allclose(a, b, rtol=4e-3, atol=0), ((a - b).abs() / b).max()
    assert one[-1] < one[0] - 0.5
