"""Projection of MoE training step time, tokens/s/GPU and MFU from one-GPU measurements plus link
parameters (issue 11). Pure Python: runs on a CPU from ``bench/scaling_calibration.json``.

What it predicts: for a training recipe (``configs/*.toml``), a device (``HARDWARE``), a GPU count G,
an expert-parallel degree ``ep`` (dp = G / ep) and an exchange design (``PRESETS``), the time of one
training step of one GPU, split into the categories of the measured H200 profile:

    expert GEMMs      18·T·K·D·F per MoE layer / (eta_exp · peak)
    other GEMMs       6·T·(dense active params) / (eta_mm · peak)   attention projections, router,
                      shared experts, dense MLPs, head
    attention         6·T·L·H·Dh·S (causal half of torchtitan's 12·L·H·Dh·S) / (eta_attn · peak)
    elementwise/casts T·sum_layers A_layer · beta / HBM bandwidth; A = K·(3F + D) + 12·D elements
                      per token of an MoE layer (per-slot h, a, y rows; ~12 D-wide tensors: norms,
                      residuals, RoPE'd q/k, casts) + 3·Fs for shared experts; 3·Fd + 12·D for a
                      dense layer. The fused expert pipeline removes the K·(3F + D) term (SwiGLU,
                      permutation and combine passes move into GEMM prologues/epilogues).
    optimizer         params held by this GPU (FSDP shard) · bytes/param / HBM bandwidth
    FSDP copies       params this GPU computes with (unsharded: non-expert + E/ep experts) ·
                      bytes/param / HBM bandwidth (FSDP2's casts and copy-in/out, chunk_cat)
    exchange          4 exchanges per MoE layer (dispatch, combine, and their backwards): bytes
                      over the scale-up link (same NVLink/xGMI domain) and over the NIC, each at
                      link_efficiency x datasheet bandwidth, the slower of the two + a latency;
                      + extra HBM row passes of the path; + a host sync per forward dispatch when
                      the path has one. With overlap, each layer's link time hides behind that
                      layer's expert GEMMs (the fused design: GEMMs consume rows as they arrive).
    grad reduction    FSDP2 all-gathers (bf16, forward and backward) and reduce-scatters (fp32) as
                      rings (bytes·(n-1)/n over the slowest link crossed + (n-1) hop latencies),
                      hidden behind compute except what exceeds it and one unit's worth;
                      + the EP all-reduce of router/shared gradients + the grad-norm all-reduce.

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

Assumptions (each is a field of ``Calibration.assumptions`` with its status, "measured" or
"assumed", and its source; ``describe_assumptions`` prints them):
  A1 GEMM and attention efficiencies (fraction of peak) measured on the H200 carry over to other
     shapes and devices (B200 and MI300X kernels have never run: this is the largest uncertainty);
  A2 memory-bound categories scale with the datasheet HBM bandwidth;
  A3 FSDP2's parameter copies are ``fsdp_copy_bytes_per_param`` bytes through ``aten::copy_`` per
     step at the measured copy rate (counted from FSDP2's cast, copy-in and copy-out, forward and
     backward); the rest of the profile's ``copy_`` time is per token;
  A4 exchanges and collectives reach ``link_efficiency_*`` of the datasheet bandwidth;
  A5 routing is uniform over experts and ranks receive equal rows (``imbalance`` scales GEMMs);
  A6 the NIC is shared by nothing else (no contention between exchange and FSDP traffic);
  A7 activation memory is not checked (a projected point may not fit).
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

__all__ = ["Hardware", "HARDWARE", "PRESETS", "RECIPE_HARDWARE", "Calibration", "load_calibration",
           "Workload", "workload", "Traffic", "traffic_rows", "Scenario", "Projection", "project",
           "check_measurements", "scaling_rows", "describe_assumptions", "GPU_COUNTS"]

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)


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
RECIPE_HARDWARE = {"h200_8gpu_ep8": "H200", "b200_multinode": "B200", "mi300x_multinode": "MI300X"}


# ------------------------------------------------------------------------------------ exchange designs

# traffic: rows per token (see the module docstring). dispatcher: "all_to_all" adds an expert-major
# permutation pass per exchange; host_sync: one .cpu() per forward dispatch (split sizes, or
# capacity="exact"). pipeline: "fused" drops the per-slot elementwise term. overlap: link time of a
# layer hidden behind that layer's expert GEMMs.
PRESETS = {
    "reference": dict(traffic="per_slot", dispatcher="all_to_all", pipeline="separate", overlap=False,
                      host_sync=True, doc="NCCL all_to_all_single, one row per (token, k); measured path"),
    "dedup": dict(traffic="rank_dedup", dispatcher="symm", pipeline="separate", overlap=False,
                  host_sync=True, doc="symmetric exchange, a token crosses to a rank once (capacity='exact')"),
    "fused": dict(traffic="rank_dedup", dispatcher="symm", pipeline="fused", overlap=False,
                  host_sync=False, doc="+ fused expert pipeline (projected: the fused layer has not run at EP>1)"),
    "fused+overlap": dict(traffic="rank_dedup", dispatcher="symm", pipeline="fused", overlap=True,
                          host_sync=False, doc="+ exchange overlapped with the expert GEMMs (projected)"),
}
TRAFFIC = ("per_slot", "rank_dedup", "node_dedup")


# ------------------------------------------------------------------------------------ calibration

@dataclass(frozen=True)
class Calibration:
    """The committed calibration (``scaling_calibration.json``), validated on load.

    hardware: device of the profile. profile: dict with ``recipe``, ``overrides``, ``step_ms`` and
    ``categories_ms`` (raw per-step categories of the measured profile). assumptions: name ->
    {"value", "status", "source"}. measurements: measured points ({"id", "hardware", "gpus",
    "recipe", "overrides", "preset", "tokens_per_s_per_gpu", "mfu", "use", "source"}).
    """

    hardware: str
    profile: dict
    assumptions: dict
    measurements: list
    path: str = ""

    def value(self, name: str) -> float:
        return float(self.assumptions[name]["value"])


_PROFILE_CATS = ("expert GEMMs", "other GEMMs", "attention", "elementwise", "copy_", "optimizer", "FSDP chunk_cat")
_ASSUMPTIONS = ("copy_tb_s", "fsdp_copy_bytes_per_param", "link_efficiency_up", "link_efficiency_out",
                "host_sync_ms", "imbalance", "extra_row_passes_all_to_all", "extra_row_passes_symm")
_MEAS_FIELDS = ("id", "hardware", "gpus", "recipe", "overrides", "preset", "tokens_per_s_per_gpu", "use", "source")


def load_calibration(path=DEFAULT_CALIBRATION) -> Calibration:
    """Reads and validates the calibration JSON; errors name the missing or bad field."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration {path}: not valid JSON ({e})") from None
    for k in ("hardware", "profile", "assumptions", "measurements"):
        if k not in d:
            raise ValueError(f"calibration {path}: field '{k}' is missing")
    if d["hardware"] not in HARDWARE:
        raise ValueError(f"calibration {path}: hardware={d['hardware']!r} is not one of {sorted(HARDWARE)}")
    p = d["profile"]
    for k in ("recipe", "overrides", "step_ms", "categories_ms", "status", "source"):
        if k not in p:
            raise ValueError(f"calibration {path}: profile.{k} is missing")
    for c in _PROFILE_CATS:
        v = p["categories_ms"].get(c)
        if not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"calibration {path}: profile.categories_ms['{c}']={v!r} must be a non-negative number")
    for a in _ASSUMPTIONS:
        entry = d["assumptions"].get(a)
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), (int, float)):
            raise ValueError(f"calibration {path}: assumptions.{a}.value is missing or not a number")
        if entry.get("status") not in ("measured", "assumed"):
            raise ValueError(f"calibration {path}: assumptions.{a}.status must be 'measured' or 'assumed'")
        if not entry.get("source"):
            raise ValueError(f"calibration {path}: assumptions.{a}.source is missing")
    for i, m in enumerate(d["measurements"]):
        for k in _MEAS_FIELDS:
            if k not in m:
                raise ValueError(f"calibration {path}: measurements[{i}].{k} is missing")
        if m["hardware"] not in HARDWARE:
            raise ValueError(f"calibration {path}: measurements[{i}].hardware={m['hardware']!r} is unknown")
        if m["preset"] not in PRESETS:
            raise ValueError(f"calibration {path}: measurements[{i}].preset={m['preset']!r} is not one of {sorted(PRESETS)}")
    return Calibration(d["hardware"], p, d["assumptions"], d["measurements"], str(path))


# ------------------------------------------------------------------------------------ workload

def load_recipe(recipe: str, overrides=()):
    """A recipe by name (``b200_multinode``) or path, with ``key=value`` overrides."""
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

    tokens: T per GPU. flops_*: FLOPs per step per GPU. act_elems / act_elems_fused: activation
    elements per step (elementwise model, separate / fused pipeline). params_expert / params_other:
    global parameter counts. flops_per_token: torchtitan's count (the MFU numerator).
    """

    tokens: int
    moe_layers: int
    flops_expert: float
    flops_other: float
    flops_attn_causal: float
    act_elems: float
    act_elems_fused: float
    params_expert: int
    params_other: int
    flops_per_token: int
    dim: int
    top_k: int
    num_experts: int
    moe_params_replicated: int   # router + shared experts of all MoE layers (EP all-reduce)
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
    dense_active = pc.active - pc.embedding - pc.experts * moe.top_k // moe.num_experts
    L, Lm = m.n_layers, m.n_layers - m.n_dense_layers
    D, F, K = m.dim, moe.moe_inter_dim, moe.top_k
    per_slot = K * (3 * F + D)
    common_moe = 12 * D + 3 * moe.shared_dim
    dense_layer = 3 * m.dense_inter_dim + 12 * D
    act = Lm * (per_slot + common_moe) + m.n_dense_layers * dense_layer
    act_fused = Lm * common_moe + m.n_dense_layers * dense_layer
    rep = Lm * (moe.num_experts * D + 3 * D * moe.shared_dim)
    root = 2 * m.vocab_size * D + D
    other = pc.total - pc.experts
    return Workload(
        tokens=T, moe_layers=Lm,
        flops_expert=6.0 * T * (pc.experts * K / moe.num_experts),
        flops_other=6.0 * T * dense_active,
        flops_attn_causal=0.5 * T * (fpt - 6 * (pc.active - pc.embedding)),
        act_elems=float(T * act), act_elems_fused=float(T * act_fused),
        params_expert=pc.experts, params_other=other, flops_per_token=fpt, dim=D, top_k=K,
        num_experts=moe.num_experts, moe_params_replicated=rep,
        block_params=(other - rep - root) // L, root_params=root)


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
    phases_ms: dict
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
    """Per-unit costs on the calibration device, derived once from the profile (A1-A3)."""

    eta_exp: float
    eta_mm: float
    eta_attn: float
    ew_bytes_per_elem: float      # effective HBM bytes per activation element
    opt_bytes_per_param: float
    fsdp_bytes_per_param: float
    copy_efficiency: float        # measured copy rate / datasheet HBM bandwidth


def _rates(cal: Calibration) -> _Rates:
    hw = HARDWARE[cal.hardware]
    p = cal.profile
    c = p["categories_ms"]
    cfg = load_recipe(p["recipe"], p["overrides"])
    w = workload(cfg)
    peak, hbm = hw.peak_tflops * 1e12, hw.hbm_tb_s * 1e12
    s = 1e-3
    copy_rate = cal.value("copy_tb_s") * 1e12
    # A3: the parameter part of copy_ (FSDP2 casts + copy-in/out) at the measured copy rate.
    p_compute = w.params_other + w.params_expert  # one GPU computes with every parameter
    fsdp_copy_ms = cal.value("fsdp_copy_bytes_per_param") * p_compute / copy_rate / s
    if fsdp_copy_ms > c["copy_"]:
        raise ValueError(f"assumptions.fsdp_copy_bytes_per_param gives {fsdp_copy_ms:.1f} ms of parameter "
                         f"copies, more than the profile's copy_ time {c['copy_']} ms")
    other_ms = max(0.0, p["step_ms"] - sum(c[k] for k in _PROFILE_CATS))
    ew_ms = c["elementwise"] + (c["copy_"] - fsdp_copy_ms) + other_ms
    fsdp_ms = fsdp_copy_ms + c["FSDP chunk_cat"]
    p_local = w.params_other + w.params_expert   # one rank holds every shard
    return _Rates(
        eta_exp=w.flops_expert / (c["expert GEMMs"] * s) / peak,
        eta_mm=w.flops_other / (c["other GEMMs"] * s) / peak,
        eta_attn=w.flops_attn_causal / (c["attention"] * s) / peak,
        ew_bytes_per_elem=ew_ms * s * hbm / w.act_elems,
        opt_bytes_per_param=c["optimizer"] * s * hbm / p_local,
        fsdp_bytes_per_param=fsdp_ms * s * hbm / p_compute,
        copy_efficiency=copy_rate / hbm)


def _ring_s(nbytes: float, n: int, bw: float, hop_s: float) -> float:
    """One ring all-gather / reduce-scatter over n ranks of a tensor of ``nbytes`` (unsharded)."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / bw + (n - 1) * hop_s


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
    eff_up, eff_out = cal.value("link_efficiency_up"), cal.value("link_efficiency_out")
    ph: dict[str, float] = {}

    t_exp = w.flops_expert / (r.eta_exp * peak) * cal.value("imbalance")
    ph["expert GEMMs"] = t_exp
    ph["other GEMMs"] = w.flops_other / (r.eta_mm * peak)
    ph["attention"] = w.flops_attn_causal / (r.eta_attn * peak)
    act = w.act_elems_fused if pre["pipeline"] == "fused" else w.act_elems
    ph["elementwise/casts"] = act * r.ew_bytes_per_elem / hbm
    p_local = w.params_expert / ep / dp + w.params_other / G
    p_compute = w.params_expert / ep + w.params_other
    ph["optimizer"] = p_local * r.opt_bytes_per_param / hbm
    ph["FSDP copies"] = p_compute * r.fsdp_bytes_per_param / hbm

    # --- token exchange (4 per MoE layer per step)
    tr = traffic_rows(w.num_experts, w.top_k, ep, hw.domain, kind, sc.node_limit)
    row = 2 * w.dim + (6 * w.top_k if kind != "per_slot" else 0)   # bf16 row (+ dedup metadata)
    T = w.tokens
    t_up = T * tr.intra * row / (eff_up * hw.up_bandwidth(tr.peers_intra)) if tr.intra else 0.0
    t_out = T * tr.inter * row / (eff_out * hw.out_gb_s * 1e9) if tr.inter else 0.0
    lat = (hw.out_latency_us if tr.inter else hw.up_latency_us) * 1e-6 if ep > 1 else 0.0
    t_link_op = max(t_up, t_out) + lat
    n_ops = 4 * w.moe_layers if ep > 1 else 0
    link_total = n_ops * t_link_op
    exposed_link = (w.moe_layers * max(0.0, 4 * t_link_op - t_exp / w.moe_layers) if overlap else link_total) if ep > 1 else 0.0
    passes = cal.value("extra_row_passes_all_to_all" if pre["dispatcher"] == "all_to_all" else "extra_row_passes_symm")
    t_pass = n_ops * passes * T * w.top_k * 2 * w.dim * 2 / (r.copy_efficiency * hbm)
    t_sync = w.moe_layers * cal.value("host_sync_ms") * 1e-3 if (ep > 1 and pre["host_sync"]) else 0.0
    ph["exchange"] = exposed_link + t_pass + t_sync

    # --- gradient reduction: FSDP2 rings (overlapped with compute) + EP all-reduce + norm all-reduce
    def bw_lat(n: int, stride: int) -> tuple[float, float]:
        spans = n * stride > hw.domain
        if spans:
            return eff_out * hw.out_gb_s * 1e9, hw.out_latency_us * 1e-6
        return eff_up * hw.up_bandwidth(n - 1), hw.up_latency_us * 1e-6

    bw_w, hop_w = bw_lat(G, 1)
    bw_dp, hop_dp = bw_lat(dp, ep)
    L = cfg.model.n_layers
    units = [(w.block_params, G, bw_w, hop_w)] * L + [(w.root_params, G, bw_w, hop_w)]
    moe_unit = w.params_expert / w.moe_layers / ep + w.moe_params_replicated / w.moe_layers
    units += [(moe_unit, dp, bw_dp, hop_dp)] * w.moe_layers
    per_unit = [2 * _ring_s(2 * p, n, bw, hop) + _ring_s(4 * p, n, bw, hop) for p, n, bw, hop in units]
    fsdp_total = sum(per_unit)
    compute = sum(ph[k] for k in ("expert GEMMs", "other GEMMs", "attention", "elementwise/casts"))
    fsdp_exposed = max(0.0, fsdp_total - compute) + (max(per_unit) if fsdp_total else 0.0)
    bw_ep, hop_ep = bw_lat(ep, 1)
    ep_ar = 2 * _ring_s(4 * w.moe_params_replicated, ep, bw_ep, hop_ep)
    norm_ar = 2 * math.ceil(math.log2(G)) * hop_w if G > 1 else 0.0
    ph["grad reduction"] = fsdp_exposed + ep_ar + norm_ar

    step = sum(ph.values())
    tps = T / step
    exch_gb = n_ops * T * (tr.intra + tr.inter) * row / 1e9
    detail = {"exchange_link_ms": link_total * 1e3, "exchange_link_exposed_ms": exposed_link * 1e3,
              "exchange_hbm_passes_ms": t_pass * 1e3, "exchange_host_sync_ms": t_sync * 1e3,
              "rows_per_token_intra": tr.intra, "rows_per_token_inter": tr.inter,
              "fsdp_comm_ms": fsdp_total * 1e3, "fsdp_exposed_ms": fsdp_exposed * 1e3,
              "dp": dp, "traffic": kind, "overlap": overlap}
    return Projection(sc, {k: v * 1e3 for k, v in ph.items()}, step * 1e3, tps,
                      tps * w.flops_per_token / peak, exch_gb, detail)


# ------------------------------------------------------------------------------------ reports

def check_measurements(cal: Calibration, extra: Optional[list] = None) -> list[dict]:
    """Measured vs predicted for every measured point (calibration JSON + ``extra`` harness
    results in the same format). ``use`` says whether the point was a calibration input."""
    rows = []
    for m in list(cal.measurements) + list(extra or []):
        cfg = load_recipe(m["recipe"], m["overrides"])
        ep = cfg.parallel.ep
        pr = project(cfg, Scenario(m["hardware"], int(m["gpus"]), ep, m["preset"]), cal)
        T = cfg.data.batch_size * cfg.data.seq_len
        meas_ms = T / m["tokens_per_s_per_gpu"] * 1e3
        rows.append({"id": m["id"], "use": m["use"], "hardware": m["hardware"], "gpus": m["gpus"], "ep": ep,
                     "tokens_per_gpu": T, "measured_ms": meas_ms, "predicted_ms": pr.step_ms,
                     "error": pr.step_ms / meas_ms - 1, "measured_tps": m["tokens_per_s_per_gpu"],
                     "predicted_tps": pr.tokens_per_s_per_gpu, "measured_mfu": m.get("mfu"),
                     "predicted_mfu": pr.mfu, "source": m["source"], "projection": pr})
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
    lines = [f"calibration: {cal.path}",
             f"  profile [{cal.profile['status']}] {cal.profile['recipe']} {' '.join(cal.profile['overrides'])} on "
             f"{cal.hardware}: step {cal.profile['step_ms']} ms; {cal.profile['source']}"]
    for k, a in cal.assumptions.items():
        lines.append(f"  {k} = {a['value']} [{a['status']}] {a['source']}")
    r = _rates(cal)
    lines.append(f"  derived on {cal.hardware}: expert GEMMs at {r.eta_exp:.1%} of peak, other GEMMs {r.eta_mm:.1%}, "
                 f"attention (causal FLOPs) {r.eta_attn:.1%}; elementwise {r.ew_bytes_per_elem:.2f} B per activation "
                 f"element; optimizer {r.opt_bytes_per_param:.1f} B/param; FSDP copies {r.fsdp_bytes_per_param:.1f} B/param")
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


# ------------------------------------------------------------------------------------ report

REPORT_RECIPES = (("h200_8gpu_ep8", "H200"), ("b200_multinode", "B200"), ("b200_multinode", "GB200-NVL72"),
                  ("mi300x_multinode", "MI300X"))
PLOT_RECIPES = (("h200_8gpu_ep8", "H200"), ("b200_multinode", "B200"), ("mi300x_multinode", "MI300X"))
WIDE_RECIPES = PLOT_RECIPES + (("b200_multinode", "GB200-NVL72"),)
WIDE_VARIANTS = (("per_slot", None), ("rank_dedup", None), ("rank_dedup", 4), ("node_dedup", 4))


def format_checks(rows: list[dict]) -> list[str]:
    out = ["| point | use | device | GPUs | EP | tokens/GPU | measured ms | projected ms | error | "
           "measured tok/s/GPU | projected | measured MFU | projected MFU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mm = "-" if r["measured_mfu"] is None else f"{100 * r['measured_mfu']:.1f}%"
        out.append(f"| {r['id']} | {r['use']} | {r['hardware']} | {r['gpus']} | {r['ep']} | {r['tokens_per_gpu']} | "
                   f"{r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {100 * r['error']:+.1f}% | "
                   f"{r['measured_tps']:,.0f} | {r['predicted_tps']:,.0f} | {mm} | {100 * r['predicted_mfu']:.1f}% |")
    return out


def format_scaling(recipe: str, hardware: str, cal: Calibration) -> list[str]:
    rows = scaling_rows(recipe, hardware, cal)
    by = {(p.scenario.gpus, p.scenario.preset): p for p in rows}
    presets = list(PRESETS)
    out = [f"{recipe} on {hardware} (recipe layout: EP={rows[0].scenario.ep} inside a node, FSDP2 data parallel "
           f"across nodes), projected tokens/s/GPU and MFU, largest category:",
           "| GPUs | " + " | ".join(presets) + " | largest: reference -> fused+overlap | grew most since the "
           "first row: reference / fused+overlap |",
           "|---|" + "---|" * (len(presets) + 2)]
    first = min(p.scenario.gpus for p in rows)
    for G in GPU_COUNTS:
        if (G, presets[0]) not in by:
            continue
        cells = [f"{by[(G, p)].tokens_per_s_per_gpu / 1e3:.1f}k {100 * by[(G, p)].mfu:.1f}%" for p in presets]
        ref, best = by[(G, "reference")], by[(G, "fused+overlap")]
        out.append(f"| {G} | " + " | ".join(cells) +
                   f" | {ref.bottleneck} ({ref.phases_ms[ref.bottleneck]:.0f} ms) -> "
                   f"{best.bottleneck} ({best.phases_ms[best.bottleneck]:.0f} ms) | "
                   f"{_growth(by[(first, 'reference')], ref)} / {_growth(by[(first, 'fused+overlap')], best)} |")
    return out


def _growth(base: Projection, p: Projection) -> str:
    """The category whose time grew most from ``base`` to ``p`` ("-" if the step grew < 2%)."""
    if p.step_ms < 1.02 * base.step_ms:
        return "-"
    k = max(p.phases_ms, key=lambda c: p.phases_ms[c] - base.phases_ms[c])
    return f"{k} +{p.phases_ms[k] - base.phases_ms[k]:.0f} ms"


def format_wide(recipe: str, hardware: str, cal: Calibration, gpus=(16, 64, 256)) -> list[str]:
    cfg = load_recipe(recipe)
    E = cfg.model.moe.num_experts
    out = [f"{recipe} on {hardware}, wide EP (ep = min(G, E={E}) across nodes): exchange per step by traffic design",
           "| GPUs | EP | traffic | node limit M | NIC rows/token | link GB/step | link ms/step | MFU fused | MFU fused+overlap |",
           "|---|---|---|---|---|---|---|---|---|"]
    for G in gpus:
        ep = math.gcd(G, E)
        for kind, M in WIDE_VARIANTS:
            a = project(cfg, Scenario(hardware, G, ep, "fused", traffic=kind, node_limit=M), cal)
            b = project(cfg, Scenario(hardware, G, ep, "fused+overlap", traffic=kind, node_limit=M), cal)
            out.append(f"| {G} | {ep} | {kind} | {M or '-'} | {a.detail['rows_per_token_inter']:.2f} | "
                       f"{a.exchange_gb:.1f} | {a.detail['exchange_link_ms']:.0f} | {100 * a.mfu:.1f}% | {100 * b.mfu:.1f}% |")
    return out


def plot_projection(cal: Calibration, path: str, measured: Optional[list] = None) -> None:
    """MFU and tokens/s/GPU against GPU count for ``PLOT_RECIPES`` (lines: projected; markers:
    measured points of ``check_measurements``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"reference": ("--", "reference (NCCL all-to-all, separate ops)"),
              "dedup": (":", "dedup exchange (today's symm path)"),
              "fused+overlap": ("-", "fused pipeline + dedup + overlap")}
    colors = {"H200": "tab:green", "B200": "tab:blue", "MI300X": "tab:red"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for recipe, hw in PLOT_RECIPES:
        rows = scaling_rows(recipe, hw, cal, presets=tuple(styles))
        for preset, (ls, label) in styles.items():
            pts = [p for p in rows if p.scenario.preset == preset]
            xs = [p.scenario.gpus for p in pts]
            kw = dict(ls=ls, color=colors[hw], lw=1.6, label=f"{hw} {recipe}: {label}")
            ax1.plot(xs, [100 * p.mfu for p in pts], **kw)
            ax2.plot(xs, [p.tokens_per_s_per_gpu / 1e3 for p in pts], **kw)
    for r in measured or []:
        for ax, y, yp in ((ax1, 100 * (r["measured_mfu"] or 0), 100 * r["predicted_mfu"]),
                          (ax2, r["measured_tps"] / 1e3, r["predicted_tps"] / 1e3)):
            ax.plot([r["gpus"]], [y], "o", color="black", ms=5)
            ax.plot([r["gpus"]], [yp], "x", color="black", ms=6)
    if measured:
        ax1.plot([], [], "o", color="black", ms=5, label="measured, 1-2 x H200 (h200_1gpu model: 8 layers, 16k-32k tok/GPU)")
        ax1.plot([], [], "x", color="black", ms=6, label="projected at the measured points")
    for ax, yl in ((ax1, "MFU (%)"), (ax2, "tokens/s per GPU (thousands)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(yl)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax1.set_title("projected (lines) and measured (dots)", fontsize=10)
    ax2.set_title("weak scaling, recipe layout (EP=8 per node, FSDP2 across)", fontsize=10)
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.24, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def project_main(args) -> int:
    """``bench/scaling.py --project``: assumptions, measured vs projected, scaling tables, plot."""
    cal = load_calibration(args.calibration)
    extra = [row for p in args.measured for row in measured_from_harness(p)]
    print("# Scaling projection (bench/scaling_model.py): every number below is PROJECTED unless marked measured\n")
    print("\n".join(describe_assumptions(cal)))
    checks = check_measurements(cal, extra)
    print("\n## Measured vs projected step time ('calibration' points are model inputs; 'check' points are "
          "predicted without being fitted)\n")
    print("\n".join(format_checks(checks)))
    for r in checks:
        if "phases_ms" in next((m for m in extra if m["id"] == r["id"]), {}):
            meas = next(m for m in extra if m["id"] == r["id"])["phases_ms"]
            print(f"\n{r['id']}: measured phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(meas.items())))
            print(f"{r['id']}: projected categories (ms): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["projection"].phases_ms.items()))
    for recipe, hw in REPORT_RECIPES:
        print()
        print("\n".join(format_scaling(recipe, hw, cal)))
    for recipe, hw in WIDE_RECIPES:
        print()
        print("\n".join(format_wide(recipe, hw, cal)))
    if args.plot:
        plot_projection(cal, args.plot, [r for r in checks if r["use"] in ("check", "calibration")])
        print(f"\nwrote {args.plot}")
    if args.json:
        out = {"checks": [{k: v for k, v in r.items() if k != "projection"} for r in checks],
               "scaling": [_projection_dict(p) for rec, hw in REPORT_RECIPES for p in scaling_rows(rec, hw, cal)]}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


def _projection_dict(p: Projection) -> dict:
    from dataclasses import asdict
    d = asdict(p)
    d["bottleneck"] = p.bottleneck
    return d
