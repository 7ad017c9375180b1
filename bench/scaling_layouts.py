"""Parameter layouts of the scaling projection (``bench/scaling_model.py``): who holds which
parameters, which collectives move their weights and gradients per micro-batch and per optimizer
step, over which link, and how much of that the backward hides.

Legend: G GPUs, s GPUs per node (the largest divisor of G that fits the scale-up domain), ep the
expert-parallel degree (EP groups of ep consecutive ranks), EDP = G / ep the expert-data-parallel
group (ranks holding the same experts), A = ``grad_accum`` micro-batches per optimizer step.
Parameter sets (global counts, ``Workload``): dense P_d = attention, norms, embedding, head, dense
FFN layers (FSDP2 units: one per block + the root); MoE P_m = per MoE layer the experts (E/ep of
them on a rank) and the router + shared experts (replicated over ep).

Shardings (``parallel.sharding``; ``train/mesh.py`` builds the meshes, ``train/parallelize.py``
``set_gradient_sync`` the micro-batch rule):
  full    FSDP2 over every data-parallel rank: the dense units over all G ranks, each MoE layer's
          module (its E/ep experts, router, shared experts) over EDP -- across the NICs as soon as
          the job leaves the node. Every micro-batch all-gathers the bf16 weights in forward and
          again in backward (resharded after forward); the gradients are reduce-scattered on the
          last micro-batch only (``set_requires_gradient_sync(False)`` before it).
  hybrid  HSDP: shard inside the node, replicate across nodes. Dense units sharded over the s ranks
          of the node, replicated over G / s nodes; each MoE module sharded over the ranks of its
          EDP group inside the node (s_e = s / ep when ep < s, else 1) and replicated over the
          R_e = EDP / s_e copies on other nodes. Every micro-batch: the in-node all-gathers and
          reduce-scatters (NVLink); the last one also all-reduces each GPU's gradient shard across
          the replicas (NIC) -- ``set_requires_all_reduce(False)`` before it.
Either way, once a step (``finish_grads``): the router / shared-expert gradient shards are summed
over ep, and the rest of the step (norm, optimizer) runs on the shard a GPU holds.
Gradients cross the links in ``parallel.reduce_dtype`` ("float32" | "bfloat16": FSDP2's
``reduce_dtype`` and ``finish_grads``' all-reduce, ``train/parallelize.py``). Under "bfloat16" the
sums over micro-batches stay fp32, which changes two things: a fully sharded unit reduce-scatters
every micro-batch (into its fp32 sharded gradient) instead of the last only, and an HSDP unit's
partial sum of the reduce-scatters is cast to fp32 after each micro-batch but the last
(``detail["partial_sum_params"]``: the elements cast, per GPU). ``detail["accumulation_params"]``:
the fp32 elements a GPU keeps between micro-batches beside its sharded gradient (an HSDP unit's
partial sum of its shard; a fully sharded unit's unsharded gradient while it skips the
reduce-scatter).

Collective times (one unit; bytes S per GPU; link bandwidth B at its efficiency, hop latency a):
  ring all-gather / reduce-scatter over n ranks of an unsharded unit of S bytes:
      S (n - 1) / n / B + (n - 1) a
  all-reduce over R replicas of a shard of S bytes: the cheaper of NCCL's ring and tree,
      min(2 S (R - 1) / R / B + 2 (R - 1) a,  2 S / B + 2 ceil(log2 R) a)
A collective runs over the NIC when its group spans nodes, else over the scale-up fabric.

Overlap rule (FSDP2's prefetch and its reduce-scatter stream): a forward's all-gathers hide behind
the forward's compute, a backward's all-gathers and reduce-scatters (and, on the last micro-batch,
the cross-node all-reduces) behind the backward's compute, each up to the compute's length:
    exposed = max(0, comm - overlappable) + the largest unit's comm
(the first all-gather cannot be prefetched and the last reduction starts after the backward ends;
the largest unit bounds both). ``overlappable`` is the phase's length less the time the token
exchange of that phase keeps the collective's link busy (NIC and exchange share the NIC, NVLink
collectives and the exchange's NVLink leg share NVLink); collectives of one phase are serialized
(FSDP2 issues them on one stream). SM time taken by NCCL kernels from the GEMMs is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SHARDINGS", "REDUCE_BYTES", "Unit", "LayoutPlan", "plan_layout", "node_size", "ring_ag_rs_s", "all_reduce_s",
           "exposed_comm_s"]

SHARDINGS = ("full", "hybrid")     # train.config ParallelConfig.sharding
BF16, FP32 = 2, 4
REDUCE_BYTES = {"float32": FP32, "bfloat16": BF16}   # train.config ParallelConfig.reduce_dtype


def node_size(G: int, domain: int) -> int:
    """GPUs of one node (scale-up domain) that a G-GPU job uses: the largest divisor of G that fits
    (GB200 NVL72: 64 of a rack's 72 GPUs for power-of-two jobs)."""
    return max(d for d in range(1, min(G, domain) + 1) if G % d == 0)


def ring_ag_rs_s(nbytes: float, n: int, bw: float, hop_s: float) -> float:
    """One ring all-gather or reduce-scatter over n ranks of a unit of ``nbytes`` (unsharded)."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / bw + (n - 1) * hop_s


def all_reduce_s(nbytes: float, n: int, bw: float, hop_s: float) -> float:
    """One all-reduce over n ranks of ``nbytes`` per rank: the cheaper of ring and tree."""
    if n <= 1:
        return 0.0
    ring = 2 * nbytes * (n - 1) / n / bw + 2 * (n - 1) * hop_s
    tree = 2 * nbytes / bw + 2 * math.ceil(math.log2(n)) * hop_s
    return min(ring, tree)


@dataclass(frozen=True)
class Unit:
    """One collective of one FSDP2 unit. ``when``: "fwd" / "bwd" (every micro-batch) or "step" (the
    last micro-batch's backward, once per optimizer step) or "post" (after the backward, not
    overlapped). ``link``: "nvlink" | "nic". ``nbytes``: bytes this GPU sends. ``seconds``: time."""

    what: str
    when: str
    link: str
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class LayoutPlan:
    """Where the parameters live and what moves them, per GPU.

    held_params: parameters whose fp32 master, gradient and AdamW state this GPU holds (its shard).
    fsdp_params: parameters FSDP2 manages on a mesh with a shard dimension > 1 (its copies).
    units: every collective (``Unit``). node: GPUs per node. detail: shard and replica sizes,
    ``local_dense`` / ``local_moe`` (parameters on a one-rank shard, kept outside FSDP2 with
    persistent bf16 copies) and ``held_experts``.
    """

    sharding: str
    node: int
    held_params: float
    fsdp_params: float
    units: tuple
    detail: dict = field(default_factory=dict)

    def comm_s(self, when: str, link: str = "") -> float:
        return sum(u.seconds for u in self.units if u.when == when and (not link or u.link == link))

    def bytes_per_step(self, link: str, grad_accum: int) -> float:
        """Bytes this GPU sends over ``link`` per optimizer step of ``grad_accum`` micro-batches."""
        per = {"fwd": grad_accum, "bwd": grad_accum, "step": 1, "post": 1}
        return sum(u.nbytes * per[u.when] for u in self.units if u.link == link)


def plan_layout(sharding: str, G: int, ep: int, domain: int, params: dict, bw: dict, hop: dict,
                reduce_dtype: str = "float32") -> LayoutPlan:
    """The collectives of ``sharding`` (module docstring) for G GPUs, EP degree ``ep``.

    params: {"dense_units": [params of each dense unit], "moe_layers": L_moe, "experts": all routed
    expert parameters, "replicated": router + shared experts of all MoE layers}. bw / hop:
    {"nvlink": bytes/s, "nic": bytes/s} per GPU at link efficiency / hop latencies in seconds.
    reduce_dtype: a ``REDUCE_BYTES`` key, the dtype gradients are communicated in.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} must be one of {SHARDINGS}")
    if reduce_dtype not in REDUCE_BYTES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} must be one of {tuple(REDUCE_BYTES)}")
    RED = REDUCE_BYTES[reduce_dtype]
    hybrid = sharding == "hybrid"
    rs_every = hybrid or RED == BF16   # reduce-scatter every micro-batch: HSDP, and bf16 (fp32 sums)
    if G % ep:
        raise ValueError(f"gpus={G} must be a multiple of ep={ep}")
    s = node_size(G, domain)
    if ep > s and ep % s:
        raise ValueError(f"ep={ep} spans nodes of {s} GPUs unevenly")
    edp, Lm = G // ep, params["moe_layers"]
    dense_units = list(params["dense_units"])
    moe_layer = params["experts"] / ep / Lm + params["replicated"] / Lm   # one MoE module on one rank
    units: list[Unit] = []
    kept = {"partial": 0.0, "all": 0.0}   # elements kept between micro-batches: HSDP partial sums / all
    # (shard ranks, do they span nodes, replicas across nodes) of the dense and the MoE meshes
    if hybrid:
        dense_mesh = (s, False, G // s)
        s_e = s // ep if ep < s else 1
        moe_mesh = (s_e, False, edp // s_e)
    else:
        dense_mesh = (G, G > s, 1)
        moe_mesh = (edp, G > s, 1)

    def unit(what: str, p: float, mesh: tuple) -> None:
        """One FSDP2 unit of p parameters: bf16 all-gathers in forward and backward (every
        micro-batch), the gradient reduce-scatter (every micro-batch under HSDP, whose no-sync
        micro-batches skip only the all-reduce, and under bf16 reduction; else the last one only),
        and under HSDP the all-reduce of the shard across the replicas (the last micro-batch)."""
        n, spans, R = mesh
        if n > 1:
            ln = "nic" if spans else "nvlink"
            for when, nbytes in (("fwd", BF16 * p), ("bwd", BF16 * p), ("bwd" if rs_every else "step", RED * p)):
                units.append(Unit(what, when, ln, nbytes * (n - 1) / n, ring_ag_rs_s(nbytes, n, bw[ln], hop[ln])))
            if not rs_every:
                kept["all"] += p
        if R > 1:
            kept["partial"] += p / n
            kept["all"] += p / n
            shard = RED * p / n
            units.append(Unit(f"{what} all-reduce across nodes", "step", "nic", 2 * shard * (R - 1) / R,
                              all_reduce_s(shard, R, bw["nic"], hop["nic"])))

    for p in dense_units:
        unit("dense", p, dense_mesh)
    for _ in range(Lm):
        unit("moe", moe_layer, moe_mesh)
    n_moe = moe_mesh[0]
    if ep > 1:   # finish_grads: the router / shared-expert gradient shards summed over ep, once a step
        ln = "nic" if ep > s else "nvlink"
        shard = RED * params["replicated"] / n_moe
        units.append(Unit("router/shared all-reduce over ep", "post", ln, 2 * shard * (ep - 1) / ep,
                          all_reduce_s(shard, ep, bw[ln], hop[ln])))
    dense_p = sum(dense_units)
    held = dense_p / dense_mesh[0] + Lm * moe_layer / n_moe
    # FSDP2 manages every parameter of a mesh of more than one rank; one-rank meshes stay outside it
    # (train/parallelize.py: W = 1 for the dense units, dp = 1 for the MoE layers)
    fsdp_p = (dense_p if G > 1 else 0.0) + (Lm * moe_layer if edp > 1 else 0.0)
    return LayoutPlan(sharding, s, held, fsdp_p, tuple(units), {
        "dense_shard": dense_mesh[0], "expert_shard": n_moe, "dense_replicas": dense_mesh[2],
        "expert_replicas": moe_mesh[2], "local_dense": 0.0 if G > 1 else dense_p,
        "local_moe": 0.0 if edp > 1 else Lm * moe_layer, "held_experts": params["experts"] / ep / n_moe,
        "reduce_scatter_every_micro_batch": rs_every, "partial_sum_params": kept["partial"], "accumulation_params": kept["all"],
        "reduce_dtype": reduce_dtype})


def exposed_comm_s(plan: LayoutPlan, grad_accum: int, fwd_s: float, bwd_s: float, busy_fwd: dict,
                   busy_bwd: dict) -> dict:
    """Exposed collective seconds per optimizer step (module docstring's overlap rule).

    fwd_s / bwd_s: length of one micro-batch's forward / backward (compute + exposed exchange).
    busy_fwd / busy_bwd: {"nvlink": s, "nic": s} the token exchange keeps each link busy in them.
    Returns {"fwd", "bwd", "last_bwd", "post", "total", "comm"} seconds per optimizer step."""
    def window(phase_s: float, when: tuple, busy: dict) -> float:
        links = {u.link for u in plan.units if u.when in when}
        return max(0.0, phase_s - max((busy.get(ln, 0.0) for ln in links), default=0.0))

    def exposed(comm: float, win: float, largest: float) -> float:
        return max(0.0, comm - win) + largest if comm > 0 else 0.0

    def largest(when: tuple) -> float:
        return max((u.seconds for u in plan.units if u.when in when), default=0.0)

    c_f, c_b, c_s = plan.comm_s("fwd"), plan.comm_s("bwd"), plan.comm_s("step")
    e_f = exposed(c_f, window(fwd_s, ("fwd",), busy_fwd), largest(("fwd",)))
    e_b = exposed(c_b, window(bwd_s, ("bwd",), busy_bwd), largest(("bwd",)))
    e_last = exposed(c_b + c_s, window(bwd_s, ("bwd", "step"), busy_bwd), largest(("bwd", "step")))
    post = plan.comm_s("post")
    A = grad_accum
    total = A * e_f + (A - 1) * e_b + e_last + post
    return {"fwd": A * e_f, "bwd": (A - 1) * e_b, "last_bwd": e_last, "post": post, "total": total,
            "comm": A * (c_f + c_b) + c_s + post}
