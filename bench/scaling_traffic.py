"""Token-exchange traffic of the scaling projection (``bench/scaling_model.py``): the rows one token
sends per exchange op over each leg -- the scale-up fabric (NVLink / xGMI, "nvlink" below) and the
scale-out NIC -- for the three exchange designs, from the routing's hit probabilities.

Legend: E experts, K top-k, ep ranks of the EP group, g of them per node (scale-up domain),
n = ep / g nodes, e = E / ep experts per rank. Experts are laid out contiguously as MoELayer shards
them and torchrun numbers ranks: rank r holds experts [r·e, (r+1)·e), node b the ranks
[b·g, (b+1)·g). Rank (b, i) is local index i of node b.

Hit probabilities, for each rank j and node b:
    p_rank[j] = P(rank j holds >= 1 of a token's K experts),  p_node[b] = P(node b holds >= 1)
  * uniform top-K over the E experts (no group limit), exact:
        p_rank = 1 - C(E - e, K) / C(E, K),   p_node = 1 - C(E - g·e, K) / C(E, K)
  * group-limited routing (``n_group`` contiguous groups, ``topk_group`` of them per token, a group
    scoring the sum of its top-2 selection scores): the router's own rule
    (``tlx_dist.router.group_limited_topk``) applied to seeded i.i.d. standard-normal logits
    through the recipe's score function, hits counted over ``MC_TOKENS`` tokens -- a seeded Monte
    Carlo, so the projection stays a deterministic function of its inputs. (The i.i.d. logits are
    the balanced-routing assumption A5; within the chosen groups the router's top-K is *not* a
    uniform draw: every chosen group holds its own top-2, which is why the closed form of a uniform
    draw from the chosen groups would undercount the nodes reached.)

Rows per token per op, averaged over the source rank s = (a, i) (a rank's rows to itself move nothing):
    per_slot      NCCL all-to-all, one row per (token, k) slot:
                  nvlink  K·(g-1)/ep                      nic  K·(n-1)/n
    rank_dedup    flat symmetric exchange, one row per (token, destination rank):
                  nvlink  sum_{j in a, j != s} p_rank[j]  nic  sum_{j not in a} p_rank[j]
    node_dedup    hierarchical (DeepEP normal mode, Hybrid-EP): one row per (token, destination
                  node) over the NIC to the rank of the same local index there, which forwards it
                  over NVLink to that node's other ranks holding one of its experts:
                  nvlink  sum_{j in a, j != s} p_rank[j] + sum_{b != a} sum_{j in b, j != (b, i)} p_rank[j]
                  nic     sum_{b != a} p_node[b]
Combine mirrors dispatch row for row (partial sums reduced inside the node first, one row per
(token, node) back), and the backward ops mirror the forward ones, so the four ops of a layer move
the same rows. One node (n = 1) makes node_dedup identical to rank_dedup; node_dedup never moves
more NIC rows than rank_dedup (a node is hit at most as often as the sum of its ranks).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["TRAFFIC", "MC_TOKENS", "MC_SEED", "Routing", "Legs", "hit_probabilities", "exchange_rows",
           "ranks_per_node"]

TRAFFIC = ("per_slot", "rank_dedup", "node_dedup")
MC_TOKENS = 1 << 16     # standard error of a hit probability <= 0.5 / 256 = 0.002
MC_SEED = 0


@dataclass(frozen=True)
class Routing:
    """How tokens pick experts: ``n_group`` contiguous expert groups of which a token may use its
    ``topk_group`` best (None: all, i.e. plain top-K), scores ``score_func`` ("softmax" | "sigmoid")."""

    n_group: int = 1
    topk_group: Optional[int] = None
    score_func: str = "softmax"

    @property
    def limited(self) -> bool:
        return self.n_group > 1 and self.topk_group is not None and self.topk_group < self.n_group

    @classmethod
    def of(cls, moe) -> "Routing":
        """The routing of a ``tlx_dist.MoEConfig``."""
        return cls(moe.n_group, moe.topk_group, moe.score_func)


@dataclass(frozen=True)
class Legs:
    """Expected rows one token sends per exchange op: ``nvlink`` over the scale-up fabric (incl. the
    hierarchical forward), ``nic`` over the NIC; ``peers_nvlink`` distinct scale-up peers a rank
    sends to (for point-to-point meshes); ``nodes_hit`` expected distinct nodes a token reaches
    (its own included); ``nvlink_forward`` the part of ``nvlink`` forwarded by a landing rank
    (hierarchical only)."""

    nvlink: float
    nic: float
    peers_nvlink: int
    nodes_hit: float
    nvlink_forward: float = 0.0


def ranks_per_node(ep: int, domain: int) -> int:
    """Ranks of an EP group inside one scale-up domain: ep if it fits, else the largest divisor of
    ep that does (EP groups are laid out domain by domain, as torchrun numbers ranks)."""
    if ep <= domain:
        return ep
    return max(d for d in range(1, domain + 1) if ep % d == 0)


def _check(E: int, K: int, ep: int, g: int, routing: Routing) -> None:
    for name, v in (("num_experts", E), ("top_k", K), ("ep", ep), ("ranks_per_node", g)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if E % ep:
        raise ValueError(f"ep={ep} must be a positive divisor of num_experts={E}")
    if ep % g:
        raise ValueError(f"ranks_per_node={g} must divide ep={ep}")
    if K > E:
        raise ValueError(f"top_k={K} must be in [1, num_experts={E}]")
    if routing.score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func={routing.score_func!r} must be 'softmax' or 'sigmoid'")
    if not isinstance(routing.n_group, int) or routing.n_group < 1 or E % routing.n_group:
        raise ValueError(f"n_group={routing.n_group!r} must be a positive divisor of num_experts={E}")
    if routing.topk_group is not None:
        tg = routing.topk_group
        if not isinstance(tg, int) or not 1 <= tg <= routing.n_group:
            raise ValueError(f"topk_group={tg!r} must be an integer in [1, n_group={routing.n_group}] or None")
        if tg * (E // routing.n_group) < K:
            raise ValueError(f"topk_group={tg} leaves {tg * (E // routing.n_group)} experts for top_k={K}")


def hit_probabilities(E: int, K: int, ep: int, g: int, routing: Routing = Routing()) -> tuple[tuple, tuple]:
    """``(p_rank, p_node)``: per rank (ep entries) and per node (ep / g entries) the probability that
    a token picks at least one of its experts (module docstring: exact without a group limit, the
    router's rule on seeded logits with one)."""
    _check(E, K, ep, g, routing)
    if not routing.limited:
        e = E // ep
        p_r = 1.0 - math.comb(E - e, K) / math.comb(E, K)
        p_n = 1.0 - math.comb(E - g * e, K) / math.comb(E, K)
        return (p_r,) * ep, (p_n,) * (ep // g)
    return _router_hits(E, K, ep, g, routing.n_group, routing.topk_group, routing.score_func)


@functools.lru_cache(maxsize=256)
def _router_hits(E: int, K: int, ep: int, g: int, n_group: int, topk_group: int, score_func: str):
    import torch

    from tlx_dist.router import group_limited_topk
    gen = torch.Generator().manual_seed(MC_SEED)
    e = E // ep
    hits_r = torch.zeros(ep, dtype=torch.float64)
    hits_n = torch.zeros(ep // g, dtype=torch.float64)
    done, chunk = 0, 8192
    while done < MC_TOKENS:
        t = min(chunk, MC_TOKENS - done)
        logits = torch.randn(t, E, generator=gen)
        scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        idx = group_limited_topk(scores, n_group, topk_group, K)
        rank = torch.zeros(t, ep, dtype=torch.bool).scatter_(1, idx // e, True)
        node = torch.zeros(t, ep // g, dtype=torch.bool).scatter_(1, idx // (g * e), True)
        hits_r += rank.sum(0, dtype=torch.float64)
        hits_n += node.sum(0, dtype=torch.float64)
        done += t
    return tuple((hits_r / MC_TOKENS).tolist()), tuple((hits_n / MC_TOKENS).tolist())


def exchange_rows(kind: str, E: int, K: int, ep: int, g: int, routing: Routing = Routing()) -> Legs:
    """Expected rows per token per op of exchange design ``kind`` (``TRAFFIC``; module docstring)
    for an EP group of ``ep`` ranks, ``g`` per node."""
    if kind not in TRAFFIC:
        raise ValueError(f"traffic={kind!r} must be one of {TRAFFIC}")
    p_rank, p_node = hit_probabilities(E, K, ep, g, routing)
    n = ep // g
    nodes_hit = float(sum(p_node))
    if ep == 1:
        return Legs(0.0, 0.0, 0, nodes_hit)
    if kind == "per_slot":
        return Legs(K * (g - 1) / ep, K * (n - 1) / n, g - 1, nodes_hit)
    nv = nic = fwd = 0.0
    for s in range(ep):   # average over the source rank (equal for symmetric routings)
        a, i = divmod(s, g)
        own = sum(p_rank[a * g + j] for j in range(g) if j != i)
        remote_ranks = sum(p_rank[b * g + j] for b in range(n) if b != a for j in range(g))
        if kind == "rank_dedup":
            nv += own
            nic += remote_ranks
        else:
            forward = sum(p_rank[b * g + j] for b in range(n) if b != a for j in range(g) if j != i)
            nv += own + forward
            fwd += forward
            nic += sum(p_node[b] for b in range(n) if b != a)
    return Legs(nv / ep, nic / ep, g - 1, nodes_hit, fwd / ep)
