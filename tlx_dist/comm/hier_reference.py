"""Pure-PyTorch reference of the hierarchical (per-node) token exchange: the test oracle of the
hierarchical kernels and the documentation of what each leg moves.

Legend: W ranks in N nodes of L ranks (group rank v is local rank ``v % L`` of node ``v // L``), E
global experts, e = E/W local experts (rank d owns experts [d*e, (d+1)*e)), K top-k, T tokens of
a rank, D hidden.

**Dispatch.** Token t of source s = (n, l) reaches the nodes that own at least one of its experts.
  * inter-node leg: one row per (token, destination node m != n) to the *relay* (m, l), the rank
    of node m with the source's local index, with the token's k-slots on node m;
  * intra-node leg: every holder of a row -- the source itself for its own node, the relay for
    node m -- stores it once into each other rank of the node that owns one of its experts. A
    holder that owns one itself keeps its copy (no transfer).
Each rank then holds one row per (source, token) routed to it -- the flat exchange's receive
rows -- and expands them expert-major, exactly as :func:`tlx_dist.comm.emulated.reference_dispatch`.

**Combine** (the reverse): owner j sums ``gate * y`` over its slots of a token (products in the
activation dtype, fp32 accumulation in slot order, one rounding): its *partial row*. A partial row
for a source on j's node goes straight to the source; one for a source s = (n, l) on another node
goes to the relay (node(j), l), which sums the partial rows of its node's owners (fp32, in local
rank order, one rounding) and sends one row per (token, node) back over the inter-node leg. The
source sums the partial rows of its node's owners and the relays' rows (fp32, in rank order, the
relay's row at the relay's rank, one rounding). fp64 rows accumulate in fp64.

The counts are per op and per rank: rows a rank *sends* over each leg (a kept copy is no
transfer), and their payload bytes (``rows * D * itemsize``; metadata, gates and signals are not
counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["LegCounts", "HierDispatchRef", "hier_dispatch_reference", "hier_combine_reference",
           "destination_nodes", "check_hier_topology"]


def check_hier_topology(world_size: int, ranks_per_node: int) -> int:
    """Number of nodes N; ValueError unless W ranks split into equal nodes of ``ranks_per_node``."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive integer")
    if world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the world size {world_size}")
    return world_size // ranks_per_node


@dataclass(frozen=True)
class LegCounts:
    """Rows each rank sends over each leg in one op. ``nic_rows_W`` / ``nvl_rows_W``: int64
    ``[W]`` rows rank s put on the inter-node leg / stored into another rank of its node;
    ``row_bytes``: payload bytes of one row (``D * itemsize``)."""

    nic_rows_W: torch.Tensor
    nvl_rows_W: torch.Tensor
    row_bytes: int

    @property
    def nic_bytes_W(self) -> torch.Tensor:
        return self.nic_rows_W * self.row_bytes

    @property
    def nvl_bytes_W(self) -> torch.Tensor:
        return self.nvl_rows_W * self.row_bytes


def destination_nodes(idx_TK: torch.Tensor, num_experts: int, world_size: int, ranks_per_node: int) -> torch.Tensor:
    """``[T, N]`` bool: whether token t has an expert on node m."""
    N = check_hier_topology(world_size, ranks_per_node)
    e = num_experts // world_size
    node_TK = idx_TK.long() // (e * ranks_per_node)
    return (node_TK[:, :, None] == torch.arange(N, device=idx_TK.device)).any(1)


def _dest_ranks(idx_TK: torch.Tensor, e: int, W: int) -> torch.Tensor:
    """``[T, W]`` bool: whether token t has an expert on rank d."""
    return ((idx_TK.long() // e)[:, :, None] == torch.arange(W, device=idx_TK.device)).any(1)


def _check(xs_TD: Sequence[torch.Tensor], idxs_TK: Sequence[torch.Tensor], num_experts: int, ranks_per_node: int):
    W = len(xs_TD)
    if W == 0 or len(idxs_TK) != W:
        raise ValueError(f"need one x_TD and one idx_TK per rank, got {len(xs_TD)} and {len(idxs_TK)}")
    N = check_hier_topology(W, ranks_per_node)
    if num_experts % W:
        raise ValueError(f"num_experts={num_experts} is not divisible by the world size {W}")
    for s, (x, idx) in enumerate(zip(xs_TD, idxs_TK)):
        if x.dim() != 2 or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
            raise ValueError(f"rank {s}: x_TD {tuple(x.shape)} and idx_TK {tuple(idx.shape)} must be [T, D] and [T, K]")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):
            raise ValueError(f"rank {s}: idx_TK holds expert ids outside [0, {num_experts})")
    return W, N, num_experts // W


@dataclass(frozen=True)
class HierDispatchRef:
    """What :func:`hier_dispatch_reference` returns.

    recv: per rank d, ``(rows_nD, counts_e)``: its expert-major rows (local expert, then source
        rank, then source slot) and rows per local expert -- equal to ``reference_dispatch``'s.
    relay_rows: per relay r, ``{source s: [n] int64 token ids}``: the inter-node rows r got (token
        order), for every source s on another node.
    held_rows: per rank d, ``{source s: [n] int64 token ids}``: the rows it holds per source after
        the intra-node leg (token order) -- the flat exchange's receive rows.
    counts: :class:`LegCounts` of the op.
    """

    recv: list
    relay_rows: list
    held_rows: list
    counts: LegCounts


def hier_dispatch_reference(xs_TD: Sequence[torch.Tensor], idxs_TK: Sequence[torch.Tensor], num_experts: int,
                            ranks_per_node: int) -> HierDispatchRef:
    """Runs the two legs on per-rank lists (``xs_TD[s]`` ``[T_s, D]``, ``idxs_TK[s]`` ``[T_s, K]``
    int) and returns the rows every rank ends with, the relays' rows and the per-leg counts. Rows
    are copied leg by leg (source -> relay buffer -> holder buffer -> expert-major), so a row that
    a leg drops or duplicates changes the result."""
    W, N, e = _check(xs_TD, idxs_TK, num_experts, ranks_per_node)
    L = ranks_per_node
    dev = xs_TD[0].device
    nic = torch.zeros(W, dtype=torch.int64)
    nvl = torch.zeros(W, dtype=torch.int64)
    to_rank = [_dest_ranks(idx, e, W) for idx in idxs_TK]
    to_node = [destination_nodes(idx, num_experts, W, L) for idx in idxs_TK]
    # Inter-node leg: relay (m, l) gets one row per token of source (n, l) that reaches node m != n.
    relay_rows = [dict() for _ in range(W)]
    relay_buf = [dict() for _ in range(W)]  # relay -> source -> the rows as they landed
    for s in range(W):
        n, l = divmod(s, L)
        for m in range(N):
            if m == n:
                continue
            tok = torch.nonzero(to_node[s][:, m]).flatten()
            r = m * L + l
            relay_rows[r][s] = tok
            relay_buf[r][s] = xs_TD[s].index_select(0, tok.to(dev)).clone()
            nic[s] += tok.numel()
    # Intra-node leg: the holder of (s, tokens) for node m -- s itself for its own node, else the relay --
    # stores each row once into every other rank of node m that owns one of its experts.
    held = [dict() for _ in range(W)]  # holder d -> source -> (token ids, rows)
    for m in range(N):
        for s in range(W):
            n, l = divmod(s, L)
            if n == m:
                holder = s
                tok = torch.nonzero(to_node[s][:, m]).flatten()
                rows = xs_TD[s].index_select(0, tok.to(dev))
            else:
                holder = m * L + l
                tok, rows = relay_rows[holder][s], relay_buf[holder][s]
            for i in range(L):
                d = m * L + i
                want = to_rank[s][tok, d]
                if not want.any():
                    continue
                got_tok, got_rows = tok[want], rows[want.to(dev)]
                if d != holder:
                    got_rows = got_rows.clone()  # an NVLink store
                    nvl[holder] += got_tok.numel()
                if s in held[d]:
                    raise RuntimeError(f"hier reference: rank {d} got source {s}'s rows twice")
                held[d][s] = (got_tok, got_rows)
    # Expert-major on every rank, from the rows it holds.
    recv = []
    for d in range(W):
        rows_out = []
        counts = torch.zeros(e, dtype=torch.int64)
        for j in range(e):
            g = d * e + j
            for s in range(W):
                idx = idxs_TK[s]
                t_sel = torch.nonzero(idx.long() == g)[:, 0]  # the token of each slot for g, in slot order
                if t_sel.numel() == 0:
                    continue
                tok, rows = held[d].get(s, (torch.zeros(0, dtype=torch.long), None))
                pos = torch.searchsorted(tok, t_sel)
                found = rows is not None and bool((pos < tok.numel()).all()) and torch.equal(tok[pos], t_sel)
                if not found:
                    raise RuntimeError(f"hier reference: rank {d} lacks a row of source {s} for expert {g}")
                rows_out.append(rows.index_select(0, pos.to(dev)))
                counts[j] += t_sel.numel()
        D = xs_TD[0].shape[1]
        recv.append((torch.cat(rows_out) if rows_out else xs_TD[0].new_zeros(0, D), counts))
    held_tok = [{s: v[0] for s, v in sorted(h.items())} for h in held]
    row_bytes = xs_TD[0].shape[1] * xs_TD[0].element_size()
    return HierDispatchRef(recv, relay_rows, held_tok, LegCounts(nic, nvl, row_bytes))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def hier_combine_reference(ys_ND: Sequence[torch.Tensor], idxs_TK: Sequence[torch.Tensor],
                           gates_TK: Optional[Sequence[torch.Tensor]], num_experts: int,
                           ranks_per_node: int) -> tuple[list, LegCounts]:
    """The combine of expert-major rows ``ys_ND[d]`` (rank d's rows in :func:`hier_dispatch_reference`'s
    order) back to their sources: returns per source s ``out_TD[t] = sum_k gate[t, k] * y[slot (t, k)]``
    summed as the hierarchical exchange sums it (see the module docstring; ``gates_TK=None``: no
    gates, the backward of dispatch), and the op's :class:`LegCounts` (partial rows over NVLink,
    one row per (token, remote node) over the inter-node leg)."""
    W = len(ys_ND)
    N = check_hier_topology(W, ranks_per_node)
    if len(idxs_TK) != W or (gates_TK is not None and len(gates_TK) != W):
        raise ValueError("need one idx_TK (and gate_TK) per rank")
    if num_experts % W:
        raise ValueError(f"num_experts={num_experts} is not divisible by the world size {W}")
    L, e = ranks_per_node, num_experts // W
    dtype, dev, D = ys_ND[0].dtype, ys_ND[0].device, ys_ND[0].shape[1]
    acc = _acc(dtype)
    # Row of slot (s, t, k) in the expert-major rows of its owner: expert-major, then source, then slot.
    slot_row = [torch.full(i.shape, -1, dtype=torch.long) for i in idxs_TK]
    for d in range(W):
        r = 0
        for j in range(e):
            g = d * e + j
            for s in range(W):
                hit = idxs_TK[s].long() == g
                n = int(hit.sum())
                slot_row[s][hit] = torch.arange(r, r + n)  # boolean indexing walks (t, k) in slot order
                r += n
        if ys_ND[d].shape[0] < r:
            raise ValueError(f"ys_ND[{d}] has {ys_ND[d].shape[0]} rows, the dispatch gave it {r}")
    nic = torch.zeros(W, dtype=torch.int64)
    nvl = torch.zeros(W, dtype=torch.int64)
    outs = []
    for s in range(W):
        n_s, l = divmod(s, L)
        idx = idxs_TK[s].long()
        T, K = idx.shape
        owner_TK = idx // e
        # Partial row of owner d for every token (zero where t has no slot on d), and where it goes.
        part = {}
        for d in range(W):
            mine = owner_TK == d
            if not mine.any():
                continue
            p = torch.zeros(T, D, dtype=acc, device=dev)
            for k in range(K):  # slot order: the kernels sum k = 0, 1, ...
                sel = torch.nonzero(mine[:, k]).flatten()
                if sel.numel() == 0:
                    continue
                y = ys_ND[d].index_select(0, slot_row[s][sel, k].to(dev))
                if gates_TK is not None:
                    y = (y.to(acc) * gates_TK[s][sel, k].to(acc)[:, None].to(dev)).to(dtype)
                p[sel.to(dev)] += y.to(acc)
            part[d] = (mine.any(1), p.to(dtype))
        out = torch.zeros(T, D, dtype=acc, device=dev)
        for d in range(W):  # the source's sum, in rank order
            m = d // L
            if m == n_s:
                if d in part:
                    has, p = part[d]
                    out[has.to(dev)] += p[has.to(dev)].to(acc)
                    if d != s:
                        nvl[d] += int(has.sum())
            elif d % L == l:  # the relay of node m: its node's partial rows, summed in local order
                reach = torch.zeros(T, dtype=torch.bool)
                rel = torch.zeros(T, D, dtype=acc, device=dev)
                for i in range(L):
                    o = m * L + i
                    if o in part:
                        has, p = part[o]
                        rel[has.to(dev)] += p[has.to(dev)].to(acc)
                        reach |= has
                        if o != d:
                            nvl[o] += int(has.sum())
                out[reach.to(dev)] += rel.to(dtype)[reach.to(dev)].to(acc)
                nic[d] += int(reach.sum())
        outs.append(out.to(dtype))
    return outs, LegCounts(nic, nvl, D * ys_ND[0].element_size())
