"""The hierarchical (per-node) exchange: host side of ``tlx/comm/hier.py`` -- its launch wrappers
and its ops as phase generators, which ``steps.py`` hands every op of a buffer set with a
hierarchical part (``SymmBuffers.hier``, from ``ExchangeConfig.topology``).

Legend: W ranks in N nodes of L ranks (rank v is local rank ``v % L`` of node ``v // L``), T tokens
of this rank, K top-k, E experts, e = E/W, D hidden, R = W * T_max.

When an EP group spans nodes, a token row crosses to each destination *node* once -- to the rank
of that node with the source's local index, its relay -- which forwards it over NVLink to the
node's ranks that own its experts; combine sums the partial rows inside the node first and sends
one row per (token, node) back (``tlx_dist.comm.hier_reference`` is the pure-PyTorch oracle). The
ops are the flat ones (``steps.py``) with the inter-node leg added: the flat kernels move what
stays inside a node (the near columns of ``send_row``, the near sources' rows), the kernels of
``tlx/comm/hier.py`` the rest, and every rank ends with the flat exchange's receive rows, so the
expand, gate-gradient and reduce-receive kernels are the flat ones. No per-layer receive regions,
copy engines or overlap (their rows go by the relays); receive copies and sums after the whole op's
rows (``policy.py``: "after").

The per-leg counters (``SymmBuffers.hier.counters``, int64 ``[8]`` on the device,
``hier_layout.LEG_COUNTERS``) add up what each leg moved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Generator, Optional

import torch

from .buffers import SymmBuffers
from .handle import SymmHandle, _check_bufs, expanded_rows
from . import launch as flat
from .tuning import _next_pow2, launch_shape

__all__ = ["HierRoute", "HierHandle", "dispatch_steps", "combine_steps", "combine_grad_steps", "dispatch_grad_steps",
           "combine_rows_steps", "combine_rows_grad_steps", "dispatch_rows_grad_steps"]

Steps = Generator[None, None, object]


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
               q_TK=None, start_E=None, gate_TK=None, with_meta: bool = False, raw_meta: bool = False) -> None:
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    T, D = x_TD.shape
    bt, bd, warps, grid = launch_shape(bufs.config.send, D, T, bufs.device)
    dummy = route.nrow_TN
    kern = k._hier_send_kernel
    kern[grid](x_TD, x_TD.stride(0), T, route.nrow_TN, send_row_TW, idx_TK if with_meta else dummy,
               q_TK if with_meta else dummy, start_E if with_meta else dummy, gate_TK if with_meta else x_TD,
               route.ncnt_N, bufs.hier.counters, bufs.peers, bufs.rank, **_hier_meta(bufs),
               E_LOCAL=L.num_experts // L.world_size, LP=_next_pow2(H.ranks_per_node), N=H.num_nodes,
               OFF_STATE=L.off_state, OFF_RECV=L.off_recv, OFF_GATES=L.off_gates, OFF_HMETA=H.off_hmeta,
               OFF_HFLAG=H.off_hflag, OFF_HCNT=H.off_hcnt, OFF_HARRIVE=H.off_harrive, WITH_META=with_meta,
               RAW_META=raw_meta, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps, **_far_meta(bufs, kern))


def _relay_forward(bufs: SymmBuffers, route: HierRoute, from_region: bool) -> None:
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    br, bd, warps, grid = launch_shape(bufs.config.expand, L.hidden, L.max_tokens, bufs.device)
    k._relay_forward_kernel[grid](
        route.hmeta_RM, route.hcnt_W, route.hexp_W, bufs.hier.counters, bufs.peers, bufs.rank, **_hier_meta(bufs),
        LP=_next_pow2(H.ranks_per_node), META_W=L.meta_words, DT=_tl_dtype(L.dtype), OFF_STATE=L.off_state,
        OFF_RECV=L.off_recv, OFF_META=L.off_meta, OFF_GATES=L.off_gates, OFF_ARRIVE=L.off_arrive, OFF_HMETA=H.off_hmeta,
        OFF_HFLAG=H.off_hflag, OFF_HCNT=H.off_hcnt, OFF_HARRIVE=H.off_harrive, OFF_HDONE=H.off_hdone,
        FROM_REGION=from_region, TIMEOUT_NS=bufs.timeout_ns, CLOCK=flat.clock(), BLOCK_R=br, BLOCK_D=bd,
        num_warps=warps)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


def _hier_reduce_send(bufs: SymmBuffers, y: torch.Tensor, h: HierHandle, gated: bool, rows: bool) -> None:
    L, H, k = bufs.layout, bufs.hier.layout, _hkernels(bufs.device)
    br, bd, warps, grid = launch_shape(bufs.config.reduce_send, L.hidden, L.recv_rows, bufs.device)
    k._hier_reduce_send_kernel[grid](
        y, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, bufs.hier.counters, bufs.peers, bufs.rank, h.num_recv_rows,
        W=L.world_size, WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k), L=H.ranks_per_node,
        D=L.hidden, T_MAX=L.max_tokens, OFF_HCOMB=H.off_hcomb, OFF_HCARR=H.off_hcarr, GATED=gated, ROWS=rows,
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


# ---------------------------------------------------------------- the ops, as phase generators

def dispatch_steps(bufs: SymmBuffers, x_TD: torch.Tensor, idx_TK: torch.Tensor,
                        gate_TK: Optional[torch.Tensor] = None, capacity="worst", rows: bool = False) -> Steps:
    """Phases of one hierarchical dispatch on rank ``bufs.rank``; returns what
    :func:`tlx_dist.comm.symm.dispatch_steps` returns (``(x_exp_ND, HierHandle)``, or with ``rows``
    ``(recv_RD, src_N, gate_N, HierHandle)``; no per-layer receive regions), the same rows."""
    L = bufs.layout
    T, K = idx_TK.shape
    _check_bufs(bufs, x_TD, K, L.num_experts)
    W, E, dev = L.world_size, L.num_experts, x_TD.device
    e = E // W
    idx = idx_TK if idx_TK.is_contiguous() else idx_TK.contiguous()
    if x_TD.stride(-1) != 1:
        x_TD = x_TD.contiguous()
    n = expanded_rows(capacity, bufs)
    raw = n is not None
    q_TK, send_row_TW, counts_C = flat.route(bufs, idx)  # + the flat counts, to every rank
    route = _node_route(bufs, idx, send_row_TW, counts_C)
    yield
    lay = torch.empty(E + e + W, dtype=torch.int64, device=dev)
    offsets_e = torch.empty(e, dtype=torch.int32, device=dev)
    start_E, recv_counts_e, rows_from_W = lay[:E], lay[E:E + e], lay[E + e:]
    gates = (torch.ones(T, K, dtype=L.dtype, device=dev) if gate_TK is None
             else gate_TK.detach() if gate_TK.is_contiguous() else gate_TK.detach().contiguous())
    recv_RD = torch.empty(L.recv_rows, L.hidden, dtype=L.dtype, device=dev) if rows else None
    # the flat send (the op's barrier, and without raw codes this rank's layout) for this node's ranks ...
    flat.send_tokens(bufs, x_TD, route.near_TW, idx, q_TK, lay, gates, with_meta=True, offs=offsets_e, offs_cap=n,
                 own_rows=recv_RD, skip_own=not rows, raw_meta=raw, rows_from=rows_from_W)
    # ... then one row per (token, remote node) to its relay
    _hier_send(bufs, x_TD, route, send_row_TW, idx, q_TK, start_E, gates, with_meta=True, raw_meta=raw)
    _count(bufs, 2, _near_send_rows(bufs, route))
    yield
    R, HM = L.recv_rows, bufs.hier.layout.hmeta_words
    # (hmeta rows past a source's hcnt are never read)
    route = dataclasses.replace(route, hmeta_RM=torch.empty(R, HM, dtype=torch.int32, device=dev),
                                hcnt_W=torch.zeros(W, dtype=torch.int64, device=dev),
                                hexp_W=torch.zeros(W, dtype=torch.int64, device=dev))
    _relay_forward(bufs, route, from_region=True)
    yield
    if n is None:
        n = int(offsets_e[-1]) if e else 0  # capacity="exact": the one host sync of this op
    src_map = torch.empty(n, dtype=torch.int32, device=dev)
    pos_RK = torch.empty(R, K, dtype=torch.int32, device=dev)
    gate_RK = torch.empty(R, K, dtype=L.dtype, device=dev)
    tok_R = torch.empty(R, dtype=torch.int32, device=dev)
    layout = (lay, offsets_e, n) if raw else None
    if rows:
        gate_N = torch.empty(n, dtype=flat.acc_dtype(L.dtype), device=dev)
        src_N = torch.empty(n, dtype=torch.int32, device=dev)
        flat.expand(bufs, recv_RD, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True, gate_grad=False,
                n_exp=n, gate_N=gate_N, copy=False, end=True, recv_copy=True, src_row_N=src_N, layout=layout)
        x_exp = recv_RD
    else:
        x_exp = torch.empty(n, L.hidden, dtype=L.dtype, device=dev)
        flat.expand(bufs, x_exp, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True, gate_grad=False,
                end=True, x_own=x_TD, layout=layout)
    route = dataclasses.replace(route, rows_from_near_W=torch.where(_same_node_W(bufs), rows_from_W, 0))
    handle = HierHandle(
        num_tokens=T, top_k=K, num_recv_rows=n, offsets_e=offsets_e, recv_counts_e=recv_counts_e,
        tokens_per_expert_E=counts_C[:E], order_S=None, inverse_S=None, send_row_TW=send_row_TW,
        rows_to_W=counts_C[E:], rows_from_W=rows_from_W, pos_RK=pos_RK, gate_RK=gate_RK, tok_R=tok_R,
        src_map_N=src_map, gate_TK=gate_TK, buffers=bufs, route=route)
    if rows:
        return x_exp, src_N, gate_N, handle
    return x_exp, handle


def _hier_reduce_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: HierHandle, gated: bool, rows: bool = False,
                       g_gate_N: Optional[torch.Tensor] = None) -> Steps:
    """A combine-direction op: the flat reduce-send for this node's sources (the op's barrier) and the
    owners' partial rows of other nodes' tokens to their relays | the relays' sums home | the flat
    reduce-receive over the combine view (``comb_row``). ``g_gate_N`` (the row form's backward):
    also the given gate gradients to their sources (flat, in the first phase); returns then
    ``(g_TD, g_gate_TK)``."""
    r = h.route
    y = flat.reduce_send(bufs, y_ND, dataclasses.replace(h, rows_from_W=r.rows_from_near_W), gated, rows)
    _hier_reduce_send(bufs, y, h, gated, rows)
    _count(bufs, 6, r.rows_from_near_W.sum() - r.rows_from_near_W[bufs.rank])
    if g_gate_N is not None:
        scratch = torch.empty(max(1, h.num_recv_rows), dtype=torch.int32, device=bufs.device)
        g = g_gate_N.to(flat.acc_dtype(bufs.layout.dtype)).contiguous()
        flat.expand(bufs, bufs.recv_rows(), scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, g, from_meta=False,
                gate_grad=True, n_exp=h.num_recv_rows, copy=False, dgate_given=True, wait_rows=False)
    yield
    _relay_combine(bufs, h)
    yield
    comb = dataclasses.replace(h, send_row_TW=r.comb_row_TW, rows_to_W=r.comb_to_W)
    out = flat.reduce_recv(bufs, comb, end=not rows or g_gate_N is None, part=y if rows else None)
    if rows and g_gate_N is not None:
        return out, flat.gate_grad_recv(bufs, h)
    return out


def combine_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: HierHandle) -> Steps:
    """``out_TD = sum_k gate[t, k] * y[t, k]``, partial rows summed inside each node first."""
    return (yield from _hier_reduce_steps(bufs, y_ND, h, gated=True))


def combine_grad_steps(bufs: SymmBuffers, g_ND: torch.Tensor, h: HierHandle) -> Steps:
    """Backward of dispatch: an ungated hierarchical combine of ``g_ND``."""
    return (yield from _hier_reduce_steps(bufs, g_ND, h, gated=False))


def _hier_rows_out(bufs: SymmBuffers, g_TD: torch.Tensor, h: HierHandle, **send) -> Steps:
    """The dispatch-direction part of a backward op: ``g_TD`` rows to this node's ranks (flat send,
    the op's barrier) and over the inter-node leg | the relays forward them (no metadata: the
    dispatch's)."""
    r = h.route
    flat.send_tokens(bufs, g_TD, r.near_TW, None, None, None, None, with_meta=False, **send)
    _hier_send(bufs, g_TD, r, h.send_row_TW)
    _count(bufs, 2, _near_send_rows(bufs, r))
    yield
    _relay_forward(bufs, r, from_region=False)


def dispatch_grad_steps(bufs: SymmBuffers, g_TD: torch.Tensor, y_ND: torch.Tensor, h: HierHandle) -> Steps:
    """Backward of combine: a hierarchical dispatch of ``g_TD``; returns ``(g_y_ND, g_gate_TK)`` as
    :func:`tlx_dist.comm.symm.dispatch_grad_steps` (gate gradients go to their sources directly)."""
    L = bufs.layout
    g_TD = g_TD if g_TD.stride(-1) == 1 else g_TD.contiguous()
    yield from _hier_rows_out(bufs, g_TD, h, skip_own=True)
    yield
    n = h.num_recv_rows
    g_y = torch.empty(n, L.hidden, dtype=L.dtype, device=bufs.device)
    scratch = torch.empty(n, dtype=torch.int32, device=bufs.device)
    y = y_ND if y_ND.is_contiguous() else y_ND.contiguous()
    flat.expand(bufs, g_y, scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, y, from_meta=False, gate_grad=True,
            x_own=g_TD)
    yield
    return g_y, flat.gate_grad_recv(bufs, h)


def combine_rows_steps(bufs: SymmBuffers, part_RD: torch.Tensor, h: HierHandle) -> Steps:
    """The row form's combine: row r of ``part_RD`` ``[R, D]`` goes home through its node's relay."""
    return (yield from _hier_reduce_steps(bufs, part_RD, h, gated=False, rows=True))


def combine_rows_grad_steps(bufs: SymmBuffers, g_TD: torch.Tensor, h: HierHandle) -> Steps:
    """Backward of :func:`combine_rows_steps`: ``g_part[r] = g_TD[token of r]``, the token rows
    travelling as in the dispatch; returns ``g_part_RD``."""
    L = bufs.layout
    g_TD = g_TD if g_TD.stride(-1) == 1 else g_TD.contiguous()
    g_part = torch.empty(L.recv_rows, L.hidden, dtype=L.dtype, device=bufs.device)
    yield from _hier_rows_out(bufs, g_TD, h, own_rows=g_part, rows_from=h.rows_from_W)
    yield
    scratch = torch.empty(max(1, h.num_recv_rows), dtype=torch.int32, device=bufs.device)
    flat.expand(bufs, g_part, scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, None, from_meta=False,
            gate_grad=False, n_exp=h.num_recv_rows, copy=False, end=True, recv_copy=True)
    return g_part


def dispatch_rows_grad_steps(bufs: SymmBuffers, g_RD: torch.Tensor, g_gate_N: Optional[torch.Tensor],
                                  h: HierHandle) -> Steps:
    """Backward of ``dispatch_steps(rows=True)``: a hierarchical combine of the receive-row
    gradients (and the given gate gradients to their sources); returns ``(g_TD, g_gate_TK or None)``."""
    res = yield from _hier_reduce_steps(bufs, g_RD, h, gated=False, rows=True, g_gate_N=g_gate_N)
    return res if g_gate_N is not None else (res, None)

