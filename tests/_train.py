"""Helpers for the training-loop tests: run ``train.pretrain`` in subprocesses (one process, or
torchrun with gloo on loopback) and read back rank 0's per-step losses."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEBUG = str(ROOT / "configs" / "debug_cpu.toml")

# A smaller cut of the debug recipe so that multi-process tests stay a few seconds each on 2 cores.
# aux_loss_coef=0: the Switch aux loss is a product of per-rank means, so it differs between one
# rank with 2b sequences and two ranks with b each; everything else (CE, z-loss, aux-loss-free bias
# updated from counts summed over all ranks) is the same function of the global batch.
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.dense_inter_dim=128",
        "model.moe.moe_inter_dim=64", "model.moe.num_experts=4", "model.moe.aux_loss_coef=0",
        "data.seq_len=32", "train.warmup_steps=4", "train.log_every=5", "metrics.out_dir=''",
        "metrics.progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group():
    """A one-rank gloo group in this process (FSDP2 and DeviceMesh need a process group, even of one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def token_batches(n: int, B: int = 2, S: int = 16, seed: int = 0) -> list:
    """``n`` (inputs, targets) pairs of random byte tokens, ``[B, S]`` each."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 259, (B, S), generator=g), torch.randint(0, 259, (B, S), generator=g))
            for _ in range(n)]


def full_tensor(t, expert: bool, pd):
    """Inside a rank: the global value of a parameter, gradient or optimizer state ``t`` -- a DTensor
    gathered over its mesh, then, for an expert weight (``expert``), concatenated over the ep group
    in global expert order. A detached copy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        t = t.full_tensor()
    t = t.detach().clone()
    if expert and pd.ep > 1 and t.dim() > 0:
        parts = [torch.empty_like(t) for _ in range(pd.ep)]
        dist.all_gather(parts, t.contiguous(), group=pd.ep_group)
        t = torch.cat(parts)
    return t


GLOBAL_BATCH = 8   # sequences per optimizer step in the layout tests, whatever the layout


def _mesh_of(t):
    from torch.distributed.tensor import DTensor
    return t.device_mesh.mesh.tolist() if isinstance(t, DTensor) else None


def step_grads(overrides, world: int, accum: int, device: str, probe=None) -> dict:
    """Inside a rank of an initialised group: one step's gradients (``train.pretrain.accumulate_grads``
    over ``accum`` micro-batches of GLOBAL_BATCH / (world * accum) sequences, then ``finish_grads``)
    of the TINY debug model at ``overrides``, as global tensors on the CPU, with the meshes they live
    on (``DeviceMesh.mesh.tolist()``, None off FSDP2), the mean loss over all ranks, the loader's
    position and this rank's EP group. ``probe(model)``, if given, runs before every micro-batch but
    the first (inside ``accumulate_grads``, after the previous backward); its results are
    ``"probes"``."""
    import torch
    import torch.distributed as dist

    from train.config import load_config
    from train.data import ByteLoader
    from train.parallelize import build_mesh, build_model, clip_grad_norm_, expert_param_names, finish_grads
    from train.pretrain import accumulate_grads

    cfg = load_config(DEBUG, TINY + list(overrides) + ["train.dtype=fp32", f"train.grad_accum={accum}",
                                                       f"data.batch_size={GLOBAL_BATCH // (world * accum)}"])
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    pd = build_mesh(cfg, dev.type)
    model = build_model(cfg, pd, dev, bf16=False)
    loader = ByteLoader(cfg.data, pd.rank, pd.world, dev, grad_accum=accum)
    probes = []
    if probe is not None:
        next_batch = loader.next_batch

        def probed():
            if loader.samples_seen % GLOBAL_BATCH:   # not the step's first micro-batch
                probes.append(probe(model))
            return next_batch()
        loader.next_batch = probed
    ce, _, _ = accumulate_grads(model, pd, loader, accum)
    finish_grads(model, pd)
    norm = float(clip_grad_norm_(model, pd, 0.0))   # measure only
    experts = expert_param_names(model)
    grads = {n: full_tensor(p.grad, n in experts, pd).cpu() for n, p in model.named_parameters()}
    meshes = {n: _mesh_of(p.grad) for n, p in model.named_parameters()}
    ce = ce.clone()
    dist.all_reduce(ce)
    return dict(grads=grads, meshes=meshes, ce=float(ce) / world, norm=norm, samples=loader.samples_seen, probes=probes,
                ep_group=dist.get_process_group_ranks(pd.ep_group) if pd.ep > 1 else [dist.get_rank()])


def reference_grads(batch: int) -> dict:
    """``{"32": (grads, ce), "64": (grads, ce)}``: one process, no FSDP, the TINY debug model on the
    first ``batch`` sequences of the data, in float32 and in float64 (same initial weights); grads
    fp64 on the CPU."""
    import dataclasses

    from train.config import load_config
    from train.data import ByteLoader
    from train.model import Transformer

    cfg = load_config(DEBUG, TINY + [f"data.batch_size={batch}"])
    x, y = ByteLoader(cfg.data, 0, 1).next_batch()
    m32 = Transformer(cfg.model, seed=cfg.train.seed)
    m64_cfg = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, dtype="float64"))
    m64 = Transformer(m64_cfg, seed=cfg.train.seed).double()
    m64.load_state_dict(m32.state_dict())
    out = {}
    for name, m in (("32", m32), ("64", m64)):
        ce = m(x, y)
        (ce + m.aux_loss()).backward()
        out[name] = ({n: p.grad.double() for n, p in m.named_parameters()}, float(ce.detach()))
    return out


def sequence_grad_magnitudes() -> dict:
    """S per element of every parameter (tests/test_train_reduce_dtype.py): (1/GLOBAL_BATCH) * the sum
    over the GLOBAL_BATCH sequences of |gradient| of the fp64 single-process TINY model on that
    sequence alone; fp64 on the CPU."""
    import dataclasses

    import torch

    from train.config import load_config
    from train.data import ByteLoader
    from train.model import Transformer

    cfg = load_config(DEBUG, TINY + [f"data.batch_size={GLOBAL_BATCH}"])
    x, y = ByteLoader(cfg.data, 0, 1).next_batch()
    m32 = Transformer(cfg.model, seed=cfg.train.seed)
    m64 = Transformer(dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, dtype="float64")),
                      seed=cfg.train.seed).double()
    m64.load_state_dict(m32.state_dict())
    S = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in m64.named_parameters()}
    for j in range(GLOBAL_BATCH):
        m64.zero_grad(set_to_none=True)
        ce = m64(x[j:j + 1], y[j:j + 1])
        (ce + m64.aux_loss()).backward()
        for n, p in m64.named_parameters():
            S[n] += p.grad.abs() / GLOBAL_BATCH
    return S


def bf16_valued(t) -> bool:
    import torch
    return torch.equal(t, t.to(torch.bfloat16).to(t.dtype))


def assert_bf16_reduction_bound(got: dict, ref: dict, S: dict, n_terms: int, what: str) -> None:
    """bf16-reduced gradients ``got`` against the fp32-reduced ``ref`` of the same step: per element
    ``|got - ref| <= (n_terms + 4) * 2^-8 * S + 2^-20 * max|ref|`` (the bound is derived in
    tests/test_train_reduce_dtype.py), and some element must differ (bf16 really crossed the link)."""
    assert got.keys() == ref.keys() == S.keys(), what
    differ = False
    for n, g in got.items():
        err = (g.double() - ref[n].double()).abs()
        bound = (n_terms + 4) * 2.0 ** -8 * S[n] + 2.0 ** -20 * ref[n].abs().max().item()
        assert bool((err <= bound).all()), (f"{what} {n}: |bf16 - fp32| exceeds (N + 4) u S at "
                                            f"{int((err > bound).sum())} elements, worst ratio {(err / bound).max().item():.2f}")
        differ |= bool((err > 0).any())
    assert differ, f"{what}: bf16 reduction left every gradient bitwise equal to fp32's"


def assert_grads_match(res: dict, reference: dict, what: str) -> None:
    """``res`` (from ``step_grads``) against ``reference_grads``: per parameter
    ``max|ours - ref64| <= 2 * max|ref32 - ref64| + atol`` (STYLE 6; the reason is in
    tests/test_train_layouts.py's docstring), atol = 2^-20 of the tensor's largest gradient; and
    the global clipping norm against the fp64 one."""
    import pytest
    import torch
    (g32, _), (g64, ce64) = reference["32"], reference["64"]
    assert res["ce"] == pytest.approx(ce64, rel=1e-5), what
    # The clipping norm counts each element once, whatever holds replicas of it (HSDP replicate
    # dimensions, ep for the router): fp32 sums of ~1e5 squares stay well inside 1e-5 relative,
    # a shard counted twice is off by tens of percent.
    norm64 = torch.stack([g.square().sum() for g in g64.values()]).sum().sqrt().item()
    assert res["norm"] == pytest.approx(norm64, rel=1e-5), f"{what}: grad norm {res['norm']} vs {norm64}"
    assert res["grads"].keys() == g64.keys(), what
    for n, g in res["grads"].items():
        ref, err32 = g64[n], (g32[n] - g64[n]).abs().max().item()
        err = (g.double() - ref).abs().max().item()
        atol = 2.0 ** -20 * ref.abs().max().item()
        assert err <= 2 * err32 + atol, f"{what} {n}: max|ours-ref64|={err:.3e} > 2*{err32:.3e} + {atol:.1e}"


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONWARNINGS"] = "ignore"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def pretrain_cmd(overrides, losses_out, config=DEBUG, nproc=0, node=None) -> list[str]:
    """``node=(node_rank, nnodes, port)`` for a multi-node torchrun on 127.0.0.1."""
    if nproc:
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        if node is None:
            launch += ["--standalone"]
        else:
            rank, nnodes, port = node
            launch += [f"--nnodes={nnodes}", f"--node-rank={rank}", "--master-addr=127.0.0.1",
                       f"--master-port={port}"]
        launch += ["-m", "train.pretrain"]
    else:
        launch = [sys.executable, "-m", "train.pretrain"]
    cmd = launch + ["--config", config]
    for o in overrides:
        cmd += ["--override", o]
    if losses_out:
        cmd += ["--losses-out", str(losses_out)]
    return cmd


def run_pretrain(overrides, tmp_path: Path, name: str, nproc=0, config=DEBUG, expect_rc=0, timeout=300):
    """Runs one job to completion; returns (losses or None, stdout)."""
    out = tmp_path / f"{name}.json"
    threads = 1 if nproc else 2
    p = subprocess.run(pretrain_cmd(overrides, out, config, nproc), cwd=ROOT, env=_env(threads),
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != expect_rc:
        raise AssertionError(f"{name}: exit {p.returncode} (expected {expect_rc})\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return (json.loads(out.read_text()) if out.exists() else None), p.stdout


def popen_pretrain(cmd) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
