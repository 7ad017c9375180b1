"""The hierarchical (per-node) exchange: host side of ``tlx/comm/hier.py`` -- its ops as phase
generators (the launch wrappers are ``hier_launch.py``'s), which ``steps.py`` hands every op of a
buffer set with a hierarchical part (``SymmBuffers.hier``, from ``ExchangeConfig.topology``).

Legend: W ranks in N nodes of L ranks (rank v is local rank ``v % L`` of node ``v // L``), T tokens
of this rank, K top-k, E experts, e = E/W, D hidden, R = W * T_max.

When an EP group spans nodes, a token row crosses to each destination *node* once -- to the rank
of that node with the source's local index, its relay -- which forwards it over NVLink to the
node's ranks that own its experts; combine sums the partial rows inside the node first and sends
one row per (token, node) back (``tlx_dist.comm.hier_reference`` is the pure-PyTorch oracle). The
ops are the flat ones (``steps.py``) with the inter-node leg added: the flat kernels move what
stays inside a node (the near columns of ``send_row``, the near sources' rows), the kernels of
``tlx/comm/hier.py`` the rest, and every rank ends with the flat exchange's receive rows, so the
expand, gate-gradient and reduce-receive kernels are the flat ones. No per-layer receive regions
or copy engines (their rows go by the relays); receive copies and sums after the whole op's rows
(``policy.py``: "after"). The overlapped dispatch (``ExchangeConfig.overlap``) lets the inter-node
leg's token rows land after the op returns, while the fused GEMMs compute this node's rows
(``hier_overlap.py``).

The per-leg counters (``SymmBuffers.hier.counters``, int64 ``[8]`` on the device,
``hier_layout.LEG_COUNTERS``) add up what each leg moved.
"""

from __future__ import annotations

import dataclasses
from typing import Generator, Optional

import torch

from .buffers import SymmBuffers
from .handle import _check_bufs, expanded_rows
from . import launch as flat
from .hier_launch import (HierHandle, HierRoute, _count, _hier_reduce_send, _hier_send, _near_send_rows,
                          _node_route, _relay_combine, _relay_forward, _same_node_W)
from .hier_overlap import far_rows_forward, far_rows_send, hier_rows_overlap, settle

__all__ = ["HierRoute", "HierHandle", "dispatch_steps", "combine_steps", "combine_grad_steps", "dispatch_grad_steps",
           "combine_rows_steps", "combine_rows_grad_steps", "dispatch_rows_grad_steps"]

Steps = Generator[None, None, object]


# ---------------------------------------------------------------- the ops, as phase generators

def dispatch_steps(bufs: SymmBuffers, x_TD: torch.Tensor, idx_TK: torch.Tensor,
                   gate_TK: Optional[torch.Tensor] = None, capacity="worst", rows: bool = False,
                   overlap: bool = False) -> Steps:
    """Phases of one hierarchical dispatch on rank ``bufs.rank``; returns what
    :func:`tlx_dist.comm.symm.dispatch_steps` returns (``(x_exp_ND, HierHandle)``, or with ``rows``
    ``(recv_RD, src_N, gate_N, HierHandle)``; no per-layer receive regions), the same rows.
    ``overlap`` (the row form, a static capacity, more than one node; ignored otherwise): the
    inter-node leg's token rows follow the op (``hier_overlap.py``): on return only this node's
    rows are in ``recv_RD``, and ``handle.overlap`` (:class:`HierRowsOverlap`) says how to wait for
    the rest."""
    L, H = bufs.layout, bufs.hier.layout
    T, K = idx_TK.shape
    _check_bufs(bufs, x_TD, K, L.num_experts)
    settle(bufs)
    W, E, dev = L.world_size, L.num_experts, x_TD.device
    e = E // W
    idx = idx_TK if idx_TK.is_contiguous() else idx_TK.contiguous()
    if x_TD.stride(-1) != 1:
        x_TD = x_TD.contiguous()
    n = expanded_rows(capacity, bufs)
    raw = n is not None
    ovl = bool(overlap) and rows and raw and H.num_nodes > 1
    split = 1 if ovl else 0
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
    # ... then one row per (token, remote node) to its relay (overlapped: its metadata alone)
    _hier_send(bufs, x_TD, route, send_row_TW, idx, q_TK, start_E, gates, with_meta=True, raw_meta=raw, split=split)
    _count(bufs, 2, _near_send_rows(bufs, route))
    yield
    R, HM = L.recv_rows, H.hmeta_words
    # (hmeta rows past a source's hcnt are never read)
    route = dataclasses.replace(route, hmeta_RM=torch.empty(R, HM, dtype=torch.int32, device=dev),
                                hcnt_W=torch.zeros(W, dtype=torch.int64, device=dev),
                                hexp_W=torch.zeros(W, dtype=torch.int64, device=dev))
    _relay_forward(bufs, route, from_region=True, split=split)
    yield
    if n is None:
        n = int(offsets_e[-1]) if e else 0  # capacity="exact": the one host sync of this op
    src_map = torch.empty(n, dtype=torch.int32, device=dev)
    pos_RK = torch.empty(R, K, dtype=torch.int32, device=dev)
    gate_RK = torch.empty(R, K, dtype=L.dtype, device=dev)
    tok_R = torch.empty(R, dtype=torch.int32, device=dev)
    layout = (lay, offsets_e, n) if raw else None
    starts = None
    if rows:
        gate_N = torch.empty(n, dtype=flat.acc_dtype(L.dtype), device=dev)
        src_N = torch.empty(n, dtype=torch.int32, device=dev)
        # (overlapped: only this node's rows are in RECV yet, and the op ends with the relays' forward)
        starts = flat.expand(bufs, recv_RD, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True,
                             gate_grad=False, n_exp=n, gate_N=gate_N, copy=False, end=not ovl, recv_copy=True,
                             src_row_N=src_N, layout=layout, near_l=H.ranks_per_node if ovl else 0)
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
    if ovl:
        # the other-node token rows, outside the op: sent to the relays ... (its own phase: in the
        # emulated world every rank's rows are sent before any relay waits for them)
        side_sms = bufs.config.overlap_sms
        far_rows_send(bufs, x_TD, route, send_row_TW, side_sms)
        yield
        # ... forwarded by each relay to its node's owners, which ends the op
        side_done = far_rows_forward(bufs, route, side_sms)
        handle = dataclasses.replace(handle, overlap=hier_rows_overlap(handle, recv_RD, starts, lay, n, side_sms,
                                                                       side_done))
    if rows:
        return x_exp, src_N, gate_N, handle
    return x_exp, handle


def _hier_reduce_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: HierHandle, gated: bool, rows: bool = False,
                       g_gate_N: Optional[torch.Tensor] = None, far_sent: bool = False) -> Steps:
    """A combine-direction op: the flat reduce-send for this node's sources (the op's barrier) and the
    owners' partial rows of other nodes' tokens to their relays | the relays' sums home | the flat
    reduce-receive over the combine view (``comb_row``). ``g_gate_N`` (the row form's backward):
    also the given gate gradients to their sources (flat, in the first phase); returns then
    ``(g_TD, g_gate_TK)``. ``far_sent``: the other nodes' partial rows went to their relays already
    (``HierRowsOverlap.send_partials``)."""
    settle(bufs)
    r = h.route
    y = flat.reduce_send(bufs, y_ND, dataclasses.replace(h, rows_from_W=r.rows_from_near_W), gated, rows)
    if not far_sent:
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
    settle(bufs)
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
    """The row form's combine: row r of ``part_RD`` ``[R, D]`` goes home through its node's relay.
    After an overlapped dispatch: first its plan's wait if the GEMMs did not enqueue it, and the
    join of the side stream that ended it (``HierRowsOverlap.finish``); where the fused forward
    sent the other nodes' partial rows to their relays already, the rest."""
    ov = h.overlap
    sent = ov is not None and ov.partials_sent is not None
    if sent and ov.partials_sent != part_RD.data_ptr():
        raise ValueError("combine_rows after an overlapped fused forward must get that forward's output as it is: "
                         "its other nodes' partial rows left from there")
    if ov is not None:
        ov.finish()
    return (yield from _hier_reduce_steps(bufs, part_RD, h, gated=False, rows=True, far_sent=sent))


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

