"""The hierarchical exchange's launch wrappers (``tlx/comm/hier.py``), and what a hierarchical
dispatch leaves for its combine and backward (:class:`HierRoute`, :class:`HierHandle`); the ops
that call them are ``hier.py``'s phase generators, the overlapped dispatch's receive plan
``hier_overlap.py``.

Legend: W ranks in N nodes of L ranks (rank v is local rank ``v % L`` of node ``v // L``), T tokens
of this rank, K top-k, E experts, e = E/W, D hidden, R = W * T_max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .buffers import SymmBuffers
from .handle import SymmHandle
from . import launch as flat
from .tuning import _next_pow2, launch_shape

__all__ = ["HierRoute", "HierHandle"]


@dataclass(frozen=True)
class HierRoute:
    """A dispatch's node-level route and the relay's state, kept for its combine and backward.

    nrow_TN: ``[T, N]`` int32 row of token t in this rank's block of relay (m, l)'s RECV (-1: none).
    near_TW: ``[T, W]`` int32 ``send_row`` with other nodes' columns -1 (what the flat send moves).
    comb_row_TW: ``[T, W]`` int32 where t's combine rows come from: this node's ranks t went to
        (their send_row), the relay of each remote node t reached (its nrow), else -1.
    ncnt_N: ``[N]`` int64 rows to each node's relay; comb_to_W: ``[W]`` int64 combine rows expected
        from each rank. rows_from_near_W: ``[W]`` int64 rows received from this node's sources.
    hmeta_RM: ``[R, HM]`` int32 the inter-node rows' HMETA this rank got as a relay;
    hcnt_W / hexp_W: ``[W]`` int64 inter-node rows from each source / their owners on this node.
    """

    nrow_TN: torch.Tensor
    near_TW: torch.Tensor
    comb_row_TW: torch.Tensor
    ncnt_N: torch.Tensor
    comb_to_W: torch.Tensor
    rows_from_near_W: Optional[torch.Tensor] = None
    hmeta_RM: Optional[torch.Tensor] = None
    hcnt_W: Optional[torch.Tensor] = None
    hexp_W: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class HierHandle(SymmHandle):
    """:class:`SymmHandle` of a hierarchical dispatch, plus its :class:`HierRoute`."""

    route: Optional[HierRoute] = None


def _hkernels(device: torch.device):
    flat.kernels(device)  # checks TRITON_INTERPRET against the device
    from tlx.comm import hier
    return hier


def _same_node_W(bufs: SymmBuffers) -> torch.Tensor:
    L = bufs.hier.layout.ranks_per_node
    w = torch.arange(bufs.world_size, device=bufs.device)
    return (w // L) == (bufs.rank // L)


def _node_route(bufs: SymmBuffers, idx_TK: torch.Tensor, send_row_TW: torch.Tensor,
                counts_C: torch.Tensor) -> HierRoute:
    L, H = bufs.layout, bufs.hier.layout
    T, K = idx_TK.shape
    W, N, dev = L.world_size, H.num_nodes, idx_TK.device
    nrow = torch.empty(T, N, dtype=torch.int32, device=dev)
    near = torch.empty(T, W, dtype=torch.int32, device=dev)
    comb_row = torch.empty(T, W, dtype=torch.int32, device=dev)
    ncnt = torch.empty(N, dtype=torch.int64, device=dev)
    comb_to = torch.empty(W, dtype=torch.int64, device=dev)
    _hkernels(dev)._node_route_kernel[(1,)](
        idx_TK, send_row_TW, counts_C, nrow, near, comb_row, ncnt, comb_to, T, bufs.rank, K=K, KP=_next_pow2(K),
        E=L.num_experts, E_LOCAL=L.num_experts // W, W=W, WP=_next_pow2(W), L=H.ranks_per_node, N=N,
        NP=_next_pow2(N), BLOCK_T=bufs.config.route_block or min(256, _next_pow2(max(1, T))))
    return HierRoute(nrow, near, comb_row, ncnt, comb_to)


def _count(bufs: SymmBuffers, slot: int, rows: torch.Tensor) -> None:
    """Adds ``rows`` (a device int64 scalar) and its payload bytes to counters ``slot``, ``slot + 1``."""
    c = bufs.hier.counters
    c[slot] += rows
    c[slot + 1] += rows * (bufs.layout.hidden * bufs.layout.dtype.itemsize)


def _near_send_rows(bufs: SymmBuffers, route: HierRoute) -> torch.Tensor:
    """Rows the flat send stores into other ranks of this node (its own column stays local)."""
    sent = route.near_TW >= 0
    return sent.sum() - sent[:, bufs.rank].sum()


def _hier_meta(bufs: SymmBuffers) -> dict:
    L, H = bufs.layout, bufs.hier.layout
    return dict(W=L.world_size, WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k),
                L=H.ranks_per_node, D=L.hidden, T_MAX=L.max_tokens, HM=H.hmeta_words)


def _far_meta(bufs: SymmBuffers, kernel) -> dict:
    """The NVSHMEM arguments of a hierarchical kernel that puts to other nodes: the flat ones
    (``SymmBuffers.nvshmem_meta``) and the hierarchical staging offsets it takes."""
    meta = bufs.nvshmem_meta(kernel)
    if meta:
        H = bufs.hier.layout
        names = set(kernel.arg_names)
        meta.update({k: v for k, v in dict(OFF_SHCNT=H.off_shcnt, OFF_SHMETA=H.off_shmeta).items() if k in names})
    return meta


def _hier_send(bufs: SymmBuffers, x_TD: torch.Tensor, route: HierRoute, send_row_TW: torch.Tensor, idx_TK=None,
               q_TK=None, start_E=None, gate_TK=None, with_meta: bool = False, raw_meta: bool = False,
               split: int = 0, programs: Optional[int] = None) -> None:
    """``_hier_send_kernel``; ``split``: its SPLIT (the overlapped dispatch's halves), ``programs``:
    at most that many (the side stream's SM budget)."""
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    T, D = x_TD.shape
    bt, bd, warps, grid = launch_shape(bufs.config.send, D, T, bufs.device)
    if programs is not None:
        grid = (max(1, min(grid[0], programs)),)
    dummy = route.nrow_TN
    kern = k._hier_send_kernel
    kern[grid](x_TD, x_TD.stride(0), T, route.nrow_TN, send_row_TW, idx_TK if with_meta else dummy,
               q_TK if with_meta else dummy, start_E if with_meta else dummy, gate_TK if with_meta else x_TD,
               route.ncnt_N, bufs.hier.counters, bufs.peers, bufs.rank, **_hier_meta(bufs),
               E_LOCAL=L.num_experts // L.world_size, LP=_next_pow2(H.ranks_per_node), N=H.num_nodes,
               OFF_STATE=L.off_state, OFF_RECV=L.off_recv, OFF_GATES=L.off_gates, OFF_HMETA=H.off_hmeta,
               OFF_HFLAG=H.off_hflag, OFF_HCNT=H.off_hcnt, OFF_HARRIVE=H.off_harrive, WITH_META=with_meta,
               RAW_META=raw_meta, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps, **_far_meta(bufs, kern),
               **(dict(SPLIT=split, OFF_HRROWS=H.off_hrrows) if split else {}))


def _relay_forward(bufs: SymmBuffers, route: HierRoute, from_region: bool, split: int = 0,
                   programs: Optional[int] = None, end: bool = False) -> None:
    """``_relay_forward_kernel``; ``split``, ``programs``: as for :func:`_hier_send`; ``end``: the
    op's last kernel (the overlapped dispatch's rows forward)."""
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    br, bd, warps, grid = launch_shape(bufs.config.expand, L.hidden, L.max_tokens, bufs.device)
    if programs is not None:
        grid = (max(1, min(grid[0], programs)),)
    kern = k._relay_forward_kernel
    extra = dict(SPLIT=split, OFF_HRROWS=H.off_hrrows, OFF_HFROWS=H.off_hfrows) if split else {}
    if end:
        extra.update(flat._end_meta(bufs), **bufs.nvshmem_meta(kern))
    kern[grid](
        route.hmeta_RM, route.hcnt_W, route.hexp_W, bufs.hier.counters, bufs.peers, bufs.rank, **_hier_meta(bufs),
        LP=_next_pow2(H.ranks_per_node), META_W=L.meta_words, DT=_tl_dtype(L.dtype), OFF_STATE=L.off_state,
        OFF_RECV=L.off_recv, OFF_META=L.off_meta, OFF_GATES=L.off_gates, OFF_ARRIVE=L.off_arrive, OFF_HMETA=H.off_hmeta,
        OFF_HFLAG=H.off_hflag, OFF_HCNT=H.off_hcnt, OFF_HARRIVE=H.off_harrive, OFF_HDONE=H.off_hdone,
        FROM_REGION=from_region, TIMEOUT_NS=bufs.timeout_ns, CLOCK=flat.clock(), BLOCK_R=br, BLOCK_D=bd,
        num_warps=warps, **extra)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


def _hier_reduce_send(bufs: SymmBuffers, y: torch.Tensor, h: HierHandle, gated: bool, rows: bool,
                      part: Optional[torch.Tensor] = None) -> None:
    """``part`` (row form only): ``y`` is the fp32 accumulator of the partial rows, and the kernel
    also writes their rounded other-node rows into ``part`` (``[R, D]``, the exchange dtype)."""
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    br, bd, warps, grid = launch_shape(bufs.config.reduce_send, L.hidden, L.recv_rows, bufs.device)
    k._hier_reduce_send_kernel[grid](
        y, y if part is None else part, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, bufs.hier.counters, bufs.peers,
        bufs.rank, h.num_recv_rows, W=L.world_size, WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k),
        L=H.ranks_per_node, D=L.hidden, T_MAX=L.max_tokens, OFF_HCOMB=H.off_hcomb, OFF_HCARR=H.off_hcarr,
        GATED=gated, ROWS=rows, PART=part is not None, EMULATE=bufs.device.type != "cuda",
        ACC=flat._common(bufs)["ACC"], BLOCK_R=br, BLOCK_D=bd, num_warps=warps)


def _relay_combine(bufs: SymmBuffers, h: HierHandle) -> None:
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    r = h.route
    br, bd, warps, grid = launch_shape(bufs.config.reduce_recv, L.hidden, L.max_tokens, bufs.device)
    kern = k._relay_combine_kernel
    kern[grid](r.hmeta_RM, r.hcnt_W, r.hexp_W, bufs.hier.counters, bufs.peers, bufs.rank, W=L.world_size,
               WP=_next_pow2(L.world_size), K=L.top_k, L=H.ranks_per_node, LP=_next_pow2(H.ranks_per_node),
               D=L.hidden, T_MAX=L.max_tokens, HM=H.hmeta_words, DT=_tl_dtype(L.dtype), ACC=flat._common(bufs)["ACC"],
               OFF_STATE=L.off_state, OFF_ARRIVE=L.off_arrive, OFF_COMB=L.off_comb, OFF_HCOMB=H.off_hcomb,
               OFF_HCARR=H.off_hcarr, OFF_HDONE=H.off_hdone, TIMEOUT_NS=bufs.timeout_ns, CLOCK=flat.clock(),
               BLOCK_R=br, BLOCK_D=bd, num_warps=warps, **_far_meta(bufs, kern))
