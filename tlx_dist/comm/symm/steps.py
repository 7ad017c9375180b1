"""The ops as phase generators: each yields between kernel launches whose waits need every rank's
earlier launches (``tlx/comm/exchange.py`` lists them). A real rank runs its generator straight
through (:func:`run_steps`); the emulated world (``emulated.py``) advances W ranks' generators in
lockstep. A buffer set with a hierarchical part (``SymmBuffers.hier``) runs every op as ``hier.py``'s."""

from __future__ import annotations

import dataclasses
from typing import Generator, Optional

import torch

from . import hier
from .buffers import SymmBuffers
from .ce_transport import ce_ready, ce_send_partials, ce_send_rows
from .handle import Capacity, SymmHandle, _check_bufs, expanded_rows
from .launch import (acc_dtype, expand, gate_grad_recv, on_side, reduce_recv, reduce_send, route, rows_wait,
                     send_tokens)
from .overlap import finish_abandoned, rows_overlap, send_rows_side
from .policy import ce_mode, comb_mode
from .tuning import reduce_recv_shape

__all__ = ["Steps", "dispatch_steps", "combine_steps", "dispatch_grad_steps", "combine_grad_steps",
           "combine_rows_steps", "combine_rows_grad_steps", "dispatch_rows_grad_steps", "run_steps"]

Steps = Generator[None, None, object]


def dispatch_steps(bufs: SymmBuffers, x_TD: torch.Tensor, idx_TK: torch.Tensor,
                   gate_TK: Optional[torch.Tensor] = None, capacity: Capacity = "worst",
                   rows: bool = False, region: Optional[int] = None, overlap: bool = False) -> Steps:
    """Phases of one dispatch on rank ``bufs.rank``; returns ``(x_exp_ND, SymmHandle)``.

    ``rows=True`` (the fused EP pipeline) skips the expert-major copy and returns ``(recv_RD, src_N,
    gate_N, SymmHandle)``: a copy of the receive rows ``[W*T_max, D]`` (row ``s*T_max + i`` is
    source s's i-th token row; rows past ``rows_from_W[s]`` are unspecified and never indexed), the
    receive row each expanded row reads (``src_map_N // K``, int32) and its fp32 gate. With
    ``region`` (row form over peer pointers) ``recv_RD`` is instead this rank's per-layer receive
    region ``region`` itself (``SymmBuffers.rows_region``), where the peers' rows land: no copy,
    valid until the next dispatch into that region. The NVSHMEM route ignores ``region`` (its puts
    target RECV). ``overlap`` (with ``region`` and a static capacity; ignored otherwise): the send
    splits in two -- META, gates and the own rows in the op, the peers' rows after it on a side
    stream (``send_rows_side``, ``ExchangeConfig.overlap_sms`` programs) -- and the op ends without
    waiting for the rows: the handle's
    ``overlap`` (:class:`RowsOverlap`) says how to wait for them."""
    L = bufs.layout
    T, K = idx_TK.shape
    _check_bufs(bufs, x_TD, K, L.num_experts)
    # a region the buffers do not have raises before this op signals any peer (the NVSHMEM route reserves none)
    region_RD = None
    if region is not None and not (bufs.use_nvshmem and L.row_regions == 0):
        region_RD = bufs.rows_region(region)
    if region is not None and (not rows or bufs.use_nvshmem):
        region, region_RD = None, None
    if bufs.hier is not None:  # the hierarchical exchange (hier.py; its rows go by relays: no regions)
        return (yield from hier.dispatch_steps(bufs, x_TD, idx_TK, gate_TK, capacity, rows=rows))
    W, r, E, dev = L.world_size, bufs.rank, L.num_experts, x_TD.device
    e = E // W
    idx = idx_TK if idx_TK.is_contiguous() else idx_TK.contiguous()
    if x_TD.stride(-1) != 1:  # held here until the expand kernel has read this rank's own rows
        x_TD = x_TD.contiguous()
    n = expanded_rows(capacity, bufs)  # static, or None for "exact"
    raw = n is not None
    # the copy-engine row form: the dense layout, this rank's rows leave by copy engines on a side
    # stream as soon as every peer is ready (beside the route, META and expand kernels of the op)
    ce = rows and region is not None and raw and W > 1 and ce_mode(bufs)
    ce_done = None
    if ce:
        ce_ready(bufs)
        finish_abandoned(bufs, region)
        x_ce = x_TD.contiguous()
        ce_done = on_side(bufs, lambda: ce_send_rows(bufs, x_ce, region), x_ce)
    q_TK, send_row_TW, counts_C = route(bufs, idx, dense=ce)  # + the signal
    yield
    lay = torch.empty(E + e + W, dtype=torch.int64, device=dev)
    offsets_e = torch.empty(e, dtype=torch.int32, device=dev)
    start_E, recv_counts_e, rows_from_W = lay[:E], lay[E:E + e], lay[E + e:]
    # Gates travel in the activation dtype (the kernel casts them): the owner forms gate * y as the
    # reference does.
    gates = (torch.ones(T, K, dtype=L.dtype, device=dev) if gate_TK is None
             else gate_TK.detach() if gate_TK.is_contiguous() else gate_TK.detach().contiguous())
    # Row form: the receive rows' copy, which this rank's own rows reach straight from the send kernel
    if rows and region is not None:
        recv_RD = region_RD
        # this dispatch overwrites the region: rows saved from the last one are stale now
        torch.autograd.graph.increment_version(recv_RD)
    else:
        recv_RD = torch.empty(L.recv_rows, L.hidden, dtype=L.dtype, device=dev) if rows else None
    # offsets_e come out capped at n (the grouped GEMMs' offsets; overflow is flagged by expand).
    # Static capacity: the rows leave without waiting for the peers' counts (raw slot codes in META),
    # and the expand kernel, which waits for them, computes the layout; "exact" needs the layout on
    # the host before expand, so there the send waits for the counts and computes it.
    ovl = bool(overlap) and rows and region is not None and raw and W > 1
    if region is not None and not ce:  # (with ce: done above, before the copies)
        finish_abandoned(bufs, region)
    send_tokens(bufs, x_TD, send_row_TW, idx, q_TK, lay, gates, with_meta=True, offs=offsets_e, offs_cap=n,
                 own_rows=recv_RD, skip_own=not rows, raw_meta=raw, rows_from=rows_from_W, region=region,
                 split=1 if ovl or ce else 0, dense=ce)
    side_sms = bufs.config.overlap_sms if ovl else 0
    if ce:
        side_done = ce_done
    else:
        side_done = send_rows_side(bufs, x_TD, send_row_TW, recv_RD, region, side_sms) if ovl else None
    layout = (lay, offsets_e, n) if raw else None
    yield
    if n is None:
        n = int(offsets_e[-1]) if e else 0  # capacity="exact": the one host sync of this op
    src_map = torch.empty(n, dtype=torch.int32, device=dev)
    R = L.recv_rows
    pos_RK = torch.empty(R, K, dtype=torch.int32, device=dev)
    gate_RK = torch.empty(R, K, dtype=L.dtype, device=dev)
    tok_R = torch.empty(R, dtype=torch.int32, device=dev)
    if rows:
        # the other sources' receive rows, copied out by the kernel before it ends the op (a peer's
        # next op may overwrite the region as soon as it has)
        x_exp = recv_RD
        gate_N = torch.empty(n, dtype=acc_dtype(L.dtype), device=dev)
        src_N = torch.empty(n, dtype=torch.int32, device=dev)
        starts = expand(bufs, x_exp, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True,
                         gate_grad=False, n_exp=n, gate_N=gate_N, copy=False, end=True, recv_copy=region is None,
                         src_row_N=src_N, layout=layout)
    else:
        x_exp = torch.empty(n, L.hidden, dtype=L.dtype, device=dev)
        expand(bufs, x_exp, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True, gate_grad=False,
                end=True, x_own=x_TD, layout=layout)
    handle = SymmHandle(
        num_tokens=T, top_k=K, num_recv_rows=n,
        offsets_e=offsets_e,
        recv_counts_e=recv_counts_e, tokens_per_expert_E=counts_C[:E],
        order_S=None, inverse_S=None, send_row_TW=send_row_TW, rows_to_W=counts_C[E:],
        rows_from_W=rows_from_W, pos_RK=pos_RK, gate_RK=gate_RK, tok_R=tok_R, src_map_N=src_map,
        gate_TK=gate_TK, buffers=bufs, dense=ce)
    if ce and not ovl:  # the rows are this op's result: wait for them here
        rows_wait(bufs, region, rows_from_W)
        if side_done is not None:
            torch.cuda.current_stream(bufs.device).wait_event(side_done)
    if rows and ovl:
        handle = dataclasses.replace(handle, overlap=rows_overlap(handle, region, starts, lay, n, side_sms,
                                                                   side_done))
        bufs._overlap_plans[region] = handle.overlap
    if rows:
        return x_exp, src_N, gate_N, handle
    return x_exp, handle


def _reduce_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: SymmHandle, gated: bool, rows: bool = False) -> Steps:
    mode = comb_mode(bufs)
    if mode == "overlap" and rows and bufs.layout.dtype.itemsize == 2:  # one launch: sends, sums as the
        # partial rows land, ends the op
        return reduce_send(bufs, y_ND, h, gated, rows, blk=True, recv=True)
    # (the expanded form's reduce-send sums K slots a row: ~170-180 registers a thread, 2 CTAs an SM;
    # summing programs beside it could hold every slot and starve its senders, so it keeps two launches;
    # so do fp32 / fp64 rows: 96 / 128 registers a thread, 5 / 4 CTAs an SM)
    blk = mode == "blocks"
    y = reduce_send(bufs, y_ND, h, gated, rows, blk=blk)  # waits for every peer's readiness first
    yield
    return reduce_recv(bufs, h, part=y if rows else None, blk=blk)


def combine_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Phases of one combine; returns ``out_TD = sum_k gate[t, k] * y[t, k]``."""
    if bufs.hier is not None:
        return (yield from hier.combine_steps(bufs, y_ND, h))
    return (yield from _reduce_steps(bufs, y_ND, h, gated=True))


def combine_grad_steps(bufs: SymmBuffers, g_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of dispatch: ``g_TD[t] = sum_k g_ND[row of (t, k)]`` (an ungated combine)."""
    if bufs.hier is not None:
        return (yield from hier.combine_grad_steps(bufs, g_ND, h))
    return (yield from _reduce_steps(bufs, g_ND, h, gated=False))


def dispatch_grad_steps(bufs: SymmBuffers, g_TD: torch.Tensor, y_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of combine: returns ``(g_y_ND, g_gate_TK)``: ``g_y[row of (t, k)] = gate[t, k] *
    g_TD[t]`` and ``g_gate[t, k] = <g_TD[t], y[row of (t, k)]>`` (fp32; fp64 for fp64 rows)."""
    if bufs.hier is not None:
        return (yield from hier.dispatch_grad_steps(bufs, g_TD, y_ND, h))
    L = bufs.layout
    g_TD = g_TD if g_TD.stride(-1) == 1 else g_TD.contiguous()
    # waits first; this rank's own rows stay in g_TD, where the expand kernel reads them
    send_tokens(bufs, g_TD, h.send_row_TW, None, None, None, None, with_meta=False, skip_own=True)
    yield
    n = h.num_recv_rows
    g_y = torch.empty(n, L.hidden, dtype=L.dtype, device=bufs.device)
    scratch = torch.empty(n, dtype=torch.int32, device=bufs.device)
    y = y_ND if y_ND.is_contiguous() else y_ND.contiguous()
    expand(bufs, g_y, scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, y, from_meta=False, gate_grad=True,
            x_own=g_TD)
    yield
    return g_y, gate_grad_recv(bufs, h)


def combine_rows_steps(bufs: SymmBuffers, part_RD: torch.Tensor, h: SymmHandle) -> Steps:
    """Fused-EP combine: row r of ``part_RD`` (``[W*T_max, D]``, the gate-weighted sum over this
    rank's experts of receive row r) goes home; returns ``out_TD[t] = sum over ranks`` (fp32, one
    rounding). After an overlapped dispatch, first the rows' wait if the GEMMs did not enqueue it,
    and the join of the side stream that sent them (``RowsOverlap.finish``)."""
    if bufs.hier is not None:
        return (yield from hier.combine_rows_steps(bufs, part_RD, h))
    ov = h.overlap
    if ov is not None and ov.partials_sent is not None:  # the fused forward sent the peers' rows already
        if ov.partials_sent != part_RD.data_ptr():
            raise ValueError("combine_rows after an overlapped fused forward must get that forward's output as it "
                             "is: its peers' partial rows went home from there")
        ov.finish()
        yield
        return reduce_recv(bufs, h, part=part_RD, blk=h.dense, dense=h.dense)
    if ov is not None:
        ov.finish()
    if h.dense:  # the copy-engine row form: partial rows by copy engines, summed block by block as they land
        reduce_recv_shape(bufs, h.num_tokens, blk=True, dense=True)  # (a bad summing tile raises first)
        ce_ready(bufs)
        done = ce_send_partials(bufs, part_RD, h)
        yield
        out = reduce_recv(bufs, h, part=part_RD, blk=True, dense=True)
        if done is not None:
            torch.cuda.current_stream(bufs.device).wait_event(done)
        return out
    return (yield from _reduce_steps(bufs, part_RD, h, gated=False, rows=True))


def combine_rows_grad_steps(bufs: SymmBuffers, g_TD: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of :func:`combine_rows_steps`: ``g_part[r] = g_TD[token of r]`` on every rank r
    went to: the token rows travel as in dispatch; returns ``g_part_RD`` (a copy of the receive rows)."""
    if bufs.hier is not None:
        return (yield from hier.combine_rows_grad_steps(bufs, g_TD, h))
    L = bufs.layout
    g_part = torch.empty(L.recv_rows, L.hidden, dtype=L.dtype, device=bufs.device)
    # waits first; this rank's own rows go straight to g_part
    send_tokens(bufs, g_TD, h.send_row_TW, None, None, None, None, with_meta=False, own_rows=g_part,
                 rows_from=h.rows_from_W, dense=h.dense)
    yield
    scratch = torch.empty(max(1, h.num_recv_rows), dtype=torch.int32, device=bufs.device)
    # waits for every row, copies the other sources' out, then ends the op (indices go to scratch)
    expand(bufs, g_part, scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, None, from_meta=False,
            gate_grad=False, n_exp=h.num_recv_rows, copy=False, end=True, recv_copy=True)
    return g_part


def dispatch_rows_grad_steps(bufs: SymmBuffers, g_RD: torch.Tensor, g_gate_N: Optional[torch.Tensor],
                             h: SymmHandle) -> Steps:
    """Backward of ``dispatch_steps(rows=True)``: ``g_TD[t] = sum over ranks of g_RD[row of t]``
    and, with ``g_gate_N``, ``g_gate[t, k] = g_gate_N[expanded row of (t, k)]`` (fp32) sent home;
    returns ``(g_TD, g_gate_TK or None)``."""
    if bufs.hier is not None:
        return (yield from hier.dispatch_rows_grad_steps(bufs, g_RD, g_gate_N, h))
    g_RD = reduce_send(bufs, g_RD, h, gated=False, rows=True)  # waits for every peer's readiness first
    if g_gate_N is not None:
        scratch = torch.empty(max(1, h.num_recv_rows), dtype=torch.int32, device=bufs.device)
        g = g_gate_N.to(acc_dtype(bufs.layout.dtype)).contiguous()
        expand(bufs, bufs.recv_rows(), scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, g, from_meta=False,
                gate_grad=True, n_exp=h.num_recv_rows, copy=False, dgate_given=True, wait_rows=False)
    yield
    g_TD = reduce_recv(bufs, h, end=g_gate_N is None, part=g_RD)
    return g_TD, (gate_grad_recv(bufs, h) if g_gate_N is not None else None)


def run_steps(steps: Steps):
    """Runs one rank's phases straight through (a real rank, or an emulated world of one)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
