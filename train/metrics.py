"""FLOP accounting, MFU, and the metric sinks (console with progress, JSONL, TensorBoard).

FLOPs per token follow torchtitan (``get_nparams_and_flops`` for its MoE models):

    6 * (N_dense - N_embedding + N_experts * K / E) + 12 * L * H * Dh * S

N_dense counts every parameter that is not a routed expert (attention, norms, dense MLPs, router,
shared experts, output head); the input embedding is a lookup, not a matmul, so it is left out.
The attention term is fwd + bwd of QK^T and PV over the full (not causal-halved) S x S.
MFU = (tokens/s per GPU) * FLOPs per token / peak bf16 FLOP/s of the device. The peak is known
only for the devices in ``PEAK_BF16_TFLOPS``; anywhere else (CPU, unknown GPU, fp32 training) MFU
is reported as n/a -- never guessed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .config import Config, ModelConfig

__all__ = ["ParamCounts", "param_counts", "flops_per_token", "PEAK_BF16_TFLOPS", "peak_flops",
           "MetricLogger", "peak_memory_gib", "eta_seconds"]

# Dense bf16 tensor-core peak, TFLOP/s (vendor datasheets, no sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "MI300X": 1307.0}


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int
    experts: int          # all routed experts, all ranks
    active: int           # per token: total - experts + experts * K / E


def param_counts(m: ModelConfig) -> ParamCounts:
    """Analytic parameter counts of ``train.model.Transformer`` for ``m`` (global, unsharded)."""
    D, L, V, moe = m.dim, m.n_layers, m.vocab_size, m.moe
    n_moe = L - m.n_dense_layers
    attn = 4 * D * D + 2 * D                        # wqkv, wo, two RMSNorm weights
    dense_mlp = 3 * D * m.dense_inter_dim
    router_shared = moe.num_experts * D + 3 * D * moe.shared_dim
    experts = n_moe * moe.num_experts * 3 * D * moe.moe_inter_dim
    embedding = V * D
    total = embedding + L * attn + m.n_dense_layers * dense_mlp + n_moe * router_shared + experts + D + V * D
    active = total - experts + experts * moe.top_k // moe.num_experts
    return ParamCounts(total, embedding, experts, active)


def flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training (fwd + bwd) FLOPs per token, torchtitan convention (module docstring)."""
    pc = param_counts(m)
    return 6 * (pc.active - pc.embedding) + 12 * m.n_layers * m.n_heads * m.head_dim * seq_len


def peak_flops(device: torch.device, bf16: bool) -> Optional[float]:
    """Peak bf16 FLOP/s of ``device`` from ``PEAK_BF16_TFLOPS``, or None when unknown / not bf16."""
    if not bf16 or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    """("cuda_max_alloc", GiB) on GPU; ("rss", GiB, the process's peak resident set) on CPU."""
    if device.type == "cuda":
        return "cuda_max_alloc", torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return "rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def eta_seconds(step_time_s: float, step: int, total_steps: int) -> float:
    """Time left: the measured time per step of the last log interval times the steps left."""
    return step_time_s * max(total_steps - step, 0)


def _records_up_to(path: str, step: int) -> list[str]:
    """The JSONL lines of ``path`` whose ``step`` is at most ``step`` (none if there is no file)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    return [line for line in lines if json.loads(line).get("step", 0) <= step]


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricLogger:
    """Rank 0 writes; other ranks are silent. Console line per log step with a progress bar,
    ``metrics.jsonl`` (one JSON object per log step) and TensorBoard scalars under ``out_dir/tb``.

    ``resume_step``: the run continues from a checkpoint at that step, so the log is continued
    too -- after dropping the records of steps past it (the job that died had logged them; this
    run logs them again), so that every step appears once. TensorBoard purges them likewise.
    """

    def __init__(self, cfg: Config, rank: int, total_steps: int, resume_step: Optional[int] = None):
        self.active = rank == 0
        self.total = total_steps
        self.first_step = (resume_step or 0) + 1
        self.progress = cfg.metrics.progress
        self.jsonl = self.tb = None
        if not self.active or not cfg.metrics.out_dir:
            return
        os.makedirs(cfg.metrics.out_dir, exist_ok=True)
        path = os.path.join(cfg.metrics.out_dir, "metrics.jsonl")
        # A fresh run starts a new log (no mixed curves in plots); a resumed run continues its own.
        kept = _records_up_to(path, resume_step) if resume_step is not None else []
        self.jsonl = open(path, "w")
        for line in kept:
            self.jsonl.write(line + "\n")
        self.jsonl.flush()
        if cfg.metrics.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.print("tensorboard is not installed: TensorBoard logging skipped (pip install tensorboard)")
            else:
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(os.path.join(cfg.metrics.out_dir, "tb"), purge_step=purge)

    def print(self, *a) -> None:
        if self.active:
            print(*a, flush=True)

    def log(self, step: int, rec: dict) -> None:
        if not self.active:
            return
        done = step / self.total
        # The first step of a run also pays for start-up (compilation, allocator warm-up, kernel
        # autotuning): its time says nothing about the steps to come, so no ETA from it.
        eta = "?:??:??" if step == self.first_step else _fmt_time(eta_seconds(rec["step_time_s"], step, self.total))
        mfu = rec.get("mfu")
        line = (f"step {step:>{len(str(self.total))}}/{self.total}"
                + (f" [{'#' * int(20 * done):<20}] {100 * done:3.0f}% eta {eta}" if self.progress else "")
                + f" | loss {rec['loss']:.4f} aux {rec['aux_loss']:.2e} gnorm {rec['grad_norm']:.3f}"
                f" lr {rec['lr']:.2e} | {rec['tokens_per_s_per_gpu']:,.0f} tok/s/gpu"
                f" mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
                f" | mem {rec['peak_mem_gib']:.2f} GiB ({rec['peak_mem_kind']})"
                f" | load max/mean {rec['load_imbalance']:.2f}")
        print(line, flush=True)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **rec}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        sys.stdout.flush()
