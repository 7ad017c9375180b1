"""Reference MoE pretraining loop.

    torchrun --nproc-per-node=N [--nnodes=M ...] -m train.pretrain --config configs/X.toml [--override k=v ...]
    python -m train.pretrain --config configs/debug_cpu.toml        # one process
    python -m train.pretrain --config auto                          # h200_1gpu on an H200, else debug_cpu

One step: ``train.grad_accum`` micro-batches of (next batch -> forward -> cross-entropy + MoE aux
losses -> backward; FSDP2 reduces the gradients in the last one) -> finish EP reductions -> clip by
the global norm -> AdamW -> LR schedule -> router bias update (aux-loss-free, counts summed over
every rank in the step's one all-reduce). At step 1 and every ``log_every`` steps rank 0 prints
loss, grad norm, aux loss, tokens/s per GPU, MFU (both over all micro-batches), peak memory and
expert load (max/mean tokens per expert).

Errors in the recipe, an override, a path or a resume request (:class:`train.config.UsageError`)
print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import socket
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # Ctrl-C while torch and the model code import: one line and status 130, not a traceback from
    # inside the import system (cli() puts Python's own handler back once the imports are done).
    signal.signal(signal.SIGINT, lambda *_: (print("interrupted", file=sys.stderr, flush=True), os._exit(130)))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import latest_step, load_checkpoint, save_checkpoint
from .config import Config, UsageError, load_config
from .data import ByteLoader
from .fault import failure_message, set_comm_timeouts
from .metrics import MetricLogger, flops_per_token, param_counts, peak_flops, peak_memory_gib
from .parallelize import (build_mesh, build_model, build_optimizer, check_exchange, clip_grad_norm_, finish_grads,
                          keep_accumulation_fp32, lr_lambda, set_gradient_sync, update_router_biases)
from .profiling import annotate_dispatchers, format_profile, step_profile

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


def _profiler(steps: int, rank: int, device: torch.device):
    """A torch.profiler over ``steps`` steps after 3 warm-up steps (``--profile N``), or None.
    Rank 0 prints the top ops by self time and the per-category step profile (train.profiling)."""
    if steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    gpu = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])

    def report(p):
        if rank == 0:
            key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
            print(p.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60), flush=True)
            print(format_profile(step_profile(p.events(), steps, device=gpu), gpu), flush=True)

    return profile(activities=acts, schedule=schedule(wait=0, warmup=3, active=steps, repeat=1), on_trace_ready=report)


def _resume(cfg: Config, step: int, model, optimizer, scheduler, loader, pd) -> int:
    path = f"{cfg.checkpoint.dir}/step_{step}"
    try:
        return load_checkpoint(cfg.checkpoint.dir, step, model, optimizer, scheduler, loader, pd)
    except (ValueError, OSError) as e:  # mismatches, missing files: what differs, not where DCP noticed
        raise UsageError(f"cannot resume from {path}: {e}") from None


def accumulate_grads(model, pd, loader, grad_accum: int):
    """Forward and backward of ``grad_accum`` micro-batches from ``loader``, each loss scaled by
    ``1 / grad_accum`` (the step's objective is the mean over all of them); cross-rank gradient
    reduction only in the last backward where the sharding allows (``set_gradient_sync``), the sums
    over micro-batches in fp32 whatever ``parallel.reduce_dtype`` (``keep_accumulation_fp32``).

    Returns ``(ce, aux, counts_LE)``: the micro-batches' mean cross-entropy and aux loss (fp32
    0-dim, detached, this rank's) and the tokens each MoE layer routed to each expert, summed over
    them (int64 ``[L, E]``, or None without MoE layers). No host sync."""
    moe_layers = model.moe_layers()
    ce_sum = aux_sum = counts_LE = None
    for i in range(grad_accum):
        if grad_accum > 1:
            set_gradient_sync(model, pd, i == grad_accum - 1)
        inputs, targets = loader.next_batch()
        ce = model(inputs, targets)
        aux = model.aux_loss()
        loss = ce + aux
        (loss if grad_accum == 1 else loss / grad_accum).backward()
        if i < grad_accum - 1:
            keep_accumulation_fp32(model)
        counts = torch.stack([m.last_stats.tokens_per_expert for m in moe_layers]) if moe_layers else None
        if i == 0:
            ce_sum, aux_sum, counts_LE = ce.detach(), aux.detach(), counts
        else:
            ce_sum, aux_sum = ce_sum + ce.detach(), aux_sum + aux.detach()
            counts_LE = counts_LE + counts if counts is not None else None
    if grad_accum > 1:
        ce_sum, aux_sum = ce_sum / grad_accum, aux_sum / grad_accum
    return ce_sum, aux_sum, counts_LE


def train(cfg: Config, device: torch.device, profile_steps: int = 0) -> list[float]:
    """Runs ``cfg`` to ``train.steps`` (resuming if a checkpoint exists); returns rank 0's
    per-step losses (cross-entropy averaged over all ranks) for the steps it ran."""
    pd = build_mesh(cfg, device.type)
    set_comm_timeouts(pd.groups(), cfg.train.comm_timeout_s)
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    ck, steps = cfg.checkpoint, cfg.train.steps
    resume_step = latest_step(ck.dir) if ck.dir and ck.resume else None
    log = MetricLogger(cfg, pd.rank, steps, resume_step=resume_step)
    model = build_model(cfg, pd, device, bf16)
    optimizer = build_optimizer(model, cfg, fused=(device.type == "cuda") or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    loader = ByteLoader(cfg.data, pd.rank, pd.world, device, grad_accum=cfg.train.grad_accum)

    start = 0
    if resume_step is not None:
        start = _resume(cfg, resume_step, model, optimizer, scheduler, loader, pd)
        log.print(f"resumed from {ck.dir}/step_{resume_step} (samples_seen={loader.samples_seen})")
        if start >= steps:
            log.print(f"the checkpoint is at step {start}, at or past train.steps={steps}: nothing to train "
                      f"(raise train.steps to continue, or set checkpoint.resume=false to start over)")
            log.close()
            return []
    if profile_steps and start + 3 + profile_steps > steps:
        raise UsageError(f"--profile {profile_steps} needs 3 warm-up + {profile_steps} steps after step {start}, "
                         f"but train.steps={steps}")

    pc = param_counts(cfg.model)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(device, bf16)
    log.print(f"world={pd.world} (dp={pd.dp} x ep={pd.ep}) nodes={pd.nodes} sharding={pd.sharding} "
              f"grad_accum={cfg.train.grad_accum} reduce_dtype={cfg.parallel.reduce_dtype} device={device.type} "
              f"dtype={'bf16' if bf16 else 'fp32'} "
              f"params total={pc.total / 1e6:.1f}M active={pc.active / 1e6:.1f}M flops/token={fpt / 1e9:.3f}G "
              f"peak={'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")
    log.print(f"compile={'on' if cfg.train.compile else 'off'} activation_checkpoint={cfg.train.activation_checkpoint} "
              f"optimizer={cfg.train.optimizer} ({type(optimizer).__name__})")
    moe_layers = model.moe_layers()
    moe_ids = model.moe_layer_ids()
    if moe_layers:  # which grouped-GEMM kernel the experts run (decided per call; same shapes each step)
        from tlx_dist.grouped_gemm import select_backend
        D, Fe, dt = cfg.model.dim, cfg.model.moe.moe_inter_dim, torch.bfloat16 if bf16 else torch.float32
        x = torch.empty(8, D, dtype=dt, device=device)
        log.print(f"grouped GEMM backend: {select_backend(x, x.new_empty(1, D, 2 * Fe), cfg.train.gemm_backend or None).name}"
                  f" | MoE exchange: {moe_layers[0].dispatcher.name}, pipeline={moe_layers[0].pipeline}")
    use_bias = cfg.model.moe.load_balance_bias and bool(moe_layers)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum  # per rank, all micro-batches
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    # Tokens per expert since the last log step: summed over ranks every step when the router
    # biases need them (use_bias), else summed locally and all-reduced at the log step.
    counts_LE = torch.zeros(len(moe_layers), cfg.model.moe.num_experts, dtype=torch.int64, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_last, steps_since = time.perf_counter(), 0

    prof = _profiler(profile_steps, pd.rank, device)
    annotate = contextlib.ExitStack()
    if prof is not None:
        annotate.enter_context(annotate_dispatchers(moe_layers))
        prof.start()
    model.train()
    for step in range(start + 1, steps + 1):
        ce, aux, step_counts_LE = accumulate_grads(model, pd, loader, cfg.train.grad_accum)
        finish_grads(model, pd)
        with torch.profiler.record_function("train.clip_grad_norm"):
            gnorm = clip_grad_norm_(model, pd, cfg.train.grad_clip, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        steps_since += 1

        # Every step's loss is kept (exact-resume checks, golden files). One small all-reduce per
        # step carries the losses and, with aux-loss-free balancing, every layer's expert counts.
        stats = torch.stack([ce, aux.to(ce.device)]).double()
        if use_bias:
            stats = torch.cat([stats, step_counts_LE.flatten().double()])
        if pd.world > 1:
            dist.all_reduce(stats, group=pd.world_group)
        if use_bias:
            step_counts_LE = stats[2:].view_as(step_counts_LE).round().long()  # exact: sums < 2^53
            with torch.profiler.record_function("train.router_bias"):
                update_router_biases(model, step_counts_LE)
        if moe_layers:
            counts_LE += step_counts_LE
        pending.append(stats[:2] / pd.world)

        if step % cfg.train.log_every == 0 or step == steps or step == 1:
            losses += torch.stack(pending)[:, 0].tolist()  # one host sync per log step
            check_exchange(model)  # symmetric exchange: overflow / timed-out waits raise here, never silent
            last_aux = float(pending[-1][1])
            pending.clear()
            if not use_bias and pd.world > 1:
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
                "tokens_per_expert": counts_LE.tolist(), "moe_layers": moe_ids, "step_time_s": dt / steps_since,
            })
            counts_LE.zero_()
            t_last, steps_since = time.perf_counter(), 0

        if prof is not None:
            prof.step()
            if step - start == 3 + profile_steps:
                prof.stop()
                annotate.close()
                prof = None
        if ck.every and step % ck.every == 0:
            save_checkpoint(ck.dir, step, model, optimizer, scheduler, loader, pd, keep=ck.keep)
        if cfg.train.crash_at_step and step == cfg.train.crash_at_step:
            log.print(f"crash_at_step={step}: exiting without cleanup (simulated failure)")
            sys.stdout.flush()
            os._exit(17)
    log.close()
    return losses


def plot_run(out_dir: str) -> int:
    """Writes the plots of ``out_dir/metrics.jsonl`` (``train.plot``); returns an exit status.
    A missing matplotlib is reported as such (status 0: plots are optional); any other failure
    is reported with its real cause (status 1)."""
    if not out_dir:
        print("--plot: metrics.out_dir is empty, so there is nothing to plot", flush=True)
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", flush=True)
        return 0
    from .plot import plot
    jsonl = Path(out_dir) / "metrics.jsonl"
    try:
        paths = plot(jsonl, Path(out_dir))
    except Exception as e:  # report the real cause, whatever it is, on one line
        print(f"error: plotting {jsonl} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print("plots: " + " ".join(str(p) for p in paths), flush=True)
    return 0


def _usage_error(e: Exception, rank: int = 0) -> int:
    if rank == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
    return 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m train.pretrain", description=__doc__.splitlines()[0],
        epilog="many processes: torchrun --nproc-per-node=N -m train.pretrain --config ... "
               "Errors in the recipe, an override, a path or a resume print one line and exit with status 2.")
    ap.add_argument("--config", required=True, help="recipe TOML, or 'auto'")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted key, e.g. train.steps=20 (repeatable)")
    ap.add_argument("--losses-out", default="", help="write rank 0's per-step losses as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N steps after 3 warm-up steps; rank 0 prints the top ops and a per-category "
                         "step profile (expert GEMMs, exchange, attention, other GEMMs, elementwise/casts, "
                         "optimizer, communication)")
    ap.add_argument("--plot", action="store_true",
                    help="after training, rank 0 writes loss / throughput / expert-load plots into metrics.out_dir")
    args = ap.parse_args(argv)
    if args.profile < 0:
        ap.error(f"--profile {args.profile} must be >= 0")
    try:
        cfg = load_config(resolve_config_path(args.config), args.override)
    except UsageError as e:
        return _usage_error(e)
    device = init_distributed(cfg.train.comm_timeout_s)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    rank, rc, interrupted = dist.get_rank(), 0, False
    try:
        losses = train(cfg, device, args.profile)
        if args.losses_out and rank == 0:
            import json
            Path(args.losses_out).write_text(json.dumps(losses))
    except UsageError as e:
        rc = _usage_error(e, rank)
    except Exception as err:  # one clear line (then the traceback) instead of a bare backend error
        print(failure_message(err, rank, cfg.train.comm_timeout_s), file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt:
        interrupted = True  # a collective may be half done: the process ends without tearing groups down
        raise
    finally:
        if not interrupted:
            shutdown_distributed()
    if rc == 0 and args.plot and rank == 0:
        rc = plot_run(cfg.metrics.out_dir)
    return rc


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(rc) -> None:
    """Ends the process with status ``rc`` without running interpreter finalization.

    Why (issue 16): the model's FSDP2 state keeps the process groups alive through hooks that
    autograd holds in C++, so their gloo worker threads outlive ``destroy_process_group``. A
    worker that is still destroying its last finished ``AsyncWork`` when ``Py_FinalizeEx``
    begins must take the GIL to release the work's tensors; a thread that takes the GIL during
    finalization is ended with ``pthread_exit``, which unwinds through a noexcept destructor:
    ``terminate called without an active exception`` and SIGABRT, after a run that finished
    every step (seen in 6 of 31 two-process gloo runs; core dump: ``ProcessGroupGloo::runLoop``
    -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``).
    Everything the run owns is flushed and closed before this (metrics, checkpoints, process
    groups), so skipping finalization loses nothing and removes the window.
    """
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


# Seconds the unwinding after a Ctrl-C may take before the process ends anyway.
INTERRUPT_GRACE_S = 10.0


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: the first unwinds main (``KeyboardInterrupt``) with a watchdog armed -- a shutdown that
    does not finish within :data:`INTERRUPT_GRACE_S` (a collective left half done, say) still ends
    with the one line and status 130 -- and a second ends the process at once."""
    if getattr(_on_sigint, "armed", False):
        _interrupted_exit()
    _on_sigint.armed = True
    import threading
    threading.Timer(INTERRUPT_GRACE_S, _interrupted_exit).start()
    raise KeyboardInterrupt


def _interrupted_exit() -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def cli() -> None:
    """``python -m train.pretrain``: exit 0 after a finished run, the SystemExit status for
    argument errors, 130 on Ctrl-C, 1 with the traceback printed for any other failure.
    ``kill -USR1 <pid>`` prints every thread's Python stack to stderr (a run that seems stuck)."""
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGINT, _on_sigint)  # Ctrl-C now unwinds main's finally blocks
    try:
        rc = main()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
    except BaseException:
        import traceback
        traceback.print_exc()
        rc = 1
    exit_process(rc)


if __name__ == "__main__":
    cli()
