"""Reference MoE pretraining loop.

    torchrun --nproc-per-node=N [--nnodes=M ...] -m train.pretrain --config configs/X.toml [--override k=v ...]
    python -m train.pretrain --config configs/debug_cpu.toml        # one process
    python -m train.pretrain --config auto                          # h200_1gpu on an H200, else debug_cpu

One step: next batch -> forward -> cross-entropy + MoE aux losses -> backward (FSDP2 reduce-
scatters) -> finish EP reductions -> clip by the global norm -> AdamW -> LR schedule -> router bias
update (aux-loss-free, counts summed over every rank). Every ``log_every`` steps rank 0 prints loss,
grad norm, aux loss, tokens/s per GPU, MFU, peak memory and expert load (max/mean tokens per expert).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import latest_step, load_checkpoint, save_checkpoint
from .config import Config, load_config
from .data import ByteLoader
from .fault import failure_message, set_comm_timeouts
from .metrics import MetricLogger, flops_per_token, param_counts, peak_flops, peak_memory_gib
from .parallelize import build_mesh, build_model, build_optimizer, clip_grad_norm_, finish_grads, lr_lambda

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def resolve_config_path(name: str) -> Path:
    if name != "auto":
        return Path(name)
    gpu = torch.cuda.is_available() and "H200" in torch.cuda.get_device_name(0)
    return CONFIGS / ("h200_1gpu.toml" if gpu else "debug_cpu.toml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """gloo on CPU, NCCL on GPU. Without torchrun, a one-rank group (FSDP2 needs one).
    Collectives fail after ``timeout_s`` (train.comm_timeout_s; train/fault.py)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def _profiler(steps: int, rank: int):
    """A torch.profiler over ``steps`` steps after 3 warm-up steps (``--profile N``), or a no-op."""
    if steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def report(p):
        if rank == 0:
            key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            print(p.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60), flush=True)

    return profile(activities=acts, schedule=schedule(wait=0, warmup=3, active=steps, repeat=1), on_trace_ready=report)


def train(cfg: Config, device: torch.device, profile_steps: int = 0) -> list[float]:
    """Runs ``cfg`` to ``train.steps`` (resuming if a checkpoint exists); returns rank 0's
    per-step losses (cross-entropy averaged over all ranks) for the steps it ran."""
    pd = build_mesh(cfg, device.type)
    set_comm_timeouts([pd.mesh["dp"].get_group(), pd.mesh["ep"].get_group(), pd.world_group], cfg.train.comm_timeout_s)
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    ck = cfg.checkpoint
    resume_step = latest_step(ck.dir) if ck.dir and ck.resume else None
    log = MetricLogger(cfg, pd.rank, cfg.train.steps, append=resume_step is not None)
    model = build_model(cfg, pd, device, bf16)
    optimizer = build_optimizer(model, cfg, fused=(device.type == "cuda") or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    loader = ByteLoader(cfg.data, pd.rank, pd.world, device)

    start = 0
    if resume_step is not None:
        start = load_checkpoint(ck.dir, resume_step, model, optimizer, scheduler, loader, pd)
        log.print(f"resumed from {ck.dir}/step_{resume_step} (samples_seen={loader.samples_seen})")

    pc = param_counts(cfg.model)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(device, bf16)
    log.print(f"world={pd.world} (dp={pd.dp} x ep={pd.ep}) device={device.type} dtype={'bf16' if bf16 else 'fp32'} "
              f"params total={pc.total / 1e6:.1f}M active={pc.active / 1e6:.1f}M flops/token={fpt / 1e9:.3f}G "
              f"peak={'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")
    moe_layers = model.moe_layers()
    if moe_layers:  # which grouped-GEMM kernel the experts run (decided per call; same shapes each step)
        from tlx_dist.grouped_gemm import select_backend
        D, Fe, dt = cfg.model.dim, cfg.model.moe.moe_inter_dim, torch.bfloat16 if bf16 else torch.float32
        x = torch.empty(8, D, dtype=dt, device=device)
        log.print(f"grouped GEMM backend: {select_backend(x, x.new_empty(1, D, 2 * Fe), cfg.train.gemm_backend or None).name}")
    use_bias = cfg.model.moe.load_balance_bias
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len  # per rank
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    counts_LE = torch.zeros(len(moe_layers), cfg.model.moe.num_experts, dtype=torch.int64, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_last, steps_since = time.perf_counter(), 0

    prof = _profiler(profile_steps, pd.rank)
    if prof is not None:
        prof.start()
    model.train()
    for step in range(start + 1, cfg.train.steps + 1):
        inputs, targets = loader.next_batch()
        logits = model(inputs)
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        aux = model.aux_loss()
        (ce + aux).backward()
        finish_grads(model, pd)
        gnorm = clip_grad_norm_(model, pd, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        for i, m in enumerate(moe_layers):
            counts_LE[i] += m.last_stats.tokens_per_expert
        if use_bias:
            for m in moe_layers:
                m.update_bias(pd.world_group)
        steps_since += 1

        # Every step's loss is kept (exact-resume checks, golden files); one tiny all-reduce.
        stats = torch.stack([ce.detach().float(), aux.detach().float().to(ce.device)])
        dist.all_reduce(stats, group=pd.world_group)
        stats /= pd.world
        pending.append(stats)

        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            losses += torch.stack(pending)[:, 0].tolist()  # one host sync per log step
            last_aux = float(pending[-1][1])
            pending.clear()
            dist.all_reduce(counts_LE, group=pd.world_group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t_last
            tps = tokens_per_step * steps_since / dt
            c = counts_LE.float()
            imb = (c.max(dim=1).values / c.mean(dim=1).clamp_min(1e-9)).mean().item() if len(moe_layers) else 1.0
            kind, mem = peak_memory_gib(device)
            log.log(step, {
                "loss": losses[-1], "aux_loss": last_aux, "grad_norm": float(gnorm),
                "lr": scheduler.get_last_lr()[0], "tokens_per_s_per_gpu": tps,
                "mfu": None if peak is None else tps * fpt / peak,
                "peak_mem_gib": mem, "peak_mem_kind": kind, "load_imbalance": imb,
                "tokens_per_expert": counts_LE.tolist(), "step_time_s": dt / steps_since,
            })
            counts_LE.zero_()
            t_last, steps_since = time.perf_counter(), 0

        if prof is not None:
            prof.step()
            if step - start == 3 + profile_steps:
                prof.stop()
                prof = None
        if ck.every and step % ck.every == 0:
            save_checkpoint(ck.dir, step, model, optimizer, scheduler, loader, pd)
        if cfg.train.crash_at_step and step == cfg.train.crash_at_step:
            log.print(f"crash_at_step={step}: exiting without cleanup (simulated failure)")
            sys.stdout.flush()
            os._exit(17)
    log.close()
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="recipe TOML, or 'auto'")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted key, e.g. train.steps=20 (repeatable)")
    ap.add_argument("--losses-out", default="", help="write rank 0's per-step losses as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N steps after 3 warm-up steps; rank 0 prints the top kernels by self time")
    args = ap.parse_args(argv)
    cfg = load_config(resolve_config_path(args.config), args.override)
    device = init_distributed(cfg.train.comm_timeout_s)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    try:
        losses = train(cfg, device, args.profile)
        if args.losses_out and dist.get_rank() == 0:
            import json
            Path(args.losses_out).write_text(json.dumps(losses))
    except Exception as err:  # one clear line (then the traceback) instead of a bare backend error
        print(failure_message(err, dist.get_rank(), cfg.train.comm_timeout_s), file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown: a gloo worker thread may still be releasing the tensors of the last
    # collective, and Python kills threads that want the GIL during finalization, which aborts the
    # process ("terminate called without an active exception", seen ~1 run in 8 on a loaded CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
