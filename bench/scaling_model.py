"""Projection of MoE training step time, tokens/s/GPU and MFU from one-GPU measurements plus link
parameters (issue 11). Pure Python: runs on a CPU from ``bench/scaling_calibration.json``.

What it predicts: for a training recipe (``configs/*.toml``), a device (``HARDWARE``), a GPU count G,
an expert-parallel degree ``ep`` (dp = G / ep) and an exchange design (``PRESETS``), the time of one
training step of one GPU, split into the phases the harness measures (``bench/scaling.py``;
``HARNESS_PHASES`` maps its phase labels onto these categories), so that every projected category
can stand beside a measured one:

    attention       attention.*: a block minus its FFN (QKV/out projections, SDPA, norms, RoPE):
                    (6·T·L·(4·D² + 2·D) + 6·T·L·H·Dh·S causal) / (eta_attn · peak)
    route           route.*: T·L_moe·(D + E) elements · bytes per element / HBM
    experts         experts.* + dense_ffn.*: 18·T·K·D·F per MoE layer / (eta · peak), eta of the fused
                    pipeline (its on-rank permutation and combine included) or of separate expert
                    ops; shared experts and dense FFN layers at the separate eta; + the bf16->fp32
                    gradient casts of the MoE parameters kept outside FSDP2
    exchange        dispatch.* + combine.* (below)
    grad reduction  grad_reduce: global-norm read of the local gradients; at ep > 1 the in-place
                    division of the expert gradients, the EP all-reduce of router/shared gradients
                    and the norm all-reduce; + the exposed part of FSDP2's all-gathers and
                    reduce-scatters (rings overlapped with compute; the harness sees it in fwd/bwd)
    optimizer       optimizer: parameters this GPU holds (FSDP shard) · bytes/param / HBM
    rest            fwd + bwd + other: embedding, head, loss (T·(D + V) elements) + the fp32->bf16
                    refresh of the parameters kept outside FSDP2 (train/mixed_precision.py)
    FSDP copies     no harness phase of its own (FSDP2's hooks run inside fwd/bwd): casts,
                    copy-in/out and chunk_cat of the parameters FSDP2 manages on a mesh of > 1 rank

Calibration (``Calibration``; every input is marked measured or assumed in the JSON, and
``describe_assumptions`` prints the rates derived from it):
  * the fused profile (one H200, the fused one-rank pipeline, per-phase CUDA-event times from the
    harness) gives every rate: eta_attn, eta_fused, route and rest bytes per element, optimizer
    and norm bytes per parameter, after removing the parameter casts it contains (A3);
  * the separate profile (the same GPU and run, AllToAllDispatcher on a one-rank group, separate
    expert ops) gives eta_sep and the one-rank all-to-all exchange (``a2a_passes``: read+write
    passes of the expanded rows per MoE layer at the copy rate);
  * the exchange profile (``bench/dispatch.py`` at W=2 on two H200s, GPU time per kernel) gives
    the scale-up link efficiency (``_send_tokens_kernel``, the only kernel crossing NVLink) and
    the rates of the symmetric exchange's local kernels.
The two one-GPU points are therefore reproduced by construction; every point at more GPUs is a
check that feeds no parameter.

Exchange per MoE layer and step (4 ops: dispatch, combine and their backwards), per GPU; X =
T·K·D·2 bytes of expanded (expert-major) rows, Y = T·D·2 bytes of token rows; link(rows) = bytes over
the scale-up fabric and over the NIC at link efficiency x datasheet bandwidth, the slower of the
two, + a latency:
    reference      AllToAllDispatcher (NCCL): a2a_passes·2·X / copy rate (measured at ep=1: the
                   one-rank all_to_all copy, permutations, gate weighting, its host syncs)
                   + 4·link(per_slot rows)
    dedup          SymmDispatcher + separate expert ops, the kernels of the W=2 profile at their
                   measured rates: 2 send_tokens = link(rank_dedup rows); 2 expand = X / rate (the
                   backward one also reads X for the gate gradients); 2 reduce_send = max(X / rate,
                   link); 2 reduce_recv = (2 + rows)·Y / rate; 4 barrier waits; the forward layout
                   (route kernels per (token, k) slot, one cumsum per histogram row); one host sync
                   per forward dispatch (capacity="exact")
    fused          4·link(rank_dedup rows) + 4 barrier waits + 2 reduce_recv: the gather and scatter
                   are inside eta_fused (projected: the fused EP path exists but has not run on GPUs)
    fused+overlap  as fused, each layer's link time hidden behind that layer's expert time

Traffic per token per exchange (``traffic_rows``), for E experts, top-K, ep ranks in domains of g
ranks (n = ep/g domains), e = E/ep experts per rank, routing uniform over experts; with node-limited
routing (DeepSeek-V3) every token first picks M of the n domains uniformly, then K experts among
those M·g·e:
    per_slot   (the NCCL all-to-all reference): one row per (token, k) slot on another rank:
               K·(g-1)/ep intra-domain, K·(n-1)/n across domains;
    rank_dedup (tlx_dist's symmetric exchange): one row per (token, destination rank):
               p_r = 1 - C(E'-e, K)/C(E', K), E' = M·g·e; (g-1)·(M/n)·p_r intra, (n-1)·g·(M/n)·p_r across;
    node_dedup (hierarchical, DeepEP/Hybrid-EP style; NOT implemented in tlx_dist, shown for
               comparison): one row per (token, destination domain) over the NIC,
               p_d = 1 - C(E'-g·e, K)/C(E', K), (n-1)·(M/n)·p_d rows, then forwarded inside the
               receiving domain over NVLink.

Assumptions (the JSON's ``assumptions`` hold the numbers, each "measured" or "assumed" with its source):
  A1 GEMM and attention efficiencies (fraction of peak) measured on the H200 carry over to other
     shapes and devices (B200 and MI300X kernels have never run: the largest uncertainty);
  A2 memory-bound categories (route, rest, optimizer, norm, the exchange's local kernels) scale
     with the datasheet HBM bandwidth;
  A3 parameter casts and copies are the bytes counted from the code (``*_bytes_per_param``) at the
     measured copy rate;
  A4 NCCL's all-to-all reaches the scale-up link efficiency measured on the symmetric send kernel;
     NICs reach ``link_efficiency_out``;
  A5 routing is uniform over experts and ranks receive equal rows (``imbalance`` scales the
     expert time);
  A6 the NIC is shared by nothing else (no contention between exchange and FSDP traffic);
  A7 activation memory is not checked (a projected point may not fit);
  A8 the symmetric kernels' W=2 rates (per byte) hold at other D and W, and the barrier wait
     measured at W=2 is a fixed cost per op at any W.
Everything is per GPU and per optimizer step; weak scaling (tokens per GPU fixed by the recipe).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "scaling_calibration.json"

__all__ = ["Hardware", "HARDWARE", "PRESETS", "RECIPE_HARDWARE", "HARNESS_PHASES", "CATEGORIES", "Calibration",
           "load_calibration", "group_phases", "Workload", "workload", "Traffic", "traffic_rows", "Scenario",
           "Projection", "project", "check_measurements", "scaling_rows", "describe_assumptions", "GPU_COUNTS"]

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)

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
    """One GPU and its links. Bandwidths are per GPU and per direction.

    peak_tflops: dense bf16 tensor-core peak. hbm_tb_s: HBM bandwidth. domain: GPUs sharing the
    scale-up fabric (NVSwitch / NVL72 / xGMI). up_gb_s: scale-up bandwidth to the whole domain
    (``up_topology="switch"``: to any peer) or per peer link (``"mesh"``: a fully connected
    point-to-point mesh, xGMI, where traffic to p peers uses p links). out_gb_s: scale-out NIC
    (InfiniBand / RoCE). *_latency_us: per exchange and per ring hop.
    """

    name: str
    peak_tflops: float
    hbm_tb_s: float
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


# Latencies: 3 us per scale-up exchange / ring hop and 5 us per NIC hop are assumptions of this
# model (typical NCCL LL-protocol hop latencies), not datasheet values.
HARDWARE: dict[str, Hardware] = {
    "H100": Hardware(
        "H100", _peak("H100"), 3.35, 8, 450.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, HBM3 3.35 TB/s, NVLink 4 900 GB/s "
        "bidirectional per GPU (450 per direction) through NVSwitch; DGX H100: one ConnectX-7 "
        "400 Gb/s (50 GB/s) per GPU"),
    "H200": Hardware(
        "H200", _peak("H200"), 4.8, 8, 450.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, HBM3e 4.8 TB/s, NVLink 900 GB/s "
        "bidirectional per GPU; HGX/DGX H200: one ConnectX-7 400 Gb/s per GPU"),
    "B200": Hardware(
        "B200", _peak("B200"), 8.0, 8, 900.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA HGX/DGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU (4.5 with sparsity), "
        "HBM3e 8 TB/s, NVLink 5 1.8 TB/s bidirectional per GPU; DGX B200: ConnectX-7 400 Gb/s per GPU"),
    "GB200-NVL72": Hardware(
        "GB200-NVL72", 2500.0, 8.0, 72, 900.0, "switch", 50.0, 3.0, 5.0,
        "NVIDIA GB200 NVL72 datasheet: 360 PFLOP/s BF16 with sparsity per 72 GPUs (2.5 dense per GPU), "
        "HBM3e 8 TB/s per GPU, NVLink 5 1.8 TB/s bidirectional per GPU across the 72-GPU domain; "
        "scale-out assumed one 400 Gb/s ConnectX-7 per GPU (GB300 racks carry 800 Gb/s ConnectX-8)"),
    "MI300X": Hardware(
        "MI300X", _peak("MI300X"), 5.3, 8, 64.0, "mesh", 50.0, 3.0, 5.0,
        "AMD Instinct MI300X datasheet: 1307.4 TFLOP/s dense BF16, HBM3 5.3 TB/s; 8-GPU platform "
        "fully connected by 7 Infinity Fabric (xGMI) links per GPU of 128 GB/s bidirectional "
        "(64 per direction per peer, 448 to all 7 peers); one 400 Gb/s NIC per GPU"),
}

# The device each multi-node recipe in configs/ is written for (projected by default).
RECIPE_HARDWARE = {"h200_8gpu_ep8": "H200", "h200_8x8": "H200", "b200_16x8": "B200", "mi300x_16x8": "MI300X"}


# ------------------------------------------------------------------------------------ exchange designs

# traffic: rows per token (module docstring). dispatcher: which exchange model applies. pipeline:
# "fused" takes the fused expert rate. overlap: link time of a layer hidden behind that layer's
# expert time. host_sync: one host read per forward dispatch not already inside a measured rate.
PRESETS = {
    "reference": dict(traffic="per_slot", dispatcher="all_to_all", pipeline="separate", overlap=False,
                      host_sync=False, doc="NCCL all_to_all_single, one row per (token, k), separate expert ops (measured)"),
    "dedup": dict(traffic="rank_dedup", dispatcher="symm", pipeline="separate", overlap=False,
                  host_sync=True, doc="symmetric exchange, a token crosses to a rank once, separate expert ops (measured)"),
    "fused": dict(traffic="rank_dedup", dispatcher="symm", pipeline="fused", overlap=False,
                  host_sync=False, doc="fused expert pipeline with the deduplicated exchange (projected at EP>1)"),
    "fused+overlap": dict(traffic="rank_dedup", dispatcher="symm", pipeline="fused", overlap=True,
                          host_sync=False, doc="+ exchange overlapped with the expert GEMMs (projected)"),
}
TRAFFIC = ("per_slot", "rank_dedup", "node_dedup")


# ------------------------------------------------------------------------------------ calibration

@dataclass(frozen=True)
class Calibration:
    """The committed calibration (``scaling_calibration.json``), validated on load.

    hardware: device of the profiles. profile: ``recipe``, ``overrides`` and the ids of the
    measurements whose phases calibrate the rates (``fused``, ``separate``). exchange: the W=2
    kernel profile (``world``, ``tokens``, ``dim``, ``experts``, ``top_k``, ``kernels_us``).
    assumptions: name -> {"value", "status", "source"}. measurements: measured points ({"id",
    "use", "hardware", "gpus", "recipe", "overrides", "preset", "tokens_per_s_per_gpu", "source",
    optional "mfu" and "phases_ms"}).
    """

    hardware: str
    profile: dict
    exchange: dict
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
    for k in ("hardware", "profile", "exchange_profile", "assumptions", "measurements"):
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
    x = d["exchange_profile"]
    for k in ("world", "tokens", "dim", "experts", "top_k", "kernels_us", "status", "source"):
        if k not in x:
            raise ValueError(f"{where}: exchange_profile.{k} is missing")
    for k in _KERNELS:
        if not _positive(x["kernels_us"].get(k)):
            raise ValueError(f"{where}: exchange_profile.kernels_us.{k}={x['kernels_us'].get(k)!r} must be a positive number")
    return Calibration(d["hardware"], p, x, d["assumptions"], d["measurements"], str(path))


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
    """Analytic per-GPU work of one step of a recipe (``train.metrics`` counts, reused).

    tokens: T per GPU. flops_*: FLOPs per step per GPU (fwd + bwd): routed experts, shared experts +
    dense FFN layers, attention blocks (projections + causal SDPA). route_elems / rest_elems:
    elements the route and rest categories scale with. expanded_bytes X / token_bytes Y: bytes of
    the expert-major rows and of the token rows of one MoE layer (bf16). params_*: global counts of
    expert, router + shared expert (replicated over ep), and all other parameters.
    flops_per_token: torchtitan's count (the MFU numerator).
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


# ------------------------------------------------------------------------------------ traffic

@dataclass(frozen=True)
class Traffic:
    """Expected rows one token sends per exchange: ``intra`` over the scale-up fabric (incl. the
    forwarding hop of node_dedup), ``inter`` over the NIC; ``peers_intra`` distinct intra-domain
    peers it talks to (for mesh fabrics)."""

    intra: float
    inter: float
    peers_intra: int


def _p_hit(pool: int, own: int, K: int) -> float:
    """P(at least one of K distinct draws from ``pool`` experts lands in a block of ``own``)."""
    return 1.0 - math.comb(pool - own, K) / math.comb(pool, K)


def traffic_rows(E: int, K: int, ep: int, domain: int, kind: str, node_limit: Optional[int] = None) -> Traffic:
    """Expected rows per token per exchange (module docstring). ``domain``: GPUs per scale-up
    domain; ``node_limit``: M, domains a token may reach (None: any)."""
    if kind not in TRAFFIC:
        raise ValueError(f"traffic={kind!r} must be one of {TRAFFIC}")
    if ep < 1 or E % ep:
        raise ValueError(f"ep={ep} must be a positive divisor of num_experts={E}")
    if not 1 <= K <= E:
        raise ValueError(f"top_k={K} must be in [1, num_experts={E}]")
    g = _ranks_per_domain(ep, domain)
    n, e = ep // g, E // ep
    M = n if node_limit is None else node_limit
    if not isinstance(M, int) or M < 1:
        raise ValueError(f"node_limit={node_limit!r} must be a positive integer or None")
    M = min(M, n)
    pool = M * g * e
    if pool < K:
        raise ValueError(f"node_limit={node_limit} leaves {pool} experts (M*g*E/ep) for top_k={K}")
    if ep == 1:
        return Traffic(0.0, 0.0, 0)
    allowed = M / n
    if kind == "per_slot":
        return Traffic(K * (g - 1) / ep, K * (n - 1) / n, g - 1)
    p_r = _p_hit(pool, e, K)
    rank_intra, rank_inter = (g - 1) * allowed * p_r, (n - 1) * g * allowed * p_r
    if kind == "rank_dedup":
        return Traffic(rank_intra, rank_inter, g - 1)
    p_d = _p_hit(pool, g * e, K)
    node_inter = (n - 1) * allowed * p_d
    forward = node_inter * (g - 1) * p_r / p_d if n > 1 else 0.0
    return Traffic(rank_intra + forward, node_inter, g - 1)


def _ranks_per_domain(ep: int, domain: int) -> int:
    """Ranks of an EP group inside one scale-up domain: ep if it fits, else the largest divisor of
    ep that does (EP groups are laid out domain by domain, as torchrun numbers ranks)."""
    if ep <= domain:
        return ep
    return max(d for d in range(1, domain + 1) if ep % d == 0)


# ------------------------------------------------------------------------------------ projection

@dataclass(frozen=True)
class Scenario:
    """hardware: a ``HARDWARE`` key. gpus: G. ep: expert-parallel degree (dp = G / ep). preset: a
    ``PRESETS`` key; ``traffic``/``overlap`` override it. node_limit: M for node-limited routing."""

    hardware: str
    gpus: int
    ep: int
    preset: str = "reference"
    traffic: Optional[str] = None
    overlap: Optional[bool] = None
    node_limit: Optional[int] = None


@dataclass(frozen=True)
class Projection:
    scenario: Scenario
    phases_ms: dict               # ms per category (CATEGORIES)
    step_ms: float
    tokens_per_s_per_gpu: float
    mfu: float
    exchange_gb: float            # bytes this GPU sends per step over links (scale-up + NIC), GB
    detail: dict = field(default_factory=dict)

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
    link_efficiency_up: float     # _send_tokens_kernel bytes / time / datasheet scale-up bandwidth
    expand_eff: float
    reduce_eff: float
    recv_eff: float
    barrier_s: float              # one bounded wait (one per op)
    layout_s_per_slot: float      # route histogram + rank kernels, per (token, k) slot
    layout_s_per_row: float       # the cumsum, per histogram row


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
    fused = group_phases(cal.measurement(p["fused"])["phases_ms"])
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
    tr = traffic_rows(Ex, Kx, Wx, hw.domain, "rank_dedup")
    link_bytes = Tx * (tr.intra + tr.inter) * _row_bytes(Dx, Kx, "rank_dedup")
    eff_up = link_bytes / (k["send_tokens"] * 1e-6) / hw.up_bandwidth(tr.peers_intra)
    if not 0 < eff_up <= 1:
        raise ValueError(f"exchange_profile: send_tokens moves {link_bytes / 1e6:.0f} MB in {k['send_tokens']} us, "
                         f"{eff_up:.2f} x the {cal.hardware} scale-up bandwidth (must be in (0, 1])")
    Xx, Yx = 2.0 * Tx * Kx * Dx, 2.0 * Tx * Dx
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
        recv_eff=(2 + tr.intra + tr.inter) * Yx / (k["reduce_recv"] * 1e-6) / hbm,
        barrier_s=k["barrier_wait_x2"] / 2 * 1e-6,
        layout_s_per_slot=k["route_hist_rank"] * 1e-6 / (Tx * Kx),
        layout_s_per_row=k["cumsum"] * 1e-6 / _route_rows(Tx, Ex, Kx))


def _ring_s(nbytes: float, n: int, bw: float, hop_s: float) -> float:
    """One ring all-gather / reduce-scatter over n ranks of a tensor of ``nbytes`` (unsharded)."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / bw + (n - 1) * hop_s


def _exchange_layer_s(w: Workload, hw: Hardware, r: _Rates, cal: Calibration, pre: dict, link: float,
                      rows: float, ep: int) -> float:
    """Seconds of one MoE layer's 4 exchange ops, link included (``link``: one op's link time),
    without overlap (module docstring)."""
    hbm, X, Y = hw.hbm_tb_s * 1e12, w.expanded_bytes, w.token_bytes
    copy = r.copy_efficiency * hbm
    recv = (2 + rows) * Y / (r.recv_eff * hbm)
    if pre["dispatcher"] == "all_to_all":
        return r.a2a_passes * 2 * X / copy + 4 * link
    if pre["pipeline"] == "fused":
        return 4 * link + 4 * r.barrier_s + 2 * recv if ep > 1 else 0.0
    expand = X / (r.expand_eff * hbm)
    reduce = max(X / (r.reduce_eff * hbm), link)
    extra = cal.value("symm_backward_extra_reads") * X / copy
    T, E, K = w.tokens, w.num_experts, w.top_k
    layout = T * K * r.layout_s_per_slot + _route_rows(T, E, K) * r.layout_s_per_row
    sync = cal.value("host_sync_ms") * 1e-3 if pre["host_sync"] else 0.0
    return 2 * link + 2 * expand + extra + 2 * reduce + 2 * recv + 4 * r.barrier_s + layout + sync


def project(cfg, sc: Scenario, cal: Calibration) -> Projection:
    """Step time of one GPU for recipe ``cfg`` in scenario ``sc`` (module docstring)."""
    if sc.hardware not in HARDWARE:
        raise ValueError(f"hardware={sc.hardware!r} is not one of {sorted(HARDWARE)}")
    if sc.preset not in PRESETS:
        raise ValueError(f"preset={sc.preset!r} is not one of {sorted(PRESETS)}")
    if not isinstance(sc.gpus, int) or sc.gpus < 1 or not isinstance(sc.ep, int) or sc.ep < 1 or sc.gpus % sc.ep:
        raise ValueError(f"gpus={sc.gpus!r} must be a positive multiple of ep={sc.ep!r}")
    hw, r, w = HARDWARE[sc.hardware], _rates(cal), workload(cfg)
    if w.num_experts % sc.ep:
        raise ValueError(f"ep={sc.ep} does not divide model.moe.num_experts={w.num_experts}")
    pre = PRESETS[sc.preset]
    kind = sc.traffic or pre["traffic"]
    overlap = pre["overlap"] if sc.overlap is None else sc.overlap
    G, ep, dp = sc.gpus, sc.ep, sc.gpus // sc.ep
    peak, hbm = hw.peak_tflops * 1e12, hw.hbm_tb_s * 1e12
    copy = r.copy_efficiency * hbm
    eff_up, eff_out = r.link_efficiency_up, cal.value("link_efficiency_out")

    # Who holds what (train/parallelize.py): the non-MoE parameters are FSDP2-sharded over all G
    # ranks when G > 1; the MoE layers (E/ep experts + router/shared) over dp when dp > 1. Anything
    # on a one-rank mesh stays outside FSDP2 with a persistent bf16 copy (local casts).
    moe_p = w.params_expert / ep + w.params_rep
    moe_fsdp, world_fsdp = dp > 1, G > 1
    cast = cal.value("local_cast_bytes_per_param") / copy
    local_p = (0 if moe_fsdp else moe_p) + (0 if world_fsdp else w.params_world)
    fsdp_p = (moe_p if moe_fsdp else 0) + (w.params_world if world_fsdp else 0)
    held_p = w.params_world / G + moe_p / dp

    ph: dict[str, float] = {}
    ph["attention"] = w.flops_attn / (r.eta_attn * peak) + (0 if world_fsdp else w.params_world * cast)
    ph["route"] = w.route_elems * r.route_bytes_per_elem / hbm
    eta = r.eta_fused if pre["pipeline"] == "fused" else r.eta_sep
    t_exp = w.flops_expert / (eta * peak) * cal.value("imbalance")
    ph["experts"] = t_exp + w.flops_ffn / (r.eta_sep * peak) + (0 if moe_fsdp else moe_p * cast)

    # --- token exchange (4 ops per MoE layer)
    tr = traffic_rows(w.num_experts, w.top_k, ep, hw.domain, kind, sc.node_limit)
    row = _row_bytes(w.dim, w.top_k, kind)
    T = w.tokens
    t_up = T * tr.intra * row / (eff_up * hw.up_bandwidth(tr.peers_intra)) if tr.intra else 0.0
    t_out = T * tr.inter * row / (eff_out * hw.out_gb_s * 1e9) if tr.inter else 0.0
    lat = (hw.out_latency_us if tr.inter else hw.up_latency_us) * 1e-6 if ep > 1 else 0.0
    link = max(t_up, t_out) + lat if ep > 1 else 0.0
    per_layer = _exchange_layer_s(w, hw, r, cal, pre, link, tr.intra + tr.inter, ep)
    hidden = min(4 * link, t_exp / w.moe_layers) if overlap else 0.0
    ph["exchange"] = w.moe_layers * (per_layer - hidden)

    # --- gradient reduction: norm + expert-gradient division + EP all-reduce + norm all-reduce
    #     + the exposed part of FSDP2's rings (overlapped with compute)
    def bw_lat(n: int, stride: int) -> tuple[float, float]:
        if n * stride > hw.domain:
            return eff_out * hw.out_gb_s * 1e9, hw.out_latency_us * 1e-6
        return eff_up * hw.up_bandwidth(n - 1), hw.up_latency_us * 1e-6

    bw_w, hop_w = bw_lat(G, 1)
    bw_dp, hop_dp = bw_lat(dp, ep)
    L = cfg.model.n_layers
    units = [(w.block_params, G, bw_w, hop_w)] * L + [(w.root_params, G, bw_w, hop_w)]
    units += [(moe_p / w.moe_layers, dp, bw_dp, hop_dp)] * w.moe_layers
    per_unit = [2 * _ring_s(2 * p, n, bw, hop) + _ring_s(4 * p, n, bw, hop) for p, n, bw, hop in units]
    fsdp_total = sum(per_unit)
    compute = ph["attention"] + ph["experts"]
    fsdp_exposed = max(0.0, fsdp_total - compute) + (max(per_unit) if fsdp_total else 0.0)
    bw_ep, hop_ep = bw_lat(ep, 1)
    ep_ar = 2 * _ring_s(4 * w.params_rep, ep, bw_ep, hop_ep)
    norm_ar = 2 * math.ceil(math.log2(G)) * hop_w if G > 1 else 0.0
    div = w.params_expert / ep / dp * cal.value("expert_grad_div_bytes_per_param") / copy if ep > 1 else 0.0
    ph["grad reduction"] = held_p * r.norm_bytes_per_param / hbm + div + ep_ar + norm_ar + fsdp_exposed

    ph["optimizer"] = held_p * r.opt_bytes_per_param / hbm
    ph["rest"] = w.rest_elems * r.rest_bytes_per_elem / hbm + local_p * cast
    fsdp_b = cal.value("fsdp_copy_bytes_per_param") + cal.value("fsdp_chunk_cat_bytes_per_param")
    ph["FSDP copies"] = fsdp_p * fsdp_b / copy

    step = sum(ph.values())
    tps = T / step
    n_ops = 4 * w.moe_layers if ep > 1 else 0
    detail = {"exchange_link_ms": n_ops * link * 1e3, "exchange_link_hidden_ms": w.moe_layers * hidden * 1e3,
              "rows_per_token_intra": tr.intra, "rows_per_token_inter": tr.inter,
              "fsdp_comm_ms": fsdp_total * 1e3, "fsdp_exposed_ms": fsdp_exposed * 1e3,
              "dp": dp, "traffic": kind, "overlap": overlap}
    return Projection(sc, {k: v * 1e3 for k, v in ph.items()}, step * 1e3, tps, tps * w.flops_per_token / peak,
                      n_ops * T * (tr.intra + tr.inter) * row / 1e9, detail)


# ------------------------------------------------------------------------------------ reports

def check_measurements(cal: Calibration, extra: Optional[list] = None) -> list[dict]:
    """Measured vs predicted for every measured point (calibration JSON + ``extra`` harness
    results in the same format). ``use`` says whether the point was a calibration input; points
    with ``phases_ms`` also get ``measured_phases_ms`` (summed into the model's categories)."""
    rows = []
    for m in list(cal.measurements) + list(extra or []):
        cfg = load_recipe(m["recipe"], m["overrides"])
        ep = cfg.parallel.ep
        pr = project(cfg, Scenario(m["hardware"], int(m["gpus"]), ep, m["preset"]), cal)
        T = cfg.data.batch_size * cfg.data.seq_len
        meas_ms = T / m["tokens_per_s_per_gpu"] * 1e3
        rows.append({"id": m["id"], "use": m["use"], "hardware": m["hardware"], "gpus": m["gpus"], "ep": ep,
                     "preset": m["preset"], "tokens_per_gpu": T, "measured_ms": meas_ms, "predicted_ms": pr.step_ms,
                     "error": pr.step_ms / meas_ms - 1, "measured_tps": m["tokens_per_s_per_gpu"],
                     "predicted_tps": pr.tokens_per_s_per_gpu, "measured_mfu": m.get("mfu"),
                     "predicted_mfu": pr.mfu, "source": m["source"], "projection": pr,
                     "measured_phases_ms": group_phases(m["phases_ms"]) if "phases_ms" in m else None})
    return rows


def scaling_rows(recipe: str, hardware: str, cal: Calibration, presets=tuple(PRESETS), gpus=GPU_COUNTS,
                 layout: str = "recipe", node_limit: Optional[int] = None, traffic: Optional[str] = None) -> list[Projection]:
    """Projections of ``recipe`` on ``hardware`` for each G and preset. ``layout``: "recipe" (the
    recipe's ep, data parallel across nodes) or "wide" (ep = min(G, E): experts spread over all
    GPUs, tokens cross nodes)."""
    if layout not in ("recipe", "wide"):
        raise ValueError(f"layout={layout!r} must be 'recipe' or 'wide'")
    cfg = load_recipe(recipe)
    E = cfg.model.moe.num_experts
    out = []
    for G in gpus:
        ep = cfg.parallel.ep if layout == "recipe" else math.gcd(G, E)
        if G % ep:
            continue
        for p in presets:
            out.append(project(cfg, Scenario(hardware, G, ep, p, traffic=traffic, node_limit=node_limit), cal))
    return out


def describe_assumptions(cal: Calibration) -> list[str]:
    p, x = cal.profile, cal.exchange
    lines = [f"calibration: {cal.path}",
             f"  profile [{p['status']}] {p['recipe']} {' '.join(p['overrides'])} on {cal.hardware}: fused = "
             f"{p['fused']}, separate = {p['separate']}; {p['source']}",
             f"  exchange_profile [{x['status']}] W={x['world']} T={x['tokens']} D={x['dim']} E={x['experts']} "
             f"K={x['top_k']}, us per pair: " + ", ".join(f"{k} {v}" for k, v in x["kernels_us"].items())
             + f"; {x['source']}"]
    for k, a in cal.assumptions.items():
        lines.append(f"  {k} = {a['value']} [{a['status']}] {a['source']}")
    r = _rates(cal)
    hbm = HARDWARE[cal.hardware].hbm_tb_s
    lines.append(f"  derived on {cal.hardware}: routed experts at {r.eta_fused:.1%} of peak with the fused pipeline, "
                 f"{r.eta_sep:.1%} as separate ops; attention blocks {r.eta_attn:.1%}; route {r.route_bytes_per_elem:.1f} "
                 f"and rest {r.rest_bytes_per_elem:.1f} B per element; optimizer {r.opt_bytes_per_param:.1f} B/param, "
                 f"grad norm {r.norm_bytes_per_param:.1f} B/param; one-rank all-to-all {r.a2a_passes:.1f} passes of the "
                 f"expanded rows per MoE layer; scale-up link efficiency {r.link_efficiency_up:.3f}; symmetric kernels "
                 f"(TB/s of expanded rows): expand {r.expand_eff * hbm:.2f}, reduce_send {r.reduce_eff * hbm:.2f}, "
                 f"reduce_recv {r.recv_eff * hbm:.2f}; barrier wait {r.barrier_s * 1e6:.0f} us per op")
    return lines


# ------------------------------------------------------------------------------------ harness results

def _hardware_of(device_name: str) -> str:
    name = device_name.upper().replace(" ", "")
    for key in sorted(HARDWARE, key=len, reverse=True):
        if key.replace("-", "") in name.replace("-", ""):
            return key
    raise ValueError(f"device_name={device_name!r} matches no projected device {sorted(HARDWARE)}")


def measured_from_harness(path) -> list[dict]:
    """Measurement entries (the calibration's format) from a ``bench/scaling.py`` JSON's step
    results, one per path, with the measured phases attached."""
    path = Path(path)
    d = json.loads(path.read_text())
    if "step" not in d:
        raise ValueError(f"{path}: no 'step' results (run bench/scaling.py with --mode step or both)")
    meta = d["meta"]
    hw = _hardware_of(meta["device_name"])
    rows = []
    for name, r in d["step"]["paths"].items():
        if r["dispatcher"] == "AllToAllDispatcher":
            preset = "reference"
        elif r["dispatcher"] == "SymmDispatcher":
            preset = "dedup"
        else:   # one rank: no exchange; the pipeline decides
            preset = "fused" if r.get("fused_pipeline") else "reference"
        rows.append({"id": f"{path.stem}:{name}", "use": "check", "hardware": hw, "gpus": meta["world"],
                     "recipe": meta["config"], "overrides": meta["overrides"], "preset": preset,
                     "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "mfu": r["mfu"],
                     "source": f"{path} ({name}: {r['dispatcher']}, pipeline {r['pipeline']})",
                     "phases_ms": r["phases_ms"]})
    return rows
