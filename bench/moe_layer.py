"""MoE layer benchmark: the fused pipeline, the separate pipeline and a torchtitan-style layer, in one
process, on one GPU.

Providers (all share one router and one set of expert weights; no shared experts):
  fused       MoELayer(pipeline="fused"): gather-on-load gate/up GEMM + SwiGLU epilogue, down GEMM with
              the gate-scale/scatter-add epilogue, fused backward (tlx_dist.fused).
  separate    MoELayer(pipeline="separate"): LocalDispatcher permute -> grouped_mm -> SwiGLU ->
              grouped_mm -> combine -> gate-weighted k-sum.
  torchtitan  router -> argsort -> gather -> torch._grouped_mm x2 with SwiGLU -> gate scale -> index_add.
  liger_cute  LigerMoE (liger-cute-kernels: CUTLASS + NVSHMEM fused EP MoE, bench/_liger_cute.py) on the
              same router output, its gate/up/down weights copied from w13/w2 once, outside the timing;
              skipped with a one-line note where it cannot run (not installed, no Hopper/Blackwell GPU, no
              LD_PRELOAD of its NVSHMEM host library); a shape its tuned tables lack fails alone.
With ``--precision fp8`` (default providers fused,fp8,scaled_grouped_mm; same weights, same process):
  fp8         MoELayer(precision="fp8"): the separate pipeline with the FP8 grouped GEMMs
              (tlx_dist.fp8; weights quantized once, as once per optimizer step in training).
  scaled_grouped_mm  the torchtitan layer with rowwise-FP8 torch._scaled_grouped_mm GEMMs
              (bench/_scaled_grouped_mm.py; skipped with a one-line note where torch lacks it).
Each step is forward + backward (dx and every parameter gradient). fwd+bwd TFLOP/s = 18*T*K*D*F /
median step time (eager, one sync per step); forward TFLOP/s = 6*T*K*D*F / median forward time (under
no_grad). Before any timing, each provider's output on the first CHECK_TOKENS tokens is checked
against an fp32 reference of the same experts (bench/_liger_cute.py check_close: within twice torch's
own bf16 error); one of our bf16 providers off it is not timed (the FP8 providers' and the anchors'
error is recorded only, UNCHECKED). Latency: median eager and CUDA-graph-replayed step time
at the --latency-tokens sizes (each graph captured in a child process: an invalidated capture leaves
the CUDA context unusable, and in-process captures failed in cascade). Ratios are taken
in the same process. The JSON keeps every number;
fused/separate and fused/torchtitan relative errors of the output and of dw13 on the benchmarked
operands are a sanity check (bf16; fp32 atomics make fused bitwise non-reproducible).

    python bench/moe_layer.py [--shapes olmoe,...] [--tokens 4096,16384] [--latency-tokens 1024,4096]
                              [--providers fused,separate,torchtitan] [--reps 10] [--interleave 10]
                              [--precision fp8] [--json out.json]

The fused/separate and fused/torchtitan ratios: with ``--interleave ROUNDS`` (default 10) the
median (and min-max) over rounds that time each provider once, the order rotating (each round's
ratio sees one machine state); ``--interleave 0``: the ratio of the providers' medians.

Expert parallelism (under torchrun, one process per GPU; W = the world size, E experts split over W):

    torchrun --nproc-per-node=2 bench/moe_layer.py [--shapes olmoe,deepseek-v3] [--tokens 16384] [--json out.json]
             [--profile]

Providers there (same router and expert weights on every provider, T tokens per rank):
  fused_ep    MoELayer(dispatcher="symm", pipeline="fused"): dispatch_rows -> fused GEMMs reading the
              receive rows by index -> one partial row home per (token, rank)
  fused_ep_regions  the same with SymmDispatcher(row_regions=1): the layer reads its rows in its own
              receive region, where the peers stored them (no receive-side copy)
  fused_ep_static   regions + a static capacity (SymmDispatcher(capacity=EP_CAPACITY): no host read
              of the row count; rows past the last expert are padding the GEMMs skip or zero)
  fused_ep_overlap  fused_ep_static + overlap=True: the dispatch ends once the peers' metadata landed,
              their rows follow on a side stream (ExchangeConfig.overlap_sms SMs) while the gate/up GEMM
              computes this rank's own rows, then waits for the rest (issue 9, item 3)
  symm        MoELayer(dispatcher="symm", pipeline="separate"): deduplicated exchange, expert-major copy
  all_to_all  MoELayer(dispatcher="all_to_all"): NCCL all_to_all_single + separate ops (the anchor)
  liger_cute  LigerMoE over the same EP group (this rank's experts; its team described as
              W / LOCAL_WORLD_SIZE hosts of LOCAL_WORLD_SIZE GPUs), run after all_to_all
fwd+bwd TFLOP/s per GPU = 18*T*K*D*F / median step time (rank 0's clock, a barrier before each step),
forward 6*T*K*D*F / median forward time; ratios against all_to_all and liger_cute; output and dx
relative errors against all_to_all as a sanity check; the fp32 check above on every rank's first
CHECK_TOKENS tokens (each rank computes its experts' share, summed over the group).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

import _liger_cute  # bench/_liger_cute.py (the script's directory is on sys.path)
import _results  # bench/_results.py (the script's directory is on sys.path)
from _profile import gap_profile, host_profile, interleaved_times, kernel_profile, round_ratios  # bench/_profile.py (the script's directory is on sys.path)

SHAPES = {  # name: (D, F, E, K)
    "olmoe": (2048, 1024, 64, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "mixtral": (4096, 14336, 8, 2),
    "deepseek-v3-rank": (7168, 2048, 32, 8),
}
LIGER = _liger_cute.NAME
PROVIDERS = ("fused", "separate", "torchtitan", LIGER)
FP8_PROVIDERS = ("fused", "fp8", "scaled_grouped_mm")  # the default set of --precision fp8
EP_SHAPES = {"olmoe": (2048, 1024, 64, 8), "qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2),
             "deepseek-v3": (7168, 2048, 256, 8)}  # global E: each of W ranks holds E/W
EP_PROVIDERS = ("fused_ep", "fused_ep_regions", "symm", "all_to_all", LIGER)  # the default set
EP_EXTRA = ("fused_ep_static", "fused_ep_overlap")  # by name (--providers)
EP_CAPACITY = 1.25  # expanded rows of the static-capacity providers: 1.25 * T * K per rank
CHECK_TOKENS = 256  # tokens per rank checked against the fp32 reference before timing
# Error recorded, not gated: the FP8 GEMMs (the bf16 bound does not apply) and the anchors, which are
# measured as they are (torchtitan's layer rounds each of the K gate products to bf16 before its
# index_add, more rounding than the bound's torch twin, and can land just past the bound).
UNCHECKED = ("fp8", "scaled_grouped_mm", "torchtitan", LIGER)


def select_providers(requested: str, precision: str, world: int, optional=None) -> list:
    """The providers to run, in order: the mode's default set where ``requested`` is the default
    ``PROVIDERS`` list (``EP_PROVIDERS`` when ``world > 1``, ``FP8_PROVIDERS`` with
    ``precision == "fp8"`` on one rank), less each optional anchor that cannot run here, dropped with
    one printed line saying why. ``optional``: {provider: () -> '' or the reason}; by default
    LigerMoE's and (one rank) torch._scaled_grouped_mm's availability checks."""
    if requested == ",".join(PROVIDERS):
        requested = ",".join(EP_PROVIDERS if world > 1 else FP8_PROVIDERS if precision == "fp8" else PROVIDERS)
    providers = [p for p in requested.split(",") if p]
    if optional is None:
        optional = {LIGER: _liger_cute.available}
        if world == 1:
            from _scaled_grouped_mm import available

            optional["scaled_grouped_mm"] = available
    for p, check in optional.items():
        if p in providers:
            why = check()
            if why:
                print(f"{p} skipped: {why}", flush=True)
                providers.remove(p)
    return providers


def liger_runtime(providers: list, shapes: dict, names, tokens, group=None):
    """LigerMoE's runtime sized for the largest (tokens, D, E, K) of ``names`` in ``shapes``, or None
    when ``liger_cute`` is not in ``providers`` (removed from it, with one printed line, when its
    setup fails)."""
    sizes = [shapes[n] for n in names if n in shapes]
    if LIGER not in providers or not sizes or not tokens:
        return None
    try:
        return _liger_cute.LigerRuntime(max_tokens=max(tokens), hidden=max(s[0] for s in sizes),
                                        num_experts=max(s[2] for s in sizes), top_k=max(s[3] for s in sizes),
                                        group=group)
    except Exception as err:  # keep the other providers' numbers
        print(f"{LIGER} skipped: its runtime setup failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
        providers.remove(LIGER)
        return None


def torchtitan_experts(x_TD, idx_TK, gate_TK, w13_EDF2, w2_EFD):
    """The anchor: sort slots by expert, gather rows, two torch._grouped_mm with SwiGLU between,
    scale by the gate, index_add back (what torchtitan's MoE does on one rank)."""
    T, K = idx_TK.shape
    Fe = w2_EFD.shape[1]
    flat = idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13_EDF2.shape[0], dtype=torch.int64, device=x_TD.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // K
    h = torch._grouped_mm(x_TD[tok], w13_EDF2, offs=offs)
    y = torch._grouped_mm(F.silu(h[:, :Fe]) * h[:, Fe:], w2_EFD, offs=offs)
    y = y * gate_TK.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, tok, y)


def build(name: str, device: str):
    from tlx_dist import MoEConfig, MoELayer

    D, Fe, E, K = SHAPES[name]
    cfg = MoEConfig(dim=D, moe_inter_dim=Fe, num_experts=E, top_k=K, dtype="bfloat16", aux_loss_coef=0.0,
                    z_loss_coef=0.0, init_std=D ** -0.5)
    # Weights drawn on the GPU (the layer's per-expert CPU init takes seconds at these sizes).
    with mock.patch.object(MoELayer, "reset_parameters", lambda self, seed=None: None):
        layer = MoELayer(cfg, device=device, pipeline="fused")
    with torch.no_grad():
        layer.router.weight.normal_(std=D ** -0.5)
        layer.w13.normal_(std=D ** -0.5)
        layer.w2.normal_(std=Fe ** -0.5)
    return layer


def fp8_twin(layer):
    """An FP8 MoELayer holding ``layer``'s router and expert parameters (the same tensors)."""
    from tlx_dist import MoELayer

    with mock.patch.object(MoELayer, "reset_parameters", lambda self, seed=None: None):
        twin = MoELayer(layer.cfg, device="cuda", precision="fp8", pipeline="separate")
    twin.router, twin.w13, twin.w2 = layer.router, layer.w13, layer.w2
    return twin


def provider_fn(layer, provider: str, twin=None, liger=None):
    """``fn(x_TD) -> out_TD`` of ``provider`` on ``layer``'s router and expert weights (``twin``: the FP8
    layer, ``liger``: the :class:`_liger_cute.LigerExperts` copy of the weights)."""
    if provider in ("fused", "separate"):
        def fn(x):
            layer.pipeline = provider
            return layer(x)
    elif provider == "fp8":
        fn = twin
    elif provider == LIGER:
        def fn(x):
            r = layer.router(x)
            return liger(x, r.idx_TK, r.gate_TK)
    elif provider == "scaled_grouped_mm":
        from _scaled_grouped_mm import scaled_grouped_mm_experts

        def fn(x):
            r = layer.router(x)
            return scaled_grouped_mm_experts(x, r.idx_TK, r.gate_TK, layer.w13, layer.w2)
    else:
        def fn(x):
            r = layer.router(x)
            return torchtitan_experts(x, r.idx_TK, r.gate_TK, layer.w13, layer.w2)
    return fn


def eager_step(fn, x, g, params):
    def step():
        for p in params:
            p.grad = None
        x.grad = None
        fn(x).backward(g)
    return step


def time_once_ms(step) -> float:
    """One eager call of ``step`` from an idle GPU, in ms (CUDA events)."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def eager_ms(fn, x, g, params, reps: int) -> float:
    step = eager_step(fn, x, g, params)
    for _ in range(3):
        step()
    return statistics.median(time_once_ms(step) for _ in range(reps))


def capture(step, capture_mode: str = "global") -> "torch.cuda.CUDAGraph":
    """``step()`` in a CUDA graph, replayed once: warmed up twice on a side stream, run once more
    with host syncs made errors (a syncing op is named by its traceback instead of surfacing as an
    invalidated capture), then captured; the first error inside the capture is printed with its
    frames (capture_end's own error only follows it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_mode):
        try:
            step()
        except Exception:
            import traceback

            print("FIRST ERROR IN CAPTURE:\n" + traceback.format_exc(), flush=True)
            raise
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn, x, g, params, reps: int, capture_mode: str = "global") -> float:
    """Median replay time of one fwd+bwd captured in a CUDA graph (:func:`capture`)."""
    def step():
        xi = x.detach().requires_grad_(True)
        return torch.autograd.grad(fn(xi), [xi] + params, g)

    graph = capture(step, capture_mode)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def _graph_in_child(shape: str, provider: str, T: int, reps: int, capture_mode: str = "global") -> dict:
    """``{provider}_graph_ms`` (or ``{provider}_graph_error``) from a child process running this
    script with ``--graph-in-process`` for one (shape, provider, T): an invalidated capture leaves
    the CUDA context and RNG state unusable, which must not cost the other providers' numbers."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--shapes", shape, "--providers", provider,
               "--tokens", "", "--latency-tokens", str(T), "--reps", str(reps), "--graph-in-process",
               "--capture-mode", capture_mode,
               "--json", out, "--no-results"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return {f"{provider}_graph_error": "the child timed out (600 s)"}
        if p.returncode != 0 or not os.path.exists(out):
            return {f"{provider}_graph_error": (p.stdout + p.stderr)[-500:]}
        with open(out) as f:
            rows = json.load(f)["rows"]
    row = rows[0] if rows else {}
    if f"{provider}_graph_ms" in row:
        return {f"{provider}_graph_ms": row[f"{provider}_graph_ms"]}
    return {f"{provider}_graph_error": row.get(f"{provider}_graph_error",
                                               row.get(f"{provider}_error", "no graph time in the child's row"))}


def forward_ms(fwd, reps: int, sync=torch.cuda.synchronize) -> float:
    """Median time of ``fwd()`` under no_grad, in ms (a ``sync()`` before each call: EP ranks start together)."""
    def step():
        with torch.no_grad():
            fwd()
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        sync()
        times.append(time_once_ms(step))
    return statistics.median(times)


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def ep_ref(layer, x_TD: torch.Tensor, S: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ref_SD fp32, twin_SD bf16)``: the MoE output of this rank's first ``S`` tokens from every
    rank's experts, in fp32 and as torch computes it in bf16 (:func:`_liger_cute.experts_ref`): each rank
    adds its experts' share for every rank's S tokens, one all-reduce sums the shares."""
    import torch.distributed as dist

    W, r = dist.get_world_size(group), dist.get_rank(group)
    with torch.no_grad():
        route = layer.router(x_TD.detach())  # all T tokens: the routing every provider sees
        mine = (x_TD[:S].detach().contiguous(), route.idx_TK[:S].contiguous(), route.gate_TK[:S].float().contiguous())
        every = []
        for t in mine:
            parts = [torch.empty_like(t) for _ in range(W)]
            dist.all_gather(parts, t, group=group)
            every.append(torch.cat(parts))
        e = layer.w13.shape[0]
        outs = []
        for dtype in (torch.float32, torch.bfloat16):
            share = _liger_cute.experts_ref(*every, layer.w13, layer.w2, first_expert=r * e, dtype=dtype)
            dist.all_reduce(share, group=group)
            outs.append(share[r * S:(r + 1) * S])
    return outs[0], outs[1].to(torch.bfloat16)


def ep_main(args, rec, providers) -> int:
    """The torchrun mode (module docstring); ``rec``: rank 0's :class:`_results.Recorder`; ``providers``:
    :func:`select_providers`'s."""
    import os

    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    kinds = {"fused_ep": dict(dispatcher="symm", pipeline="fused"),
             # the fused EP layer reading its rows in its own receive region (no receive-side copy)
             "fused_ep_regions": dict(pipeline="fused"),
             "fused_ep_static": dict(pipeline="fused"),
             "fused_ep_overlap": dict(pipeline="fused"),
             "symm": dict(dispatcher="symm", pipeline="separate"),
             "all_to_all": dict(dispatcher="all_to_all", pipeline="separate")}
    providers = ([p for p in providers if p in kinds or p == LIGER]
                 or [p for p in EP_PROVIDERS if p != LIGER])
    if LIGER in providers and "all_to_all" in providers:  # checked beside the anchor's numbers, after them
        providers.remove(LIGER)
        providers.append(LIGER)
    shapes = [n for n in args.shapes.split(",") if n in EP_SHAPES] or ["olmoe"]
    tokens = sorted(int(t) for t in args.tokens.split(",") if t.strip())
    runtime = liger_runtime(providers, EP_SHAPES, [n for n in shapes if EP_SHAPES[n][2] % W == 0], tokens,
                            group=group)
    try:
        rows = _ep_rows(args, providers, kinds, shapes, tokens, runtime, group)
    finally:
        if runtime is not None:
            runtime.close()  # NVSHMEM goes before the process group it bootstrapped on
    _ep_report(args, rec, providers, rows, W, r)
    dist.destroy_process_group()
    return 0


def _ep_rows(args, providers, kinds, shapes, tokens, runtime, group) -> list:
    """One row per (shape, T) of the torchrun mode: every provider checked, then timed."""
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer
    from tlx_dist.comm import SymmDispatcher

    W, r = dist.get_world_size(group), dist.get_rank(group)
    sync = lambda: (torch.cuda.synchronize(), dist.barrier(group=group))  # noqa: E731
    rows = []
    for name in shapes:
        D, Fe, E, K = EP_SHAPES[name]
        if E % W:
            continue
        cfg = MoEConfig(dim=D, moe_inter_dim=Fe, num_experts=E, top_k=K, dtype="bfloat16", aux_loss_coef=0.0,
                        z_loss_coef=0.0, init_std=D ** -0.5)
        for T in tokens:
            layers = {}
            with mock.patch.object(MoELayer, "reset_parameters", lambda self, seed=None: None):
                # liger_cute alone still needs a layer: the router and weights it shares
                for p in [p for p in providers if p != LIGER] or ["all_to_all"]:
                    kw = dict(kinds[p])
                    if p == "fused_ep_regions":
                        kw["dispatcher"] = SymmDispatcher(E, group, validate=False, row_regions=1)
                    elif p in ("fused_ep_static", "fused_ep_overlap"):
                        kw["dispatcher"] = SymmDispatcher(E, group, validate=False, row_regions=1,
                                                          capacity=EP_CAPACITY, overlap=p == "fused_ep_overlap")
                    layers[p] = MoELayer(cfg, group, device="cuda", **kw)
            first = next(iter(layers.values()))
            g = torch.Generator(device="cuda").manual_seed(1234)  # the same router on every rank
            with torch.no_grad():
                first.router.weight.copy_(torch.randn(E, D, device="cuda", generator=g) * D ** -0.5)
                gl = torch.Generator(device="cuda").manual_seed(100 + r)  # this rank's experts
                first.w13.copy_(torch.randn(first.w13.shape, device="cuda", generator=gl) * D ** -0.5)
                first.w2.copy_(torch.randn(first.w2.shape, device="cuda", generator=gl) * Fe ** -0.5)
            for layer in layers.values():
                if layer is not first:
                    layer.load_state_dict(first.state_dict())
            liger = (_liger_cute.LigerExperts(runtime, first.w13, first.w2, E, K) if LIGER in providers else None)
            gx = torch.Generator(device="cuda").manual_seed(7 + r)
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gx).requires_grad_(True)
            gy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gx)
            row = {"shape": name, "W": W, "T": T, "D": D, "F": Fe, "E": E, "K": K}
            flops = 18.0 * T * K * D * Fe
            S = min(T, CHECK_TOKENS)
            ref, ref_twin = ep_ref(first, x, S, group)
            outs = {}
            for p in providers:
                if p == LIGER:
                    layer = provider_fn(first, LIGER, liger=liger)  # the first layer's router
                    params = list(first.router.parameters()) + liger.params
                else:
                    layer = layers[p]
                    params = list(layer.parameters())

                def step(layer=layer, params=params):
                    for q in params:
                        q.grad = None
                    x.grad = None
                    out = layer(x)
                    out.backward(gy)
                    return out

                try:
                    out = step()
                    outs[p] = (out.detach().float(), x.grad.detach().float())
                    row[f"{p}_ref_maxerr"], bad = _liger_cute.check_close(out[:S].detach(), ref, ref_twin)
                    flag = torch.tensor([float(bad is not None and p not in UNCHECKED)], device="cuda")
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # every rank stops, or none
                    if flag.item():
                        raise ValueError(bad or "output off the fp32 reference on another rank")
                    for _ in range(2):
                        step()
                    times = []
                    for _ in range(args.reps):
                        torch.cuda.synchronize()
                        dist.barrier()
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        step()
                        b.record()
                        b.synchronize()
                        times.append(a.elapsed_time(b))
                    ms = statistics.median(times)
                    row[f"{p}_ms"], row[f"{p}_tflops"] = ms, flops / ms * 1e-9
                    row[f"{p}_fwd_ms"] = forward_ms(lambda layer=layer: layer(x), args.reps, sync)
                    row[f"{p}_fwd_tflops"] = flops / 3 / row[f"{p}_fwd_ms"] * 1e-9
                    if args.profile:
                        prof = kernel_profile(step, 3, lambda: (torch.cuda.synchronize(), dist.barrier()))
                        if r == 0:
                            print(f"\n{name} T={T} {p} W={W}: per-kernel GPU time of one fwd+bwd (rank 0)\n{prof}",
                                  flush=True)
                    check = getattr(getattr(layer, "dispatcher", None), "check", None)  # liger_cute: no dispatcher
                    if check is not None:
                        check()
                except Exception as err:  # keep the other providers' numbers
                    row[f"{p}_error"] = f"{type(err).__name__}: {err}"[:500]
                    print(f"rank {r}: {name} T={T} {p} failed: {row[f'{p}_error']}", flush=True)
            if "all_to_all" in outs:
                for p in outs:
                    if p != "all_to_all":
                        row[f"{p}_out_relerr"] = rel_err(outs[p][0], outs["all_to_all"][0])
                        row[f"{p}_dx_relerr"] = rel_err(outs[p][1], outs["all_to_all"][1])
                        if f"{p}_ms" in row and "all_to_all_ms" in row:
                            row[f"{p}/all_to_all"] = row["all_to_all_ms"] / row[f"{p}_ms"]
            for p in providers:  # q/liger_cute = liger_cute time / q's time: > 1 where q is faster
                for suffix in ("", "_fwd"):
                    if p != LIGER and f"{p}{suffix}_ms" in row and f"{LIGER}{suffix}_ms" in row:
                        row[f"{p}/{LIGER}{suffix.replace('_', ' ')}"] = row[f"{LIGER}{suffix}_ms"] / row[f"{p}{suffix}_ms"]
            rows.append(row)
            del layers, outs, x, gy, liger, ref, ref_twin
            torch.cuda.empty_cache()
    return rows


def _ep_report(args, rec, providers, rows, W, r) -> None:
    """Rank 0 prints the torchrun mode's tables and writes its JSON and results rows."""
    if r == 0:
        nan = float("nan")
        print(f"\nW={W} (torchrun): fwd+bwd per GPU, medians; x a2a = all_to_all time / time")
        print("| shape | T/rank | " + " | ".join(f"{p} ms (TFLOP/s)" for p in providers)
              + " | " + " | ".join(f"{p} x a2a" for p in providers if p != "all_to_all") + " | out relerr |")
        print("|" + "---|" * (3 + len(providers) + len([p for p in providers if p != "all_to_all"])))
        for v in rows:
            print(f"| {v['shape']} | {v['T']} | "
                  + " | ".join(f"{v.get(p + '_ms', nan):.2f} ({v.get(p + '_tflops', nan):.0f})" for p in providers)
                  + " | " + " | ".join(f"{v.get(p + '/all_to_all', nan):.2f}" for p in providers if p != "all_to_all")
                  + " | " + ", ".join(f"{p} {v[p + '_out_relerr']:.1e}" for p in providers if p + "_out_relerr" in v)
                  + " |")
        others = [p for p in providers if p != LIGER]
        print(f"\nW={W} (torchrun): forward per GPU (no_grad), medians; x liger = {LIGER} time / time")
        print("| shape | T/rank | " + " | ".join(f"{p} fwd ms (TFLOP/s)" for p in providers)
              + (" | " + " | ".join(f"{p} x liger fwd+bwd | {p} x liger fwd" for p in others) if LIGER in providers else "")
              + " |")
        print("|" + "---|" * (2 + len(providers) + (2 * len(others) if LIGER in providers else 0)))
        for v in rows:
            print(f"| {v['shape']} | {v['T']} | "
                  + " | ".join(f"{v.get(p + '_fwd_ms', nan):.2f} ({v.get(p + '_fwd_tflops', nan):.0f})" for p in providers)
                  + (" | " + " | ".join(f"{v.get(f'{p}/{LIGER}', nan):.2f} | {v.get(f'{p}/{LIGER} fwd', nan):.2f}"
                                        for p in others) if LIGER in providers else "")
                  + " |")
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "world": W, "rows": rows}, fh, indent=1)
        for v in rows:  # the median over --reps steps: no spread kept
            shape = {k: v[k] for k in ("shape", "W", "T", "D", "F", "E", "K")}
            for p in providers:
                if f"{p}_ms" in v:
                    rec.row("fwd_bwd", p, shape, v[f"{p}_ms"], unit="ms", tflops=v[f"{p}_tflops"],
                            vs_all_to_all=v.get(f"{p}/all_to_all"), out_rel_err=v.get(f"{p}_out_relerr"),
                            dx_rel_err=v.get(f"{p}_dx_relerr"), vs_liger_cute=v.get(f"{p}/{LIGER}"),
                            ref_max_err=v.get(f"{p}_ref_maxerr"))
                if f"{p}_fwd_ms" in v:
                    rec.row("fwd", p, shape, v[f"{p}_fwd_ms"], unit="ms", tflops=v[f"{p}_fwd_tflops"],
                            vs_liger_cute=v.get(f"{p}/{LIGER} fwd"))
        rec.write()


def main() -> int:
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--latency-tokens", default="1024,4096", help="'' skips the CUDA-graph latency runs")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--interleave", type=int, default=10, metavar="ROUNDS",
                    help="then time the providers alternately, ROUNDS rounds, and report fused's speed-up "
                         "as the median (min-max) of the per-round ratios (0: off)")
    ap.add_argument("--profile", action="store_true",
                    help="print the per-kernel GPU time of one fwd+bwd per provider (torchrun mode: rank 0's)")
    ap.add_argument("--gaps", action="store_true",
                    help="print where the GPU idles waiting for the host in one eager fwd+bwd per provider")
    ap.add_argument("--host-profile", action="store_true",
                    help="print where the host spends one eager fwd+bwd per provider (cProfile, cumulative)")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the FP8 layer and the rowwise-FP8 anchor beside the bf16 fused layer")
    ap.add_argument("--json", default="bench_moe_layer.json")
    ap.add_argument("--capture-mode", default="global", choices=("global", "thread_local", "relaxed"),
                    help="torch.cuda.graph's capture_error_mode (a capture that passes only with thread_local / "
                         "relaxed was invalidated by an unsafe CUDA call on another thread)")
    ap.add_argument("--graph-in-process", action="store_true",
                    help="capture the CUDA graphs in this process (default: one child process per capture)")
    _results.add_args(ap)
    args = ap.parse_args()
    rec = _results.Recorder("moe_layer", args, enabled=os.environ.get("RANK", "0") == "0",
                            world=_results.env_world())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # this rank's GPU before the availability checks touch CUDA
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    providers = select_providers(args.providers, args.precision, world)
    if world > 1:
        if args.shapes == ",".join(SHAPES):
            args.shapes = "olmoe"
        if args.tokens == "4096,16384":
            args.tokens = "16384"
        return ep_main(args, rec, providers)
    ints = lambda v: {int(t) for t in v.split(",") if t.strip()}  # noqa: E731
    lat_tokens, tflops_tokens = ints(args.latency_tokens), ints(args.tokens)
    runtime = liger_runtime(providers, SHAPES, args.shapes.split(","), tflops_tokens | lat_tokens)
    try:
        return one_gpu(args, rec, providers, runtime, lat_tokens, tflops_tokens)
    finally:
        if runtime is not None:
            runtime.close()


def one_gpu(args, rec, providers, runtime, lat_tokens, tflops_tokens) -> int:
    """The one-GPU mode (module docstring); ``runtime``: LigerMoE's, or None."""
    import triton

    from tlx_dist.fused import select_fused_backend

    tokens = sorted(tflops_tokens | lat_tokens)
    rows = []
    for name in args.shapes.split(","):
        D, Fe, E, K = SHAPES[name]
        layer = build(name, "cuda")
        twin = fp8_twin(layer) if "fp8" in providers else None
        liger = _liger_cute.LigerExperts(runtime, layer.w13, layer.w2, E, K) if LIGER in providers else None
        params = [p for p in layer.parameters()]
        pparams = lambda p: params + liger.params if p == LIGER else params  # noqa: E731 -- what p's step sets to None
        probe = torch.empty(1, D, device="cuda", dtype=torch.bfloat16)
        print(f"{name}: fused pipeline on its TLX kernels = {layer._fused(probe)}", flush=True)
        for T in tokens:
            torch.manual_seed(0)
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
            g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "T": T, "D": D, "F": Fe, "E": E, "K": K,
                   "fused_backend": select_fused_backend(x, layer.w13, layer.w2).name}
            flops = 18.0 * T * K * D * Fe
            results = {}
            S = min(T, CHECK_TOKENS)
            with torch.no_grad():  # the fp32 reference of the first S tokens, and torch's own bf16 error
                route = layer.router(x.detach())  # all T tokens: the routing every provider sees
                ref_args = (x[:S].detach(), route.idx_TK[:S], route.gate_TK[:S], layer.w13, layer.w2)
                ref = _liger_cute.experts_ref(*ref_args)
                ref_twin = _liger_cute.experts_ref(*ref_args, dtype=torch.bfloat16).to(torch.bfloat16)
                del route
            for p in providers:
                fn = provider_fn(layer, p, twin, liger)
                try:
                    t0 = time.time()
                    out = fn(x)
                    dw13 = liger.dw13(out, g) if p == LIGER else torch.autograd.grad(out, [layer.w13], g)[0]
                    row[f"{p}_ref_maxerr"], bad = _liger_cute.check_close(out[:S].detach(), ref, ref_twin)
                    if bad and p not in UNCHECKED:
                        raise ValueError(bad)
                    results[p] = (out.detach(), dw13)
                    # No autograd graph may outlive this probe: a live graph keeps the parameters'
                    # AccumulateGrad nodes, made on the default stream, and the capture's backward
                    # would then make the legacy stream wait on the capturing one
                    # (cudaErrorStreamCaptureImplicit).
                    del out
                    ms = eager_ms(fn, x, g, pparams(p), args.reps)
                    row[f"{p}_eager_ms"] = ms
                    row[f"{p}_tflops"] = flops / ms * 1e-9
                    row[f"{p}_fwd_ms"] = forward_ms(lambda fn=fn: fn(x), args.reps)
                    row[f"{p}_fwd_tflops"] = flops / 3 / row[f"{p}_fwd_ms"] * 1e-9
                    def fwd(fn=fn, p=p):
                        for q in pparams(p):
                            q.grad = None
                        x.grad = None
                        return fn(x)

                    if args.profile:
                        print(f"\n{name} T={T} {p}: per-kernel GPU time of one fwd+bwd\n"
                              f"{kernel_profile(lambda: fwd().backward(g), 3, torch.cuda.synchronize)}", flush=True)
                    if args.gaps:
                        print(f"\n{name} T={T} {p}: GPU idle in one eager fwd+bwd\n"
                              f"{gap_profile(lambda: fwd().backward(g), torch.cuda.synchronize)}", flush=True)
                    if args.host_profile:
                        print(f"\n{name} T={T} {p}: host side of one eager fwd+bwd\n"
                              f"{host_profile(fwd, lambda out: out.backward(g), 5, torch.cuda.synchronize)}",
                              flush=True)
                    if T in lat_tokens:
                        if args.graph_in_process:
                            try:
                                row[f"{p}_graph_ms"] = graph_ms(fn, x, g, pparams(p), args.reps, args.capture_mode)
                            except Exception:  # the child's row says where: the frames, not just the message
                                import traceback

                                row[f"{p}_graph_error"] = traceback.format_exc()[-1500:]
                                raise
                        else:  # a failed capture poisons the CUDA context: each capture in a child
                            row.update(_graph_in_child(name, p, T, args.reps, args.capture_mode))
                    row[f"{p}_first_s"] = time.time() - t0
                except Exception as err:  # keep the other providers' numbers
                    row[f"{p}_error"] = f"{type(err).__name__}: {err}"[:500]
                    print(f"  {name} T={T} {p} failed: {row[f'{p}_error']}", flush=True)
            for p in providers:
                for q in providers:
                    if p != q and f"{p}_tflops" in row and f"{q}_tflops" in row:
                        row[f"{p}/{q}"] = row[f"{p}_tflops"] / row[f"{q}_tflops"]
                    if p != q and f"{p}_fwd_tflops" in row and f"{q}_fwd_tflops" in row:
                        row[f"{p}/{q} fwd"] = row[f"{p}_fwd_tflops"] / row[f"{q}_fwd_tflops"]
            timed = [p for p in providers if f"{p}_tflops" in row]
            if args.interleave > 0 and "fused" in timed and len(timed) > 1 and T in tflops_tokens:
                times = interleaved_times({p: eager_step(provider_fn(layer, p, twin, liger), x, g, pparams(p))
                                           for p in timed},
                                          args.interleave, time_once_ms)
                for q in timed:
                    if q != "fused":
                        med, lo, hi = round_ratios(times, "fused", q)
                        row[f"fused/{q} (blocks)"] = row[f"fused/{q}"]
                        row[f"fused/{q}"], row[f"fused/{q} range"] = med, [lo, hi]
            for p, q in (("fused", "separate"), ("fused", "torchtitan"), ("fp8", "fused"), ("scaled_grouped_mm", "fused"),
                         ("fused", LIGER)):
                if p in results and q in results:
                    row[f"{p}_vs_{q}_out_relerr"] = rel_err(results[p][0], results[q][0])
                    row[f"{p}_vs_{q}_dw13_relerr"] = rel_err(results[p][1], results[q][1])
            del results
            rows.append(row)
            nan = float("nan")
            cells = "  ".join(f"{p}={row.get(f'{p}_tflops', nan):6.1f} TF/s {row.get(f'{p}_eager_ms', nan):7.2f} ms"
                              + (f" (graph {row[f'{p}_graph_ms']:.2f} ms)" if f"{p}_graph_ms" in row else "")
                              for p in providers)
            print(f"{name:17s} T={T:6d}  {cells}", flush=True)
            del x, g, ref, ref_twin
        del layer, twin, liger, params
        torch.cuda.empty_cache()

    def ratio(r, q):
        v = r.get(f"fused/{q}", float("nan"))
        rng = r.get(f"fused/{q} range")
        return f"{v:.2f}" + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng else "")

    # fused/q: with --interleave the median of per-round ratios (min-max over the rounds), else
    # the ratio of the providers' medians timed one block after the other
    vs = ["separate", "torchtitan"] + ([LIGER] if LIGER in providers else [])
    print("\n| shape | T | " + " | ".join(f"{p} TFLOP/s" for p in providers) + " | "
          + " | ".join(f"fused/{q}" for q in vs) + " |")
    print("|" + "---|" * (2 + len(providers) + len(vs)))
    for r in rows:
        if r["T"] not in tflops_tokens:
            continue
        print(f"| {r['shape']} | {r['T']} | "
              + " | ".join(f"{r.get(p + '_tflops', float('nan')):.1f}" for p in providers)
              + " | " + " | ".join(ratio(r, q) for q in vs) + " |")
    # forward alone (no_grad): 6*T*K*D*F / median; fused/q: the ratio of the medians
    print("\n| shape | T | " + " | ".join(f"{p} fwd TFLOP/s" for p in providers) + " | "
          + " | ".join(f"fused/{q} fwd" for q in providers if q != "fused") + " |")
    print("|" + "---|" * (1 + 2 * len(providers) + ("fused" not in providers)))
    for r in rows:
        if r["T"] in tflops_tokens:
            print(f"| {r['shape']} | {r['T']} | "
                  + " | ".join(f"{r.get(p + '_fwd_tflops', float('nan')):.1f}" for p in providers) + " | "
                  + " | ".join(f"{r.get(f'fused/{q} fwd', float('nan')):.2f}" for q in providers if q != "fused") + " |")
    print("\n| shape | T | " + " | ".join(f"{p} eager / graph ms" for p in providers) + " |")
    print("|" + "---|" * (2 + len(providers)))
    for r in rows:
        if r["T"] in lat_tokens:
            print(f"| {r['shape']} | {r['T']} | " + " | ".join(
                f"{r.get(p + '_eager_ms', float('nan')):.2f} / {r.get(p + '_graph_ms', float('nan')):.2f}"
                for p in providers) + " |")
    if "fp8" in providers:  # fp8 / q: ratios of medians (or fused's interleaved rounds, inverted)
        others = [q for q in ("fused", "scaled_grouped_mm", "separate") if q in providers]
        print("\n| shape | T | " + " | ".join(f"fp8/{q}" for q in others) + " | fp8 vs fused out relerr |")
        print("|" + "---|" * (3 + len(others)))
        for r in rows:
            if r["T"] in tflops_tokens:
                print(f"| {r['shape']} | {r['T']} | " + " | ".join(f"{r.get(f'fp8/{q}', float('nan')):.2f}" for q in others)
                      + f" | {r.get('fp8_vs_fused_out_relerr', float('nan')):.1e} |")
    summary = {}
    for T in sorted(tflops_tokens):
        for key in ("fused/separate", "fused/torchtitan", "fp8/fused", "fp8/scaled_grouped_mm", f"fused/{LIGER}",
                    f"fused/{LIGER} fwd"):
            v = [r[key] for r in rows if r["T"] == T and key in r]
            if v:
                summary[f"{key} median at T={T}"] = statistics.median(v)
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    with open(args.json, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows, "summary": summary}, fh, indent=1)
    for r in rows:  # medians over --reps steps: no spread kept; fused/q: see the table's note above
        shape = {k: r[k] for k in ("shape", "T", "D", "F", "E", "K")}
        for p in providers:
            ratios = {f"fused/{q}": r.get(f"fused/{q}") for q in providers if p == "fused" and q != p}
            ranges = {f"fused/{q} range": r[f"fused/{q} range"] for q in providers if f"fused/{q} range" in r
                      and p == "fused"}
            if f"{p}_eager_ms" in r:
                rec.row("fwd_bwd", p, shape, r[f"{p}_eager_ms"], unit="ms", tflops=r[f"{p}_tflops"],
                        fused_backend=r["fused_backend"], ref_max_err=r.get(f"{p}_ref_maxerr"), **ratios, **ranges)
            if f"{p}_fwd_ms" in r:
                rec.row("fwd", p, shape, r[f"{p}_fwd_ms"], unit="ms", tflops=r[f"{p}_fwd_tflops"],
                        **{f"{k} fwd": r.get(f"{k} fwd") for k in ratios})
            if f"{p}_graph_ms" in r:
                rec.row("fwd_bwd_graph", p, shape, r[f"{p}_graph_ms"], unit="ms")
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
