"""Weak-scaling benchmark of the MoE layer and of a full training step, with per-phase times, and
the calibrated projection to many nodes (issue 11).

Measure (under torchrun, any number of ranks and nodes; one process = one rank):

    torchrun --nproc-per-node=N [--nnodes=M --node-rank=i --master-addr=H --master-port=P] \
        bench/scaling.py --config configs/h200_1gpu.toml [--override parallel.ep=N] [--mode step|layer|both]
        [--paths fast,reference] [--steps 5 --rounds 3 --warmup 3] [--json out.json]
    python bench/scaling.py --config configs/debug_cpu.toml          # one rank, CPU or GPU

Tokens per GPU are fixed by the recipe (``data.batch_size * data.seq_len``; ``--tokens`` for the
layer), so running the same command at N = 1, 2, 8, ... GPUs is a weak-scaling series. Two paths run
side by side in one process, alternating round by round on the same model:
  fast       EP=1: the one-rank path (LocalDispatcher; the fused TLX pipeline where it runs);
             EP>1 on CUDA inside one node: SymmDispatcher (``--symm-capacity``; default "exact").
             Elsewhere (CPU, an EP group spanning nodes) it is skipped, unless ``--paths symm``.
  fused_ep   SymmDispatcher + MoELayer(pipeline="fused"): the fused pipeline over the exchange's row
             form (CUDA, one node); its dispatch/combine phases are dispatch_rows / combine_rows.
  reference  AllToAllDispatcher: ``all_to_all_single`` over the EP group (NCCL on GPU, gloo on CPU),
             separate expert ops -- also at EP=1 (a one-rank group).
Per path it reports the step time of plain steps (no per-step sync, as the training loop runs),
tokens/s/GPU and MFU (``train.metrics``), and a per-phase split of instrumented steps (one sync per
step): CUDA events on GPU, wall clock on CPU (where every op is synchronous), recorded in stream
order at phase boundaries. Backward boundaries are identity autograd functions placed on the
phases' inputs and outputs, so the backward of a phase is the interval between the gradient
reaching its output and leaving its input. Each interval is attributed to the innermost open phase:

    attention.{fwd,bwd}   a block minus its FFN: norms, QKV/out projections, RoPE, SDPA, residuals
    route.*               the router (logits, top-k, gates, aux losses)
    dispatch.* combine.*  the dispatcher's dispatch / combine_weighted (exchange, permutations)
    experts.*             the rest of the MoE layer: expert GEMMs, SwiGLU, shared experts (the
                          whole fused pipeline when it runs)
    dense_ffn.*           dense SwiGLU layers
    fwd, bwd              the rest of forward / backward: embedding, head, loss, FSDP2 all-gather
                          waits, the exposed tail of FSDP2's reduce-scatters
    grad_reduce           finish_grads (EP all-reduce of router/shared gradients) + global-norm clip
    optimizer             AdamW step, zero_grad, LR schedule, router-bias update
The phases of a step sum to its instrumented time exactly (a partition of the timeline). Work the
autograd engine interleaves between two markers counts toward the interval it falls in.

Project (no GPU, no torch.distributed; the model is ``bench/scaling_model.py`` with the exchange
traffic of ``bench/scaling_traffic.py`` and the parameter layouts of ``bench/scaling_layouts.py``,
the report ``bench/scaling_report.py``, its checks ``bench/scaling_checks.py``):

    python bench/scaling.py --project [--plot out.png] [--measured run.json ...] [--json proj.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):   # this checkout's train/ and tlx_dist/, and scaling_model
    if p not in sys.path:
        sys.path.insert(0, p)

import _results  # noqa: E402
import torch  # noqa: E402


# ------------------------------------------------------------------------------------------ timing

class Clock:
    """Phase marks of one step in stream order: ``mark("+", name)`` opens a phase, ``mark("-",
    name)`` closes it. On CUDA each mark records an event on the current stream; on CPU it reads
    ``time.perf_counter``. Disabled clocks record nothing."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.marks: list = []

    def mark(self, op: str, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        self.marks.append((op, name, ev))

    def start(self) -> None:
        self.marks, self.enabled = [], True

    def stop(self) -> dict:
        """Closes the step (synchronizes on CUDA) and returns ms per phase label."""
        self.enabled = False
        if self.cuda:
            torch.cuda.synchronize()
            stamps = [0.0]
            for a, b in zip(self.marks, self.marks[1:]):
                stamps.append(stamps[-1] + a[2].elapsed_time(b[2]))
        else:
            stamps = [(m[2] - self.marks[0][2]) * 1e3 for m in self.marks]
        return attribute([(op, name) for op, name, _ in self.marks], stamps)


def attribute(marks: list, stamps_ms: list) -> dict:
    """ms per label for a mark sequence: the interval after mark i belongs to the innermost open
    phase (``"<inner>.<outer>"`` inside a top-level phase, ``"<outer>"`` for its own time, ``"other"``
    outside any). A closing mark removes the innermost open phase of that name (robust to the
    interleaving the autograd engine may produce); a closing mark of a phase not open is ignored."""
    if len(marks) != len(stamps_ms):
        raise ValueError(f"{len(marks)} marks but {len(stamps_ms)} time stamps")
    out: dict = {}
    stack: list = []
    for i, (op, name) in enumerate(marks):
        if op == "+":
            stack.append(name)
        elif op == "-":
            for j in range(len(stack) - 1, -1, -1):
                if stack[j] == name:
                    del stack[j]
                    break
        else:
            raise ValueError(f"mark op {op!r} must be '+' or '-'")
        if i + 1 < len(marks):
            label = "other" if not stack else stack[0] if len(stack) == 1 else f"{stack[-1]}.{stack[0]}"
            out[label] = out.get(label, 0.0) + (stamps_ms[i + 1] - stamps_ms[i])
    return out


class _Mark(torch.autograd.Function):
    """Identity whose backward records ``(op, name)`` on ``clock`` when the gradient passes."""

    @staticmethod
    def forward(ctx, x, clock, op, name):
        ctx.clock, ctx.op, ctx.name = clock, op, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.clock.mark(ctx.op, ctx.name)
        return g, None, None, None


def _bwd_mark(clock: Clock, x, op: str, name: str):
    if clock.enabled and isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        return _Mark.apply(x, clock, op, name)
    return x


def instrument_module(mod: torch.nn.Module, clock: Clock, name: str) -> list:
    """Forward hooks that open/close phase ``name`` around ``mod`` and put backward marks on its
    first tensor input and its tensor output (a RouterOutput's gates)."""
    def pre(_m, args):
        clock.mark("+", name)
        if args and isinstance(args[0], torch.Tensor):
            return (_bwd_mark(clock, args[0], "-", name),) + tuple(args[1:])
        return None

    def post(_m, _args, out):
        clock.mark("-", name)
        if isinstance(out, torch.Tensor):
            return _bwd_mark(clock, out, "+", name)
        if dataclasses.is_dataclass(out) and hasattr(out, "gate_TK"):
            return dataclasses.replace(out, gate_TK=_bwd_mark(clock, out.gate_TK, "+", name))
        return None

    return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]


def instrument_dispatcher(disp, clock: Clock) -> None:
    """Wraps this dispatcher instance's ``dispatch`` and ``combine_weighted`` (what MoELayer calls)."""
    dispatch, combine = type(disp).dispatch.__get__(disp), type(disp).combine_weighted.__get__(disp)

    def timed_dispatch(x_TD, idx_TK, gate_TK=None):
        clock.mark("+", "dispatch")
        recv, handle = dispatch(_bwd_mark(clock, x_TD, "-", "dispatch"), idx_TK, gate_TK)
        clock.mark("-", "dispatch")
        return _bwd_mark(clock, recv, "+", "dispatch"), handle

    def timed_combine(y_ND, handle, gate_TK):
        clock.mark("+", "combine")
        out = combine(_bwd_mark(clock, y_ND, "-", "combine"), handle, gate_TK)
        clock.mark("-", "combine")
        return _bwd_mark(clock, out, "+", "combine")

    disp.dispatch, disp.combine_weighted = timed_dispatch, timed_combine
    if hasattr(disp, "dispatch_rows"):  # the fused EP pipeline's exchange
        dispatch_rows = type(disp).dispatch_rows.__get__(disp)
        combine_rows = type(disp).combine_rows.__get__(disp)

        def timed_dispatch_rows(x_TD, idx_TK, gate_TK):
            clock.mark("+", "dispatch")
            recv, src, gate_N, handle = dispatch_rows(_bwd_mark(clock, x_TD, "-", "dispatch"), idx_TK, gate_TK)
            clock.mark("-", "dispatch")
            return _bwd_mark(clock, recv, "+", "dispatch"), src, gate_N, handle

        def timed_combine_rows(part_RD, handle):
            clock.mark("+", "combine")
            out = combine_rows(_bwd_mark(clock, part_RD, "-", "combine"), handle)
            clock.mark("-", "combine")
            return _bwd_mark(clock, out, "+", "combine")

        disp.dispatch_rows, disp.combine_rows = timed_dispatch_rows, timed_combine_rows


def watch_fused(moe_layers, seen: set) -> None:
    """Records in ``seen`` whether each MoE forward took the fused pipeline (asked inside the
    forward, where the parameters are in their compute dtype)."""
    def pre(mod, args):
        x = args[0]
        seen.add(bool(mod._fused(x.reshape(-1, x.shape[-1]))))
    for m in moe_layers:
        m.register_forward_pre_hook(pre)


def instrument_model(model, clock: Clock) -> None:
    from tlx_dist import MoELayer
    for mod in model.modules():
        cls = type(mod).__mro__
        names = {c.__name__ for c in cls}
        if "Block" in names:
            instrument_module(mod, clock, "attention")
        elif "DenseMLP" in names:
            instrument_module(mod, clock, "dense_ffn")
        elif isinstance(mod, MoELayer):
            instrument_module(mod, clock, "experts")
            instrument_module(mod.router, clock, "route")


# ------------------------------------------------------------------------------------------ paths

def fast_path_available(ep: int, device: torch.device, ep_single_node: bool) -> tuple[bool, str]:
    if ep == 1:
        return True, "local"
    if device.type == "cuda" and ep_single_node:
        return True, "symm"
    return False, ("symm needs CUDA" if device.type != "cuda" else "the EP group spans nodes (symm runs inside a node here)")


def build_path(moe_layers, kind: str, group, symm_capacity) -> dict:
    """One dispatcher per MoE layer for path ``kind`` ("local", "symm" or "reference") and the
    pipeline it runs with; ``use_path`` points the layers at them."""
    from tlx_dist.comm import AllToAllDispatcher, LocalDispatcher
    from tlx_dist.comm.symm import SymmDispatcher
    E = moe_layers[0].cfg.num_experts
    if kind == "reference":
        make, pipeline = (lambda: AllToAllDispatcher(E, group, validate=False)), "separate"
    elif kind == "local":
        make, pipeline = (lambda: LocalDispatcher(E, validate=False)), "auto"
    elif kind == "symm":
        make, pipeline = (lambda: SymmDispatcher(E, group, capacity=symm_capacity, validate=False)), "separate"
    elif kind == "fused_ep":  # the fused pipeline over the exchange's row form
        make, pipeline = (lambda: SymmDispatcher(E, group, capacity=symm_capacity, validate=False)), "fused"
    else:
        raise ValueError(f"path kind={kind!r} must be 'local', 'symm', 'fused_ep' or 'reference'")
    disps = [make() for _ in moe_layers]
    return {"dispatchers": disps, "pipeline": pipeline, "dispatcher": type(disps[0]).__name__}


def use_path(moe_layers, built: dict) -> None:
    for m, d in zip(moe_layers, built["dispatchers"]):
        m.dispatcher, m.pipeline = d, built["pipeline"]


# ------------------------------------------------------------------------------------------ runners

class StepRunner:
    """One training step of ``train/``'s model, built through its public functions: forward, loss,
    backward, finish_grads, clip_grad_norm_, AdamW, LR schedule, router-bias update (the body of
    ``train.pretrain.train``'s loop, without logging)."""

    def __init__(self, cfg, device, clock: Clock):
        import torch.distributed as dist

        from train import parallelize as par
        from train.data import ByteLoader
        from train.metrics import flops_per_token, peak_flops
        self.par, self.dist = par, dist
        self.cfg, self.device, self.clock = cfg, device, clock
        self.bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
        self.pd = par.build_mesh(cfg, device.type)
        self.model = par.build_model(cfg, self.pd, device, self.bf16)
        self.optimizer = par.build_optimizer(self.model, cfg, fused=(device.type == "cuda") or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, par.lr_lambda(cfg))
        self.loader = ByteLoader(cfg.data, self.pd.rank, self.pd.world, device)
        self.moe_layers = self.model.moe_layers()
        self.tokens = cfg.data.batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = peak_flops(device, self.bf16)
        fwd = inspect.signature(type(self.model).forward).parameters
        self.loss_in_model = len(fwd) > 2                  # forward(tokens, targets) -> loss (newer train/)
        self.clip_takes_opt = "optimizer" in inspect.signature(par.clip_grad_norm_).parameters
        self.group_update = getattr(par, "update_router_biases", None)
        instrument_model(self.model, clock)
        self.fused_seen: set = set()
        watch_fused(self.moe_layers, self.fused_seen)
        self.model.train()

    @property
    def ep_group(self):
        return self.pd.ep_group

    def step(self) -> None:
        import torch.nn.functional as F
        c, par = self.clock, self.par
        inputs, targets = self.loader.next_batch()
        c.mark("+", "fwd")
        if self.loss_in_model:
            ce = self.model(inputs, targets)
        else:
            logits = self.model(inputs)
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        loss = ce + self.model.aux_loss()
        c.mark("-", "fwd")
        c.mark("+", "bwd")
        loss.backward()
        c.mark("-", "bwd")
        c.mark("+", "grad_reduce")
        par.finish_grads(self.model, self.pd)
        if self.clip_takes_opt:
            par.clip_grad_norm_(self.model, self.pd, self.cfg.train.grad_clip, self.optimizer)
        else:
            par.clip_grad_norm_(self.model, self.pd, self.cfg.train.grad_clip)
        c.mark("-", "grad_reduce")
        c.mark("+", "optimizer")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.cfg.model.moe.load_balance_bias and self.moe_layers:
            if self.group_update is not None:
                counts = torch.stack([m.last_stats.tokens_per_expert for m in self.moe_layers])
                if self.pd.world > 1:
                    self.dist.all_reduce(counts, group=self.pd.world_group)
                self.group_update(self.model, counts)
            else:
                for m in self.moe_layers:
                    m.update_bias(self.pd.world_group)
        c.mark("-", "optimizer")


class LayerRunner:
    """One MoELayer forward + backward on ``T`` random tokens per rank, EP over all ranks."""

    def __init__(self, cfg, device, clock: Clock, tokens: int):
        import torch.distributed as dist

        from tlx_dist import MoELayer
        world = dist.get_world_size()
        moe = dataclasses.replace(cfg.model.moe, dtype="bfloat16" if device.type == "cuda" else "float32")
        group = dist.group.WORLD
        self.group = group
        self.layer = MoELayer(moe, ep_group=group if world > 1 else None, device=device,
                              gemm_backend=cfg.train.gemm_backend or None)
        self.moe_layers = [self.layer]
        self.clock, self.tokens = clock, tokens
        gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
        self.x = torch.randn(tokens, moe.dim, device=device, dtype=moe.torch_dtype, generator=gen).requires_grad_(True)
        self.dy = torch.randn(tokens, moe.dim, device=device, dtype=moe.torch_dtype, generator=gen)
        D, Fe, K = moe.dim, moe.moe_inter_dim, moe.top_k
        self.flops_per_token = 18 * K * D * Fe + 6 * D * moe.num_experts + 18 * D * moe.shared_dim
        self.peak = None
        if device.type == "cuda":
            from train.metrics import peak_flops
            self.peak = peak_flops(device, True)
        instrument_module(self.layer, clock, "experts")
        instrument_module(self.layer.router, clock, "route")
        self.fused_seen: set = set()
        watch_fused(self.moe_layers, self.fused_seen)

    @property
    def ep_group(self):
        return self.group

    def step(self) -> None:
        c = self.clock
        for p in self.layer.parameters():
            p.grad = None
        self.x.grad = None
        c.mark("+", "fwd")
        out = self.layer(self.x)
        loss = (out.float() * self.dy.float()).sum() + self.layer.aux_loss
        c.mark("-", "fwd")
        c.mark("+", "bwd")
        loss.backward()
        c.mark("-", "bwd")


def measure(runner, paths: dict, args, device) -> dict:
    """Runs every path: warm-up, then ``rounds`` x (plain steps, instrumented steps), paths
    alternating round by round. Returns per-path results (rank-0 phases, max step over ranks)."""
    import torch.distributed as dist
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain = {p: [] for p in paths}
    phases = {p: [] for p in paths}
    built = {}
    for p, info in paths.items():
        built[p] = build_path(runner.moe_layers, info["kind"], runner.ep_group, args.symm_capacity)
        for d in built[p]["dispatchers"]:
            instrument_dispatcher(d, runner.clock)
        use_path(runner.moe_layers, built[p])
        for _ in range(args.warmup):
            runner.step()
        if args.warmup:   # one instrumented step too: its backward marks may change compiled graphs' inputs
            runner.clock.start()
            runner.step()
            runner.clock.stop()
    fused = {p: set() for p in paths}
    for _ in range(args.rounds):
        for p in paths:
            use_path(runner.moe_layers, built[p])
            runner.fused_seen.clear()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner.step()
            sync()
            plain[p].append((time.perf_counter() - t0) * 1e3 / args.steps)
            for _ in range(args.steps):
                runner.clock.start()
                runner.step()
                phases[p].append(runner.clock.stop())
            fused[p] |= runner.fused_seen
    out = {}
    world = dist.get_world_size()
    for p in paths:
        step_ms = statistics.median(plain[p])
        labels = sorted({k for d in phases[p] for k in d})
        med = {k: statistics.median(d.get(k, 0.0) for d in phases[p]) for k in labels}
        inst = statistics.median(sum(d.values()) for d in phases[p])
        gathered = [None] * world
        dist.all_gather_object(gathered, {"step_ms": step_ms, "phases_ms": med})
        slowest = max(g["step_ms"] for g in gathered)
        tps = runner.tokens / (slowest / 1e3)
        out[p] = {"path": p, "dispatcher": built[p]["dispatcher"], "pipeline": built[p]["pipeline"],
                  "fused_pipeline": True in fused[p],
                  "step_ms": slowest, "step_ms_rank0": step_ms, "step_ms_per_rank": [g["step_ms"] for g in gathered],
                  "rounds_ms": plain[p], "tokens_per_s_per_gpu": tps,
                  "mfu": None if runner.peak is None else tps * runner.flops_per_token / runner.peak,
                  "instrumented_step_ms": inst, "phases_ms": med, "phases_ms_steps": phases[p],
                  "phases_ms_max_rank": {k: max(g["phases_ms"].get(k, 0.0) for g in gathered) for k in labels}}
    return out


def _paths(args, ep: int, device, single_node: bool) -> tuple[dict, dict]:
    want = args.paths.split(",")
    paths, skipped = {}, {}
    for p in want:
        if p == "reference":
            paths[p] = {"kind": "reference"}
        elif p == "fast":
            ok, kind = fast_path_available(ep, device, single_node)
            if ok:
                paths[p] = {"kind": kind}
            else:
                skipped[p] = kind
        elif p == "symm":
            paths[p] = {"kind": "symm"}
        elif p == "fused_ep":
            if device.type == "cuda" and single_node:
                paths[p] = {"kind": "fused_ep"}
            else:
                skipped[p] = "the fused EP pipeline needs CUDA GPUs of one node (the symmetric exchange)"
    return paths, skipped


def print_result(name: str, res: dict, rank: int) -> None:
    if rank:
        return
    for p, r in res.items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"[{name}] {p:9s} ({r['dispatcher']}, {r['pipeline']}): step {r['step_ms']:.2f} ms "
              f"| {r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu | mfu {mfu} | instrumented {r['instrumented_step_ms']:.2f} ms",
              flush=True)
        tot = sum(r["phases_ms"].values()) or 1.0
        cells = "  ".join(f"{k} {v:.2f} ({100 * v / tot:.0f}%)" for k, v in sorted(r["phases_ms"].items(), key=lambda kv: -kv[1]))
        print(f"    phases ms: {cells}", flush=True)


def run_benchmark(args) -> int:
    import torch.distributed as dist

    from train.config import load_config
    from train.pretrain import init_distributed
    cfg = load_config(args.config, args.override)
    device = init_distributed()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        rec = _results.Recorder("scaling", args, enabled=rank == 0, world=world)
        lws = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nnodes = max(1, world // lws)
        if device.type == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        clock = Clock(device)
        meta = {"world": world, "nnodes": nnodes, "local_world_size": lws, "device": device.type,
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "config": str(args.config), "overrides": args.override,
                "timer": "cuda_events" if device.type == "cuda" else "wall_clock",
                "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                "symm_capacity": args.symm_capacity}
        result = {"meta": meta}
        if args.mode in ("step", "both"):
            ep = cfg.parallel.ep
            single = ep <= lws and lws % ep == 0
            paths, skipped = _paths(args, ep, device, single)
            runner = StepRunner(cfg, device, clock)
            res = measure(runner, paths, args, device)
            result["step"] = {"ep": ep, "dp": runner.pd.dp, "tokens_per_gpu": runner.tokens,
                              "flops_per_token": runner.flops_per_token, "skipped": skipped, "paths": res}
            print_result("step", res, rank)
            if rank == 0 and skipped:
                print(f"[step] skipped: {skipped}", flush=True)
            del runner
            import gc
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.mode in ("layer", "both"):
            T = args.tokens or cfg.data.batch_size * cfg.data.seq_len
            paths, skipped = _paths(args, world, device, nnodes == 1)
            runner = LayerRunner(cfg, device, clock, T)
            res = measure(runner, paths, args, device)
            result["layer"] = {"ep": world, "tokens_per_gpu": T, "flops_per_token": runner.flops_per_token,
                               "skipped": skipped, "paths": res}
            print_result("layer", res, rank)
            if rank == 0 and skipped:
                print(f"[layer] skipped: {skipped}", flush=True)
        if rank == 0 and args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
            print(f"wrote {args.json}", flush=True)
        for mode in ("step", "layer"):  # median of the rounds (the slowest rank's); spread: one rank's rounds
            for p, r in result.get(mode, {}).get("paths", {}).items():
                q = _results.spread(r["rounds_ms"]) if world == 1 else {"p20": None, "p80": None}
                shape = dict(config=Path(str(args.config)).stem, overrides=args.override, world=world, nnodes=nnodes,
                             ep=result[mode]["ep"], tokens_per_gpu=result[mode]["tokens_per_gpu"])
                rec.row(mode, p, shape, r["step_ms"], q["p20"], q["p80"], unit="ms",
                        dispatcher=r["dispatcher"], pipeline=r["pipeline"], fused_pipeline=r["fused_pipeline"],
                        tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"], mfu=r["mfu"], phases_ms=r["phases_ms"],
                        rounds_ms=r["rounds_ms"], device=device.type)
        rec.write()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ CLI

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/scaling.py", description=__doc__.splitlines()[0])
    ap.add_argument("--project", action="store_true", help="print the calibrated projection (CPU only)")
    ap.add_argument("--plot", default="", help="with --project: write the MFU / tokens/s plot here (PNG)")
    ap.add_argument("--calibration", default=str(HERE / "scaling_calibration.json"))
    ap.add_argument("--measured", action="append", default=[],
                    help="with --project: a bench/scaling.py JSON to compare with its projection (repeatable)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "debug_cpu.toml"))
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--mode", choices=("step", "layer", "both"), default="both")
    ap.add_argument("--paths", default="fast,reference", help="fast, reference, symm, fused_ep (comma-separated)")
    ap.add_argument("--steps", type=int, default=5, help="steps per round and path (plain, then instrumented)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=0, help="layer mode: tokens per GPU (default: the recipe's)")
    ap.add_argument("--symm-capacity", default="exact", help="SymmDispatcher capacity: exact, worst, or a float")
    ap.add_argument("--json", default="", help="write the results here (rank 0)")
    _results.add_args(ap)
    args = ap.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} must be at least 1")
    if args.warmup < 0 or args.tokens < 0:
        ap.error("--warmup and --tokens must be non-negative")
    bad = [p for p in args.paths.split(",") if p not in ("fast", "reference", "symm", "fused_ep")]
    if bad or not args.paths:
        ap.error(f"--paths={args.paths!r}: each entry must be fast, reference, symm or fused_ep")
    if args.symm_capacity not in ("exact", "worst"):
        try:
            args.symm_capacity = float(args.symm_capacity)
        except ValueError:
            ap.error(f"--symm-capacity={args.symm_capacity!r} must be exact, worst or a float")
    if args.project:
        from scaling_report import project_main
        rec = _results.Recorder("scaling", args, gpu="none", machine="projected")
        rc = project_main(args, rec)
        rec.write()
        return rc
    if args.plot or args.measured:
        ap.error("--plot and --measured go with --project")
    return run_benchmark(args)


if __name__ == "__main__":
    rc = main()
    if "--project" in sys.argv:
        sys.exit(rc)
    # After a distributed run (process groups destroyed, JSON written): exit without interpreter
    # finalization, as train.pretrain.exit_process does -- issue 16: gloo worker threads that
    # outlive destroy_process_group abort the process during finalization (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
