"""Projection of MoE training step time, tokens/s/GPU and MFU from one- and two-GPU measurements
plus link parameters (issues 11 and 35). Pure Python + torch on a CPU, from
``bench/scaling_calibration.json``.

What it predicts: for a training recipe (``configs/*.toml``), a device (``HARDWARE``), a GPU count G,
an expert-parallel degree ``ep``, an exchange design (``PRESETS``; flat or hierarchical across nodes),
a parameter sharding (``full`` | ``hybrid``, ``bench/scaling_layouts.py``) and ``grad_accum``
micro-batches, the time of one optimizer step of one GPU, split into the phases the harness
measures (``bench/scaling.py``; ``HARNESS_PHASES`` maps its labels onto these categories):

    attention       a block minus its FFN: (6·T·L·(4·D² + 2·D) + causal SDPA) / (eta_attn · peak)
    route           T·L_moe·(D + E) elements · bytes per element / HBM
    experts         18·T·K·D·F per MoE layer / (eta · peak), eta of the fused pipeline (its on-rank
                    gather and scatter included) or of separate expert ops; shared experts and dense
                    FFN layers at the separate eta; + the gradient casts of parameters kept outside FSDP2
    exchange        dispatch + combine and their backwards (below)
    grad reduction  global-norm read of the local gradients, the expert-gradient division, the
                    norm all-reduce, and the exposed part of the layout's collectives (the overlap rule
                    of ``scaling_layouts``; the harness sees FSDP2's waits inside fwd/bwd)
    optimizer       parameters this GPU holds (its shard) · bytes/param / HBM, once per optimizer step
    rest            embedding, head, loss (T·(D + V) elements) + the refresh of parameters kept outside FSDP2
    FSDP copies     casts and copy-in/out of the parameters FSDP2 manages, per micro-batch, and the
                    chunk_cat of each reduce-scatter
Every per-token category runs once per micro-batch (``grad_accum`` times a step); optimizer, norm
and the gradient reductions the sharding defers once per step. Weak scaling: tokens per GPU fixed by the
recipe.

Calibration (``Calibration``; every input is marked measured or assumed in the JSON; the device
datasheet values of ``HARDWARE`` -- peak FLOP/s, HBM, NVLink / xGMI and NIC line rates -- are
assumed from vendor specs; ``describe_assumptions`` prints them all):
  * fit, one H200: the fused profile (per-phase CUDA-event times of the fused one-rank pipeline)
    gives eta_attn, eta_fused, route / rest bytes per element, optimizer and norm bytes per
    parameter, and the measured backward share of the attention and expert phases; the separate
    profile (the same run, all-to-all on a one-rank group, separate expert ops) gives eta_sep and
    the one-rank all-to-all exchange;
  * fit, two H200s: the row-form exchange ops of the fused EP pipeline (``row_exchange_profile``:
    dispatch_rows / combine_rows at W=2 at two token counts) give each op's fixed cost and its link
    rate (a fraction of the datasheet NVLink bandwidth); the flat exchange's kernel profile
    (``exchange_profile``) gives the separate pipeline's symmetric kernels and the NVLink efficiency
    of NCCL (its send kernel's);
  * check, never fitted: every other measured point (``measurements`` with use="check"; the
    row-form op at the third token count), reported with its error.

Exchange per MoE layer and micro-batch (4 ops). Rows per token per op over each leg come from
``scaling_traffic.exchange_rows`` (per (token, k) for NCCL; per (token, rank) flat; per (token,
node) then NVLink fan-out hierarchical; the recipe's routing, node-limited or not). One op's link
time: link(op) = max(T·rows_nvlink·row / (eff_up · B_up), T·rows_nic·row / (eff_out · B_nic)) + hop
latencies (the two legs pipeline, as DeepEP's forwarding does):
    reference      one-rank all-to-all passes (measured) + 4·link(per_slot)
    dedup          SymmDispatcher + separate expert ops, the kernels of the flat W=2 profile at their
                   measured rates (expand, reduce-send, reduce-recv, barrier waits, layout, one host sync)
    fused          the fused EP pipeline over the row form: each op's measured fixed cost + link(op)
                   at the row form's measured NVLink rate; hierarchical: + the landing rank's
                   in-node sum of the partial rows in combine-like ops (a read + write at the copy rate)
    fused+overlap  as fused, a layer's forward (backward) link time hidden behind its forward
                   (backward) expert GEMMs, up to their length
Backward ops cost what their forward mirrors cost (combine's backward is a dispatch of dout, dispatch's
an ungated combine).

Assumptions (numbers in the JSON's ``assumptions``):
  A1 GEMM and attention efficiencies measured on the H200 carry over to other shapes and devices
     (B200 and MI300X kernels have never run: the largest uncertainty);
  A2 memory-bound categories scale with the datasheet HBM bandwidth;
  A3 parameter casts and copies are the bytes counted from the code at the measured copy rate;
  A4 NCCL reaches the NVLink efficiency of the symmetric send kernel; the row form's measured
     NVLink fraction carries to other scale-up fabrics; NICs reach ``link_efficiency_out`` (never
     above 0.8 of line rate, what DeepEP and UCCL-EP report);
  A5 routing is balanced: i.i.d. router logits, equal rows per rank (``imbalance`` scales the experts);
  A6 the exchange and the layout's collectives share each link (``scaling_layouts``' overlap rule);
     SM time NCCL takes from the GEMMs is not counted;
  A7 activation memory scales with tokens x the blocks' activation width (``activation_width``:
     D + K·F + the shared experts' F per MoE block, D + F per dense block), at the bytes per token and
     width element of the measured peak of ``profile.memory`` less its counted state (``state_gb``:
     weights, gradients, AdamW state); exchange buffers and allocator slack are inside that rate;
  A8 the exchange's per-op fixed costs measured at W=2 hold at any W; its per-byte rates at any D.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from scaling_layouts import REDUCE_BYTES, SHARDINGS, exposed_comm_s, node_size, plan_layout
from scaling_traffic import TRAFFIC, Legs, Routing, exchange_rows, hit_probabilities, ranks_per_node

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "scaling_calibration.json"

__all__ = ["Hardware", "HARDWARE", "PRESETS", "EXCHANGES", "RECIPE_HARDWARE", "HARNESS_PHASES", "CATEGORIES",
           "Calibration", "load_calibration", "group_phases", "load_recipe", "Workload", "workload", "Scenario",
           "Projection", "project", "row_op_fit", "GPU_COUNTS", "LINK_EFFICIENCY_OUT_MAX", "TRAFFIC", "SHARDINGS",
           "REDUCE_BYTES", "activation_width", "memory_point_state_gb"]

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
LINK_EFFICIENCY_OUT_MAX = 0.8    # DeepEP and UCCL-EP's reported RDMA throughput / NIC line rate
EXCHANGES = ("auto", "flat", "hierarchical")

# The harness's phase labels (bench/scaling.py) behind each projected category. "FSDP copies" has
# no phase of its own: compared with the harness, it is counted with "rest".
HARNESS_PHASES = {
    "attention": ("attention.fwd", "attention.bwd"),
    "route": ("route.fwd", "route.bwd"),
    "experts": ("experts.fwd", "experts.bwd", "dense_ffn.fwd", "dense_ffn.bwd"),
    "exchange": ("dispatch.fwd", "dispatch.bwd", "combine.fwd", "combine.bwd"),
    "grad reduction": ("grad_reduce",),
    "optimizer": ("optimizer",),
    "rest": ("fwd", "bwd", "other"),
}
CATEGORIES = tuple(HARNESS_PHASES) + ("FSDP copies",)


# ------------------------------------------------------------------------------------------ devices

@dataclass(frozen=True)
class Hardware:
    """One GPU and its links (vendor datasheets: assumed). Bandwidths are per GPU and direction.

    peak_tflops: dense bf16 tensor-core peak. hbm_tb_s: HBM bandwidth; hbm_gb: its capacity.
    domain: GPUs sharing the scale-up fabric (NVSwitch / NVL72 / xGMI). up_gb_s: scale-up bandwidth
    to the whole domain (``up_topology="switch"``) or per peer link (``"mesh"``: fully connected
    point-to-point, xGMI, where traffic to p peers uses p links). out_gb_s: scale-out NIC line rate
    per GPU. *_latency_us: per exchange leg and per collective hop (assumed, typical NCCL LL hops).
    """

    name: str
    peak_tflops: float
    hbm_tb_s: float
    hbm_gb: float
    domain: int
    up_gb_s: float
    up_topology: str
    out_gb_s: float
    up_latency_us: float
    out_latency_us: float
    source: str

    def up_bandwidth(self, peers: int) -> float:
        """Scale-up bytes/s one GPU can send when its traffic spreads over ``peers`` peers."""
        if peers <= 0:
            return math.inf
        per = self.up_gb_s * 1e9
        return per * min(peers, self.domain - 1) if self.up_topology == "mesh" else per


def _peak(name: str) -> float:
    from train.metrics import PEAK_BF16_TFLOPS  # the loop's own MFU denominators
    return PEAK_BF16_TFLOPS[name]


HARDWARE: dict[str, Hardware] = {
    "H100": Hardware(
        "H100", _peak("H100"), 3.35, 80.0, 8, 450.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s "
        "bidirectional per GPU (450 per direction) through NVSwitch; DGX H100: one ConnectX-7 "
        "400 Gb/s (50 GB/s) per GPU"),
    "H200": Hardware(
        "H200", _peak("H200"), 4.8, 141.0, 8, 450.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s "
        "bidirectional per GPU; HGX/DGX H200: one ConnectX-7 400 Gb/s per GPU"),
    "B200": Hardware(
        "B200", _peak("B200"), 8.0, 180.0, 8, 900.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA HGX/DGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU (4.5 with sparsity), "
        "1440 GB HBM3e per 8 GPUs at 8 TB/s each, NVLink 5 1.8 TB/s bidirectional per GPU; DGX B200: "
        "ConnectX-7 400 Gb/s per GPU"),
    "GB200-NVL72": Hardware(
        "GB200-NVL72", 2500.0, 8.0, 186.0, 72, 900.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA GB200 NVL72 datasheet: 360 PFLOP/s BF16 with sparsity per 72 GPUs (2.5 dense per GPU), "
        "13.4 TB HBM3e per 72 GPUs at 8 TB/s each, NVLink 5 1.8 TB/s bidirectional per GPU across the "
        "72-GPU domain; scale-out assumed one 400 Gb/s ConnectX-7 per GPU (GB300 racks carry 800 Gb/s ConnectX-8)"),
    "MI300X": Hardware(
        "MI300X", _peak("MI300X"), 5.3, 192.0, 8, 64.0, "mesh", 50.0, 3.0, 5.0,
        "AMD Instinct MI300X datasheet: 1307.4 TFLOP/s dense BF16, 192 GB HBM3 at 5.3 TB/s; 8-GPU platform "
        "fully connected by 7 Infinity Fabric (xGMI) links per GPU of 128 GB/s bidirectional "
        "(64 per direction per peer, 448 to all 7 peers); one 400 Gb/s NIC per GPU"),
}

# The device each multi-node recipe in configs/ is written for (projected by default).
RECIPE_HARDWARE = {"h200_8gpu_ep8": "H200", "h200_8x8": "H200", "b200_16x8": "B200", "mi300x_16x8": "MI300X"}


# ------------------------------------------------------------------------------------ exchange designs

# traffic: rows per token on one node (``scaling_traffic``; across nodes the scenario's exchange
# decides flat / hierarchical for the symmetric presets). dispatcher: which exchange model applies.
# pipeline: "fused" takes the fused expert rate. overlap: link time of a layer hidden behind that
# layer's expert time. host_sync: one host read per forward dispatch not inside a measured rate.
PRESETS = {
    "reference": dict(traffic="per_slot", dispatcher="all_to_all", pipeline="separate", overlap=False,
                      host_sync=False, doc="NCCL all_to_all_single, one row per (token, k), separate expert ops"),
    "dedup": dict(traffic="rank_dedup", dispatcher="symm", pipeline="separate", overlap=False,
                  host_sync=True, doc="symmetric exchange, separate expert ops"),
    "fused": dict(traffic="rank_dedup", dispatcher="symm", pipeline="fused", overlap=False,
                  host_sync=False, doc="fused EP pipeline over the symmetric row-form exchange"),
    "fused+overlap": dict(traffic="rank_dedup", dispatcher="symm", pipeline="fused", overlap=True,
                          host_sync=False, doc="+ exchange link time overlapped with the expert GEMMs"),
}


# ------------------------------------------------------------------------------------ calibration

@dataclass(frozen=True)
class Calibration:
    """The committed calibration (``scaling_calibration.json``), validated on load.

    hardware: device of the profiles. profile: ``recipe``, ``overrides`` and the ids of the
    measurements whose phases calibrate the rates (``fused``, ``separate``). exchange: the flat W=2
    kernel profile (``world``, ``tokens``, ``dim``, ``experts``, ``top_k``, ``kernels_us``).
    row_exchange: the fused pipeline's row-form ops at W=2 (``world``, ``dim``, ``experts``,
    ``top_k``, ``points``: [{"tokens", "dispatch_us", "combine_us", "use"}]). assumptions: name ->
    {"value", "status", "source"}. measurements: measured points ({"id", "use", "hardware", "gpus",
    "recipe", "overrides", "preset", "tokens_per_s_per_gpu", "source", optional "mfu", "phases_ms"}).
    """

    hardware: str
    profile: dict
    exchange: dict
    row_exchange: dict
    assumptions: dict
    measurements: list
    path: str = ""

    def value(self, name: str) -> float:
        return float(self.assumptions[name]["value"])

    def measurement(self, mid: str) -> dict:
        return next(m for m in self.measurements if m["id"] == mid)


_ASSUMPTIONS = ("copy_tb_s", "local_cast_bytes_per_param", "fsdp_copy_bytes_per_param", "fsdp_chunk_cat_bytes_per_param",
                "expert_grad_div_bytes_per_param", "link_efficiency_out", "host_sync_ms", "symm_backward_extra_reads",
                "imbalance")
_MEAS_FIELDS = ("id", "hardware", "gpus", "recipe", "overrides", "preset", "tokens_per_s_per_gpu", "use", "source")
_KERNELS = ("send_tokens", "expand", "reduce_send", "reduce_recv", "barrier_wait_x2", "cumsum", "route_hist_rank")
# Phases a profile must have: the fused one has no exchange phases (the fused pipeline runs inside experts.*).
_PROFILE_PHASES = {"fused": ("attention", "route", "experts", "grad reduction", "optimizer", "rest"),
                   "separate": ("experts", "exchange")}


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def load_calibration(path=DEFAULT_CALIBRATION) -> Calibration:
    """Reads and validates the calibration JSON; errors name the missing or bad field."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration {path}: not valid JSON ({e})") from None
    where = f"calibration {path}"
    for k in ("hardware", "profile", "exchange_profile", "row_exchange_profile", "assumptions", "measurements"):
        if k not in d:
            raise ValueError(f"{where}: field '{k}' is missing")
    if d["hardware"] not in HARDWARE:
        raise ValueError(f"{where}: hardware={d['hardware']!r} is not one of {sorted(HARDWARE)}")
    for a in _ASSUMPTIONS:
        entry = d["assumptions"].get(a)
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), (int, float)):
            raise ValueError(f"{where}: assumptions.{a}.value is missing or not a number")
        if entry.get("status") not in ("measured", "assumed"):
            raise ValueError(f"{where}: assumptions.{a}.status must be 'measured' or 'assumed'")
        if not entry.get("source"):
            raise ValueError(f"{where}: assumptions.{a}.source is missing")
    eff_out = d["assumptions"]["link_efficiency_out"]["value"]
    if not 0 < eff_out <= LINK_EFFICIENCY_OUT_MAX:
        raise ValueError(f"{where}: assumptions.link_efficiency_out={eff_out} must be in (0, {LINK_EFFICIENCY_OUT_MAX}] "
                         "(no NIC efficiency above what DeepEP and UCCL-EP report)")
    ids = set()
    for i, m in enumerate(d["measurements"]):
        for k in _MEAS_FIELDS:
            if k not in m:
                raise ValueError(f"{where}: measurements[{i}].{k} is missing")
        if m["id"] in ids:
            raise ValueError(f"{where}: measurements[{i}].id={m['id']!r} is not unique")
        ids.add(m["id"])
        if m["use"] not in ("calibration", "check"):
            raise ValueError(f"{where}: measurements[{i}].use={m['use']!r} must be 'calibration' or 'check'")
        if m["hardware"] not in HARDWARE:
            raise ValueError(f"{where}: measurements[{i}].hardware={m['hardware']!r} is unknown")
        if m["preset"] not in PRESETS:
            raise ValueError(f"{where}: measurements[{i}].preset={m['preset']!r} is not one of {sorted(PRESETS)}")
        if not _positive(m["tokens_per_s_per_gpu"]):
            raise ValueError(f"{where}: measurements[{i}].tokens_per_s_per_gpu must be a positive number")
        if "phases_ms" in m:
            group_phases(m["phases_ms"], f"{where}: measurements[{i}].phases_ms")
        if "peak_mem_gib" in m and not _positive(m["peak_mem_gib"]):
            raise ValueError(f"{where}: measurements[{i}].peak_mem_gib must be a positive number")
    p = d["profile"]
    for k in ("recipe", "overrides", "fused", "separate", "status", "source"):
        if k not in p:
            raise ValueError(f"{where}: profile.{k} is missing")
    by_id = {m["id"]: m for m in d["measurements"]}
    for role, cats in _PROFILE_PHASES.items():
        m = by_id.get(p[role])
        if m is None:
            raise ValueError(f"{where}: profile.{role}={p[role]!r} names no measurement")
        # A profile point is a model input: it must be marked so, never counted as a check.
        if m["use"] != "calibration" or m["gpus"] != 1 or "phases_ms" not in m:
            raise ValueError(f"{where}: profile.{role}={p[role]!r} must be a one-GPU measurement with "
                             "use='calibration' and phases_ms")
        got = group_phases(m["phases_ms"])
        missing = [c for c in cats if got[c] <= 0]
        if missing:
            raise ValueError(f"{where}: profile.{role}={p[role]!r} has no time in phases {missing}")
    mem = by_id.get(p.get("memory"))
    if mem is None or "peak_mem_gib" not in mem:
        raise ValueError(f"{where}: profile.memory={p.get('memory')!r} must name a measurement with peak_mem_gib "
                         "(the activation bytes per token come from its peak)")
    x = d["exchange_profile"]
    for k in ("world", "tokens", "dim", "experts", "top_k", "kernels_us", "status", "source"):
        if k not in x:
            raise ValueError(f"{where}: exchange_profile.{k} is missing")
    for k in _KERNELS:
        if not _positive(x["kernels_us"].get(k)):
            raise ValueError(f"{where}: exchange_profile.kernels_us.{k}={x['kernels_us'].get(k)!r} must be a positive number")
    rx = d["row_exchange_profile"]
    for k in ("world", "dim", "experts", "top_k", "points", "status", "source"):
        if k not in rx:
            raise ValueError(f"{where}: row_exchange_profile.{k} is missing")
    fit = [pt for pt in rx["points"] if pt.get("use") == "calibration"]
    for i, pt in enumerate(rx["points"]):
        if pt.get("use") not in ("calibration", "check"):
            raise ValueError(f"{where}: row_exchange_profile.points[{i}].use={pt.get('use')!r} must be 'calibration' or 'check'")
        for k in ("tokens", "dispatch_us", "combine_us"):
            if not _positive(pt.get(k)):
                raise ValueError(f"{where}: row_exchange_profile.points[{i}].{k}={pt.get(k)!r} must be a positive number")
    if len(fit) != 2 or fit[0]["tokens"] == fit[1]["tokens"]:
        raise ValueError(f"{where}: row_exchange_profile needs exactly 2 'calibration' points at different token counts "
                         f"(a fixed cost and a rate per op), got {len(fit)}")
    cal = Calibration(d["hardware"], p, x, rx, d["assumptions"], d["measurements"], str(path))
    row_op_fit(cal)   # rates must be physical: errors name the op
    return cal


def group_phases(phases_ms: dict, where: str = "phases_ms") -> dict:
    """Harness phase times (``bench/scaling.py`` labels) summed into the model's categories
    (``HARNESS_PHASES``); "FSDP copies" is 0 (FSDP2 runs inside fwd/bwd). Unknown labels raise."""
    label = {ph: cat for cat, phs in HARNESS_PHASES.items() for ph in phs}
    out = {c: 0.0 for c in CATEGORIES}
    for k, v in phases_ms.items():
        if k not in label:
            raise ValueError(f"{where}: phase {k!r} is not one the harness writes ({sorted(label)})")
        if not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{where}[{k!r}]={v!r} must be a non-negative number")
        out[label[k]] += v
    return out


def row_op_fit(cal: Calibration) -> dict:
    """Fixed cost (s) and payload rate (bytes/s) of each row-form op from the two fit points of
    ``row_exchange_profile``: t = fixed + T·p_rank·D·2 / rate (payload: token rows only, as the
    bench counts GB/s). Returns {"dispatch": (fixed, rate), "combine": (fixed, rate), "checks":
    [(tokens, op, measured_us, fitted_us)] for every point}."""
    rx = cal.row_exchange
    W, D, E, K = (int(rx[k]) for k in ("world", "dim", "experts", "top_k"))
    p_rank = hit_probabilities(E, K, W, W)[0][1]
    fit = sorted((pt for pt in rx["points"] if pt["use"] == "calibration"), key=lambda pt: pt["tokens"])
    out: dict = {"checks": []}
    for op in ("dispatch", "combine"):
        (t0, u0), (t1, u1) = ((pt["tokens"], pt[f"{op}_us"] * 1e-6) for pt in fit)
        b0, b1 = (t * p_rank * D * 2.0 for t in (t0, t1))
        rate = (b1 - b0) / (u1 - u0) if u1 > u0 else -1.0
        fixed = u0 - b0 / rate
        if rate <= 0 or fixed < 0 or rate > HARDWARE[cal.hardware].up_bandwidth(W - 1):
            raise ValueError(f"calibration {cal.path}: row_exchange_profile {op}: the fit points give a rate of "
                             f"{rate / 1e9:.0f} GB/s and a fixed cost of {fixed * 1e6:.1f} us: not physical on {cal.hardware}")
        out[op] = (fixed, rate)
    for pt in rx["points"]:
        for op in ("dispatch", "combine"):
            fixed, rate = out[op]
            fitted = fixed + pt["tokens"] * p_rank * D * 2.0 / rate
            out["checks"].append((pt["tokens"], op, pt["use"], pt[f"{op}_us"], fitted * 1e6))
    return out


# ------------------------------------------------------------------------------------ workload

def load_recipe(recipe: str, overrides=()):
    """A recipe by name (``b200_16x8``) or path, with ``key=value`` overrides."""
    from train.config import load_config
    p = Path(recipe)
    if not p.suffix:
        p = ROOT / "configs" / f"{recipe}.toml"
    elif not p.exists():   # relative to this checkout, or a path from the machine that ran the harness
        p = ROOT / p if (ROOT / p).exists() else ROOT / "configs" / p.name
    if not p.exists():
        raise ValueError(f"recipe={recipe!r}: no such file {p}")
    return load_config(p, list(overrides))


@dataclass(frozen=True)
class Workload:
    """Analytic per-GPU work of one micro-batch of a recipe (``train.metrics`` counts, reused).

    tokens: T per GPU per micro-batch. flops_*: FLOPs per micro-batch per GPU (fwd + bwd): routed
    experts, shared experts + dense FFN layers, attention blocks (projections + causal SDPA).
    route_elems / rest_elems: elements the route and rest categories scale with. expanded_bytes X /
    token_bytes Y: bytes of the expert-major rows and of the token rows of one MoE layer (bf16).
    params_*: global counts of routed experts, router + shared experts (replicated over ep), and
    all other parameters. flops_per_token: torchtitan's count (the MFU numerator).
    """

    tokens: int
    moe_layers: int
    dim: int
    top_k: int
    num_experts: int
    flops_expert: float
    flops_ffn: float
    flops_attn: float
    route_elems: float
    rest_elems: float
    expanded_bytes: float
    token_bytes: float
    params_expert: int
    params_rep: int
    params_world: int
    flops_per_token: int
    block_params: int            # attention + norms (+ dense MLP) of one block, on average
    root_params: int             # embedding + head + final norm


def activation_width(cfg) -> int:
    """The width a token's activations scale with, summed over blocks (A7; ``_Rates.act_bytes`` is
    the measured bytes per token and unit of it): D + K·F + F_shared for an MoE block (residual
    stream, routed and shared expert intermediates), D + F for a dense block."""
    m, moe = cfg.model, cfg.model.moe
    moe_w = m.dim + moe.top_k * moe.moe_inter_dim + moe.shared_dim
    return (m.n_layers - m.n_dense_layers) * moe_w + m.n_dense_layers * (m.dim + m.dense_inter_dim)


def workload(cfg) -> Workload:
    from train.metrics import flops_per_token, param_counts
    m, moe = cfg.model, cfg.model.moe
    if m.n_layers == m.n_dense_layers:
        raise ValueError(f"model.n_dense_layers={m.n_dense_layers} = model.n_layers: the recipe has no MoE layer to project")
    T = cfg.data.batch_size * cfg.data.seq_len
    pc = param_counts(m)
    fpt = flops_per_token(m, cfg.data.seq_len)
    L, Lm = m.n_layers, m.n_layers - m.n_dense_layers
    D, K, E = m.dim, moe.top_k, moe.num_experts
    causal = 0.5 * T * (fpt - 6 * (pc.active - pc.embedding))   # half of torchtitan's 12·L·H·Dh·S per token
    rep = Lm * (E * D + 3 * D * moe.shared_dim)
    root = 2 * m.vocab_size * D + D
    world = pc.total - pc.experts - rep
    return Workload(
        tokens=T, moe_layers=Lm, dim=D, top_k=K, num_experts=E,
        flops_expert=6.0 * T * (pc.experts * K / E),
        flops_ffn=6.0 * T * (Lm * 3 * D * moe.shared_dim + m.n_dense_layers * 3 * D * m.dense_inter_dim),
        flops_attn=6.0 * T * L * (4 * D * D + 2 * D) + causal,
        route_elems=float(T * Lm * (D + E)), rest_elems=float(T * (D + m.vocab_size)),
        expanded_bytes=2.0 * T * K * D, token_bytes=2.0 * T * D,
        params_expert=pc.experts, params_rep=rep, params_world=world, flops_per_token=fpt,
        block_params=(world - root) // L, root_params=root)


# ------------------------------------------------------------------------------------ projection

@dataclass(frozen=True)
class Scenario:
    """hardware: a ``HARDWARE`` key. gpus: G. ep: expert-parallel degree. preset: a ``PRESETS`` key;
    ``traffic`` / ``overlap`` override it. exchange: ``EXCHANGES`` ("auto": hierarchical once the EP
    group spans nodes, as ``SymmDispatcher`` picks; None: the recipe's ``parallel.exchange`` or
    "auto"). node_limit: M -- node-limited routing with groups = the EP group's nodes, a token
    using at most M of them (None: the recipe's own routing). sharding: ``SHARDINGS`` (None: the
    recipe's ``parallel.sharding``, else "full"). grad_accum: micro-batches per optimizer step (None: the recipe's, else 1).
    nic_scale: NIC line rate x this (what-if rows; 1 = the datasheet). reduce_dtype: the dtype of the
    gradient reduce-scatters and all-reduces, "float32" | "bfloat16" (None: the recipe's
    ``parallel.reduce_dtype``, else "float32"; ``train/parallelize.py``).
    """

    hardware: str
    gpus: int
    ep: int
    preset: str = "reference"
    traffic: Optional[str] = None
    overlap: Optional[bool] = None
    node_limit: Optional[int] = None
    exchange: Optional[str] = None
    sharding: Optional[str] = None
    grad_accum: Optional[int] = None
    nic_scale: float = 1.0
    reduce_dtype: Optional[str] = None


@dataclass(frozen=True)
class Projection:
    """phases_ms: ms per optimizer step per category (``CATEGORIES``). exchange_gb: bytes this GPU
    sends per optimizer step for the token exchange, both legs (GB). legs_gb: per op ("dispatch",
    "combine", "dispatch_bwd", "combine_bwd") and for "grad_sync", {"nvlink": GB, "nic": GB} sent per
    optimizer step. state_gb: fp32 weights + gradients + AdamW moments this GPU holds (+ persistent
    bf16 copies, + the fp32 accumulators kept between micro-batches when grad_accum > 1).
    activation_gb: the activations of one micro-batch (A7, an estimate)."""

    scenario: Scenario
    phases_ms: dict
    step_ms: float
    tokens_per_s_per_gpu: float
    mfu: float
    exchange_gb: float
    legs_gb: dict = field(default_factory=dict)
    state_gb: float = 0.0
    detail: dict = field(default_factory=dict)
    activation_gb: float = 0.0

    @property
    def bottleneck(self) -> str:
        return max(self.phases_ms, key=self.phases_ms.get)


@dataclass(frozen=True)
class _Rates:
    """Per-unit costs on the calibration device, derived once from the profiles (module docstring).
    *_eff: rate / the calibration device's HBM bandwidth (A2 carries them to other devices)."""

    eta_attn: float
    eta_fused: float
    eta_sep: float
    route_bytes_per_elem: float
    rest_bytes_per_elem: float
    opt_bytes_per_param: float
    norm_bytes_per_param: float
    a2a_passes: float             # read+write passes of the expanded rows per MoE layer, one-rank all-to-all
    copy_efficiency: float        # measured copy rate / datasheet HBM bandwidth
    link_efficiency_up: float     # _send_tokens_kernel bytes / time / datasheet scale-up bandwidth (NCCL too)
    expand_eff: float
    reduce_eff: float
    recv_eff: float
    barrier_s: float              # one bounded wait (one per op)
    layout_s_per_slot: float      # route histogram + rank kernels, per (token, k) slot
    layout_s_per_row: float       # the cumsum, per histogram row
    bwd_share_attn: float         # measured backward share of the attention phase
    bwd_share_experts: float      # and of the (fused) expert phase
    row_fixed_s: tuple            # row-form (dispatch, combine) fixed cost per op
    row_eff_up: tuple             # row-form (dispatch, combine) payload rate / datasheet scale-up bandwidth
    act_bytes: float              # activation bytes per token and activation-width element (A7)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _route_rows(T: int, E: int, K: int) -> int:
    """Token blocks of the route layout: ceil(T / BLOCK_T), BLOCK_T the power of two <= min(64, 16384 //
    (pow2(E)·pow2(K))). The calibration profile timed the measured code's cumsum over them (since
    replaced by the single-pass route kernel, ``tlx/comm/exchange.py``; not re-measured)."""
    bt = max(1, min(64, 16384 // (_next_pow2(E) * _next_pow2(K))))
    return -(-T // (1 << (bt.bit_length() - 1)))


def _row_bytes(D: int, K: int, kind: str) -> int:
    """Bytes of one exchanged row: bf16 D, + K slots of metadata (expert slot, gate) when deduplicated."""
    return 2 * D + (6 * K if kind != "per_slot" else 0)


def _rates(cal: Calibration) -> _Rates:
    hw = HARDWARE[cal.hardware]
    p = cal.profile
    w = workload(load_recipe(p["recipe"], p["overrides"]))
    if w.flops_ffn:
        raise ValueError(f"profile.recipe={p['recipe']!r} has shared experts or dense FFN layers: the expert "
                         "rates must come from a profile whose experts.* phases hold routed experts only")
    peak, hbm = hw.peak_tflops * 1e12, hw.hbm_tb_s * 1e12
    copy = cal.value("copy_tb_s") * 1e12
    fused_ms = cal.measurement(p["fused"])["phases_ms"]
    fused = group_phases(fused_ms)
    sep = group_phases(cal.measurement(p["separate"])["phases_ms"])
    # A3: at one GPU every parameter is outside FSDP2: one refresh (in rest) and one gradient cast
    # (in the phase that owns the parameter) per step, removed before the per-token rates.
    cast = cal.value("local_cast_bytes_per_param") / copy
    moe_p, world_p = w.params_expert + w.params_rep, w.params_world

    def net_s(phases: dict, cat: str, minus_s: float) -> float:
        t = phases[cat] * 1e-3 - minus_s
        if t <= 0:
            raise ValueError(f"profile: {cat} {phases[cat]} ms is not more than its counted parameter casts "
                             f"({minus_s * 1e3:.2f} ms): check assumptions.local_cast_bytes_per_param")
        return t

    x, k = cal.exchange, cal.exchange["kernels_us"]
    Wx, Tx, Dx, Ex, Kx = (int(x[n]) for n in ("world", "tokens", "dim", "experts", "top_k"))
    tr = exchange_rows("rank_dedup", Ex, Kx, Wx, ranks_per_node(Wx, hw.domain))
    link_bytes = Tx * (tr.nvlink + tr.nic) * _row_bytes(Dx, Kx, "rank_dedup")
    eff_up = link_bytes / (k["send_tokens"] * 1e-6) / hw.up_bandwidth(tr.peers_nvlink)
    if not 0 < eff_up <= 1:
        raise ValueError(f"exchange_profile: send_tokens moves {link_bytes / 1e6:.0f} MB in {k['send_tokens']} us, "
                         f"{eff_up:.2f} x the {cal.hardware} scale-up bandwidth (must be in (0, 1])")
    Xx, Yx = 2.0 * Tx * Kx * Dx, 2.0 * Tx * Dx
    rf = row_op_fit(cal)
    up_w = hw.up_bandwidth(int(cal.row_exchange["world"]) - 1)

    def share(cat: str) -> float:
        fwd, bwd = (sum(fused_ms.get(ph, 0.0) for ph in HARNESS_PHASES[cat] if ph.endswith(s)) for s in (".fwd", ".bwd"))
        return bwd / (fwd + bwd)

    return _Rates(
        eta_attn=w.flops_attn / net_s(fused, "attention", world_p * cast) / peak,
        eta_fused=w.flops_expert / net_s(fused, "experts", moe_p * cast) / peak,
        eta_sep=w.flops_expert / net_s(sep, "experts", moe_p * cast) / peak,
        route_bytes_per_elem=fused["route"] * 1e-3 * hbm / w.route_elems,
        rest_bytes_per_elem=net_s(fused, "rest", (moe_p + world_p) * cast) * hbm / w.rest_elems,
        opt_bytes_per_param=fused["optimizer"] * 1e-3 * hbm / (moe_p + world_p),
        norm_bytes_per_param=fused["grad reduction"] * 1e-3 * hbm / (moe_p + world_p),
        a2a_passes=sep["exchange"] * 1e-3 * copy / (w.moe_layers * 2 * w.expanded_bytes),
        copy_efficiency=copy / hbm, link_efficiency_up=eff_up,
        expand_eff=Xx / (k["expand"] * 1e-6) / hbm,
        reduce_eff=Xx / (k["reduce_send"] * 1e-6) / hbm,
        recv_eff=(2 + tr.nvlink + tr.nic) * Yx / (k["reduce_recv"] * 1e-6) / hbm,
        barrier_s=k["barrier_wait_x2"] / 2 * 1e-6,
        layout_s_per_slot=k["route_hist_rank"] * 1e-6 / (Tx * Kx),
        layout_s_per_row=k["cumsum"] * 1e-6 / _route_rows(Tx, Ex, Kx),
        bwd_share_attn=share("attention"), bwd_share_experts=share("experts"),
        row_fixed_s=(rf["dispatch"][0], rf["combine"][0]),
        row_eff_up=(rf["dispatch"][1] / up_w, rf["combine"][1] / up_w),
        act_bytes=_activation_bytes(cal))


def _layout_params(w: Workload, cfg) -> dict:
    """``plan_layout``'s parameter counts of a workload."""
    return {"dense_units": [w.block_params] * cfg.model.n_layers + [w.root_params], "moe_layers": w.moe_layers,
            "experts": w.params_expert, "replicated": w.params_rep}


def _state_bytes(plan) -> float:
    """fp32 master + gradient + AdamW moments of the held shard, + the persistent bf16 copies of the
    parameters kept outside FSDP2."""
    return 16 * plan.held_params + 2 * (plan.detail["local_dense"] + plan.detail["local_moe"])


def memory_point_state_gb(m: dict) -> tuple:
    """(state GB, tokens, activation width) of measured point ``m`` at the layout it ran with."""
    cfg = load_recipe(m["recipe"], m["overrides"])
    w, ep = workload(cfg), cfg.parallel.ep
    G = int(m["gpus"])
    plan = plan_layout(m.get("sharding", "full"), G, ep, HARDWARE[m["hardware"]].domain, _layout_params(w, cfg),
                       {"nvlink": 1.0, "nic": 1.0}, {"nvlink": 0.0, "nic": 0.0})
    return _state_bytes(plan) / 1e9, w.tokens, activation_width(cfg)


def _activation_bytes(cal: Calibration) -> float:
    m = cal.measurement(cal.profile["memory"])
    state_gb, T, width = memory_point_state_gb(m)
    act = m["peak_mem_gib"] * 2 ** 30 - state_gb * 1e9
    if act <= 0:
        raise ValueError(f"profile.memory={m['id']!r}: peak {m['peak_mem_gib']} GiB is not above its counted state "
                         f"({state_gb:.1f} GB)")
    return act / (T * width)


def _recipe_default(cfg, section: str, name: str, default):
    return getattr(getattr(cfg, section), name, default)


def _exchange_layer_s(w: Workload, hw: Hardware, r: _Rates, cal: Calibration, pre: dict, link: tuple,
                      legs: Legs, ep: int, kind: str) -> float:
    """Seconds of one MoE layer's 4 exchange ops (module docstring), links included, without
    overlap. ``link``: (dispatch-like, combine-like) link seconds of one op."""
    if ep == 1 and pre["dispatcher"] == "symm":
        return 0.0
    hbm, X, Y = hw.hbm_tb_s * 1e12, w.expanded_bytes, w.token_bytes
    copy = r.copy_efficiency * hbm
    rows = legs.nvlink + legs.nic
    if pre["dispatcher"] == "all_to_all":
        return r.a2a_passes * 2 * X / copy + 2 * link[0] + 2 * link[1]
    if pre["pipeline"] == "fused":
        # the landing rank sums the partial rows of its node into one row per (token, node): combine-like ops
        hier = (legs.nvlink_forward + legs.nic) * 2 * Y / copy if kind == "node_dedup" else 0.0
        return 2 * (r.row_fixed_s[0] + link[0]) + 2 * (r.row_fixed_s[1] + link[1] + hier)
    recv = (2 + rows) * Y / (r.recv_eff * hbm)
    expand = X / (r.expand_eff * hbm)
    reduce = max(X / (r.reduce_eff * hbm), link[1])
    extra = cal.value("symm_backward_extra_reads") * X / copy
    T, E, K = w.tokens, w.num_experts, w.top_k
    layout = T * K * r.layout_s_per_slot + _route_rows(T, E, K) * r.layout_s_per_row
    sync = cal.value("host_sync_ms") * 1e-3 if pre["host_sync"] else 0.0
    return 2 * link[0] + 2 * expand + extra + 2 * reduce + 2 * recv + 4 * r.barrier_s + layout + sync


def project(cfg, sc: Scenario, cal: Calibration) -> Projection:
    """Optimizer-step time of one GPU for recipe ``cfg`` in scenario ``sc`` (module docstring)."""
    if sc.hardware not in HARDWARE:
        raise ValueError(f"hardware={sc.hardware!r} is not one of {sorted(HARDWARE)}")
    if sc.preset not in PRESETS:
        raise ValueError(f"preset={sc.preset!r} is not one of {sorted(PRESETS)}")
    if not isinstance(sc.gpus, int) or sc.gpus < 1 or not isinstance(sc.ep, int) or sc.ep < 1 or sc.gpus % sc.ep:
        raise ValueError(f"gpus={sc.gpus!r} must be a positive multiple of ep={sc.ep!r}")
    # The recipe's [parallel.exchange] table is an ExchangeConfig; its topology picks the legs.
    exchange = sc.exchange or getattr(_recipe_default(cfg, "parallel", "exchange", None), "topology", "auto")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} must be one of {EXCHANGES}")
    sharding = sc.sharding or _recipe_default(cfg, "parallel", "sharding", "full")
    A = sc.grad_accum if sc.grad_accum is not None else _recipe_default(cfg, "train", "grad_accum", 1)
    if not isinstance(A, int) or isinstance(A, bool) or A < 1:
        raise ValueError(f"grad_accum={A!r} must be a positive integer")
    if not isinstance(sc.nic_scale, (int, float)) or not sc.nic_scale > 0:
        raise ValueError(f"nic_scale={sc.nic_scale!r} must be a positive number")
    rdt = sc.reduce_dtype or _recipe_default(cfg, "parallel", "reduce_dtype", "float32")
    if rdt not in REDUCE_BYTES:
        raise ValueError(f"reduce_dtype={rdt!r} must be one of {tuple(REDUCE_BYTES)}")
    hw, r, w = HARDWARE[sc.hardware], _rates(cal), workload(cfg)
    hw = dataclasses.replace(hw, out_gb_s=hw.out_gb_s * sc.nic_scale)
    if w.num_experts % sc.ep:
        raise ValueError(f"ep={sc.ep} does not divide model.moe.num_experts={w.num_experts}")
    G, ep = sc.gpus, sc.ep
    s = node_size(G, hw.domain)
    g = ranks_per_node(ep, s)
    n = ep // g
    pre = PRESETS[sc.preset]
    overlap = pre["overlap"] if sc.overlap is None else sc.overlap
    if sc.traffic is not None:
        kind = sc.traffic
    elif pre["dispatcher"] == "all_to_all":
        kind = "per_slot"
    else:
        kind = "node_dedup" if exchange == "hierarchical" or (exchange == "auto" and n > 1) else "rank_dedup"
    if kind not in TRAFFIC:
        raise ValueError(f"traffic={kind!r} must be one of {TRAFFIC}")
    routing = Routing.of(cfg.model.moe)
    if sc.node_limit is not None:
        if not isinstance(sc.node_limit, int) or sc.node_limit < 1:
            raise ValueError(f"node_limit={sc.node_limit!r} must be a positive integer or None")
        routing = Routing(n, min(sc.node_limit, n), routing.score_func) if n > 1 else Routing(1, None, routing.score_func)
    peak, hbm = hw.peak_tflops * 1e12, hw.hbm_tb_s * 1e12
    copy = r.copy_efficiency * hbm
    eff_out = cal.value("link_efficiency_out")
    T, Lm = w.tokens, w.moe_layers

    # --- who holds what, and the collectives that move it (scaling_layouts)
    bw = {"nvlink": r.link_efficiency_up * hw.up_bandwidth(s - 1), "nic": eff_out * hw.out_gb_s * 1e9}
    hop = {"nvlink": hw.up_latency_us * 1e-6, "nic": hw.out_latency_us * 1e-6}
    plan = plan_layout(sharding, G, ep, hw.domain, _layout_params(w, cfg), bw, hop, rdt)
    cast = cal.value("local_cast_bytes_per_param") / copy

    # --- compute of one micro-batch
    ph: dict[str, float] = {}
    t_attn = w.flops_attn / (r.eta_attn * peak)
    eta = r.eta_fused if pre["pipeline"] == "fused" else r.eta_sep
    t_exp = w.flops_expert / (eta * peak) * cal.value("imbalance")
    t_ffn = w.flops_ffn / (r.eta_sep * peak)
    local_dense, local_moe = plan.detail["local_dense"], plan.detail["local_moe"]
    ph["attention"] = A * (t_attn + local_dense * cast)      # + the gradient casts of local parameters
    ph["route"] = A * w.route_elems * r.route_bytes_per_elem / hbm
    ph["experts"] = A * (t_exp + t_ffn + local_moe * cast)

    # --- token exchange: rows per leg, one op's link time per (dispatch-like, combine-like) op
    legs = exchange_rows(kind, w.num_experts, w.top_k, ep, g, routing)
    fused_rows = pre["pipeline"] == "fused"
    row = 2 * w.dim if fused_rows else _row_bytes(w.dim, w.top_k, kind)   # row-form rates count payload only
    t_nv, t_nic, link = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    if ep > 1:
        for i in (0, 1):
            eff_up = r.row_eff_up[i] if fused_rows else r.link_efficiency_up
            t_nv[i] = T * legs.nvlink * row / (eff_up * hw.up_bandwidth(legs.peers_nvlink)) if legs.nvlink else 0.0
            t_nic[i] = T * legs.nic * row / (eff_out * hw.out_gb_s * 1e9) if legs.nic else 0.0
            lat = hw.out_latency_us if legs.nic else hw.up_latency_us
            if kind == "node_dedup" and legs.nic:
                lat += hw.up_latency_us       # the forward inside the destination node
            link[i] = max(t_nv[i], t_nic[i]) + lat * 1e-6
    per_layer = _exchange_layer_s(w, hw, r, cal, pre, tuple(link), legs, ep, kind)
    # overlap: a layer's forward links hide behind its forward expert GEMMs, its backward links
    # behind its backward GEMMs (one forward and one backward op of each kind per phase)
    fb_a, fb_e = r.bwd_share_attn, r.bwd_share_experts
    ops_link = link[0] + link[1]
    hid_f = min(ops_link, (1 - fb_e) * t_exp / Lm) if overlap and ep > 1 else 0.0
    hid_b = min(ops_link, fb_e * t_exp / Lm) if overlap and ep > 1 else 0.0
    hidden = hid_f + hid_b
    ph["exchange"] = A * Lm * (per_layer - hidden)

    # --- gradient reduction: norm, expert-gradient division, norm all-reduce, exposed collectives
    fwd_s = (1 - fb_a) * t_attn + (1 - fb_e) * (t_exp + t_ffn) + Lm * (per_layer / 2 - hid_f)
    bwd_s = fb_a * t_attn + fb_e * (t_exp + t_ffn) + Lm * (per_layer / 2 - hid_b)
    busy = {"nvlink": Lm * (t_nv[0] + t_nv[1]), "nic": Lm * (t_nic[0] + t_nic[1])}   # 2 of the 4 ops per phase
    exposed = exposed_comm_s(plan, A, fwd_s, bwd_s, busy, busy)
    held_exp = plan.detail["held_experts"]
    div = held_exp * cal.value("expert_grad_div_bytes_per_param") / copy if ep > 1 else 0.0
    norm_ar = 2 * math.ceil(math.log2(G)) * hop["nic" if G > s else "nvlink"] if G > 1 else 0.0
    ph["grad reduction"] = plan.held_params * r.norm_bytes_per_param / hbm + div + norm_ar + exposed["total"]
    ph["optimizer"] = plan.held_params * r.opt_bytes_per_param / hbm
    ph["rest"] = A * w.rest_elems * r.rest_bytes_per_elem / hbm + (local_dense + local_moe) * cast
    # casts and copy-in/out every micro-batch; the reduce-scatter's chunk_cat where it runs
    rs_runs = A if plan.detail["reduce_scatter_every_micro_batch"] else 1
    ph["FSDP copies"] = plan.fsdp_params * (A * cal.value("fsdp_copy_bytes_per_param")
                                            + rs_runs * cal.value("fsdp_chunk_cat_bytes_per_param")) / copy
    if REDUCE_BYTES[rdt] < 4:   # keep_accumulation_fp32: bf16 partial sums read, fp32 written, but the last
        ph["FSDP copies"] += (A - 1) * plan.detail["partial_sum_params"] * 6 / copy

    step = sum(ph.values())
    tps = A * T / step
    on = 1 if ep > 1 else 0
    op_gb = {"nvlink": on * A * Lm * T * legs.nvlink * row / 1e9, "nic": on * A * Lm * T * legs.nic * row / 1e9}
    legs_gb = {op: dict(op_gb) for op in ("dispatch", "combine", "dispatch_bwd", "combine_bwd")}
    legs_gb["grad_sync"] = {ln: plan.bytes_per_step(ln, A) / 1e9 for ln in ("nvlink", "nic")}
    state = (_state_bytes(plan) + (4 * plan.detail["accumulation_params"] if A > 1 else 0.0)) / 1e9
    detail = {"exchange_link_ms": 4 * on * A * Lm * (link[0] + link[1]) / 2 * 1e3,
              "exchange_link_hidden_ms": A * Lm * hidden * 1e3,
              "rows_per_token_nvlink": legs.nvlink, "rows_per_token_nic": legs.nic, "nodes_hit": legs.nodes_hit,
              "collectives_ms": exposed["comm"] * 1e3, "collectives_exposed_ms": exposed["total"] * 1e3,
              "traffic": kind, "overlap": overlap, "sharding": sharding, "grad_accum": A, "node": s,
              "ep_nodes": n, "routing": routing, "tokens_per_step": A * T} | plan.detail
    return Projection(sc, {k: v * 1e3 for k, v in ph.items()}, step * 1e3, tps, tps * w.flops_per_token / peak,
                      4 * (op_gb["nvlink"] + op_gb["nic"]), legs_gb, state, detail,
                      r.act_bytes * T * activation_width(cfg) / 1e9)
