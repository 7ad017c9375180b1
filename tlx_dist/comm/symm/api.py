"""The exchange's public API: :class:`SymmDispatcher` (dispatch / combine and the fused EP row
form, differentiable) and :func:`ep_buffers` (one buffer set per EP group, shared by every layer)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..dispatcher import Dispatcher, check_dispatch_args
from .buffers import SymmBuffers
from .config import ExchangeConfig
from .handle import Capacity, SymmHandle, check_capacity
from .policy import adopt
from .steps import (combine_grad_steps, combine_rows_grad_steps, combine_rows_steps, combine_steps,
                    dispatch_grad_steps, dispatch_rows_grad_steps, dispatch_steps, run_steps)

__all__ = ["SymmDispatcher", "ep_buffers"]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, idx_TK, gate_TK, bufs, capacity):
        x_exp, h = run_steps(dispatch_steps(bufs, x_TD, idx_TK, gate_TK, capacity))
        ctx.h = h
        return x_exp, h

    @staticmethod
    def backward(ctx, g_exp, _g_handle):
        h = ctx.h
        return run_steps(combine_grad_steps(h.buffers, g_exp, h)), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, gate_TK, h):
        ctx.h = h
        ctx.gate_dtype = gate_TK.dtype if gate_TK is not None else None
        ctx.save_for_backward(y_ND)
        return run_steps(combine_steps(h.buffers, y_ND, h))

    @staticmethod
    def backward(ctx, g_TD):
        (y_ND,) = ctx.saved_tensors
        h = ctx.h
        g_y, g_gate = run_steps(dispatch_grad_steps(h.buffers, g_TD.contiguous(), y_ND, h))
        return g_y, (g_gate.to(ctx.gate_dtype) if ctx.gate_dtype is not None else None), None


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, gate_TK, idx_TK, bufs, capacity, region=None, overlap=False):
        recv_RD, src_N, gate_N, h = run_steps(dispatch_steps(bufs, x_TD, idx_TK, gate_TK, capacity, rows=True,
                                                             region=region, overlap=overlap))
        ctx.h, ctx.gate_dtype = h, gate_TK.dtype
        ctx.mark_non_differentiable(src_N)
        return recv_RD, src_N, gate_N, h

    @staticmethod
    def backward(ctx, g_RD, _g_src, g_gate_N, _g_handle):
        h = ctx.h
        if g_RD is None:
            g_RD = torch.zeros(h.buffers.layout.recv_rows, h.buffers.layout.hidden, dtype=h.buffers.layout.dtype,
                               device=h.buffers.device)
        g_TD, g_gate = run_steps(dispatch_rows_grad_steps(h.buffers, g_RD, g_gate_N, h))
        return g_TD, (g_gate.to(ctx.gate_dtype) if g_gate is not None else None), None, None, None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part_RD, h):
        ctx.h = h
        return run_steps(combine_rows_steps(h.buffers, part_RD, h))

    @staticmethod
    def backward(ctx, g_TD):
        h = ctx.h
        return run_steps(combine_rows_grad_steps(h.buffers, g_TD.contiguous(), h)), None


_EP_BUFFERS: dict = {}


def ep_buffers(group: Optional[dist.ProcessGroup], max_tokens: int, hidden: int, top_k: int, num_experts: int,
               dtype: torch.dtype, device=None, timeout_s: Optional[float] = None, row_regions: int = 0,
               config: Optional[ExchangeConfig] = None, ranks_per_node: Optional[int] = None) -> SymmBuffers:
    """The one :class:`SymmBuffers` of an EP group for these sizes: built (collectively) on the
    first call, returned from a cache afterwards, so every layer of a model shares it. Every rank
    of ``group`` must call it with the same arguments. ``config``: the settings its ops run with
    (``policy.adopt``: a cached set running another config raises); its ``timeout_s`` (or
    ``timeout_s``) is part of the key, and so is ``ranks_per_node`` (the node placement,
    :class:`SymmBuffers`). ``close()`` on the result frees it (the next call builds a new set)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if config is not None and config.timeout_s is not None:
        if timeout_s is not None and float(timeout_s) != float(config.timeout_s):
            raise ValueError(f"timeout_s={timeout_s!r} differs from config.timeout_s={config.timeout_s!r}: give one")
        timeout_s = config.timeout_s
    key = (id(group), max_tokens, hidden, top_k, num_experts, dtype, str(device), timeout_s, row_regions,
           ranks_per_node)
    bufs = _EP_BUFFERS.get(key)
    if bufs is None or bufs.closed:
        bufs = SymmBuffers(max_tokens, hidden, top_k, num_experts, dtype, group, device=device, timeout_s=timeout_s,
                           row_regions=row_regions, config=config, ranks_per_node=ranks_per_node)
        _EP_BUFFERS[key] = bufs
    elif config is not None:
        adopt(bufs, config)
    return bufs


_COPY_ENGINE = {"auto": "auto", True: "on", False: "off", "on": "on", "off": "off"}


def _shorthand_config(config: Optional[ExchangeConfig], timeout_s, overlap, copy_engine) -> Optional[ExchangeConfig]:
    """``config``, or the default with the shorthand arguments folded in, or None (nothing asked)."""
    given = {k: v for k, v in (("timeout_s", timeout_s), ("overlap", overlap), ("copy_engine", copy_engine))
             if v is not None}
    if copy_engine is not None and (not isinstance(copy_engine, (str, bool)) or copy_engine not in _COPY_ENGINE):
        raise ValueError(f"copy_engine={copy_engine!r} must be 'auto', True or False (or 'on' / 'off')")
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"overlap={overlap!r} must be a bool")
    if config is not None:
        if not isinstance(config, ExchangeConfig):
            raise TypeError(f"config must be an ExchangeConfig, got {type(config).__name__}")
        if given:
            raise TypeError(f"give {', '.join(sorted(given))} inside config= (dataclasses.replace(config, ...)), "
                            "not beside it")
        return config
    if not given:
        return None
    if "copy_engine" in given:
        given["copy_engine"] = _COPY_ENGINE[copy_engine]
    try:
        return ExchangeConfig(**given)
    except ValueError as e:  # (name the argument, not the config field)
        raise ValueError(str(e).replace("ExchangeConfig.", "", 1)) from None


class SymmDispatcher(Dispatcher):
    """Deduplicated dispatch/combine through symmetric memory (see the package docstring).

    Args:
        num_experts: E.
        group: the EP process group (``None``: one rank).
        buffers: the group's :class:`SymmBuffers` (:func:`ep_buffers`); when omitted they are taken
            from :func:`ep_buffers` on the first dispatch, sized by ``max_tokens`` (or the largest
            first T over the group: one host sync, once).
        capacity: expanded rows per rank: ``"exact"`` (default; one host sync per dispatch),
            ``"worst"``, a float factor of ``T_max*K``, or an int (see the package docstring).
        validate: check expert ids (syncs the host).
        row_regions: per-layer receive regions for the row form (default 0: none): each layer that
            claims one (:meth:`claim_rows_region`; ``MoELayer`` does at construction) gets its
            dispatched rows left where they land, read there by its fused GEMMs (no receive-side
            copy, no per-step ``[W*T_max, D]`` allocation). Peers may overwrite a region once this
            rank has ended the op before the next dispatch into it, so every reader of a layer's
            rows must be enqueued before that op ends: true in a forward/backward step (each
            layer's backward ends with the dispatch's backward op, after its weight gradients), with
            gradient accumulation and with recomputation; not for a layer whose forward runs twice
            before its backward (pipeline-parallel micro-batches in flight) -- that raises in the
            backward (each dispatch bumps the region's autograd version). Peer pointers only (the
            NVSHMEM route copies as before and reserves none). Costs ``row_regions * W*T_max*D``
            elements of symmetric memory per rank; every rank must claim the same regions (checked
            once, at the first dispatch).
        config: the exchange's settings (:class:`ExchangeConfig`: launch shapes, the copy-engine row
            form, the arrival-driven overlap, the receive and combine modes, the topology -- flat, or
            hierarchical across nodes, :meth:`leg_counters` -- and the wait timeout).
            They belong to the buffer set: every dispatcher that shares one must give the same
            config (a different one raises), and a dispatcher given none runs with its set's.
        ranks_per_node: global ranks a node, where the group's placement is not torchrun's
            ``LOCAL_WORLD_SIZE`` (a training recipe's ``parallel.ranks_per_node``, which may pose one
            machine's ranks as several nodes): decides which peers are reached by NVSHMEM and the
            hierarchical exchange's nodes (``config.topology``). Default None: ``LOCAL_WORLD_SIZE``.
        timeout_s, overlap, copy_engine: shorthands for those fields of a default config (not
            together with ``config``): ``timeout_s`` seconds a wait spins before it records an error
            (default 30); ``overlap=True`` the arrival-driven overlap of the fused EP pipeline;
            ``copy_engine`` ``"auto"`` / ``True`` / ``False`` the copy-engine row form (see
            :class:`ExchangeConfig`).
    """

    def __init__(self, num_experts: int, group: Optional[dist.ProcessGroup] = None, *,
                 buffers: Optional[SymmBuffers] = None, max_tokens: Optional[int] = None,
                 capacity: Capacity = "exact", validate: bool = True, row_regions: int = 0,
                 config: Optional[ExchangeConfig] = None, ranks_per_node: Optional[int] = None,
                 timeout_s: Optional[float] = None, overlap: Optional[bool] = None,
                 copy_engine: Union[str, bool, None] = None, **removed):
        if "bulk_send" in removed:
            raise TypeError("SymmDispatcher(bulk_send=...) was removed: the bulk-copy send moved rows no faster than "
                            "the register copy (docs/decisions.md); drop the argument")
        if removed:
            raise TypeError(f"SymmDispatcher() got unexpected keyword argument(s) {sorted(removed)}")
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if buffers is not None:
            if not isinstance(buffers, SymmBuffers):
                raise TypeError(f"buffers must be a SymmBuffers, got {type(buffers).__name__}")
            world, rank = buffers.world_size, buffers.rank
        super().__init__(num_experts, world, rank, validate)
        if buffers is not None and buffers.layout.num_experts != num_experts:
            raise ValueError(f"buffers were built for num_experts={buffers.layout.num_experts}, not {num_experts}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be a positive integer")
        if isinstance(row_regions, bool) or not isinstance(row_regions, int) or row_regions < 0:
            raise ValueError(f"row_regions={row_regions!r} must be a non-negative int")
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node={ranks_per_node!r} must be None or a positive integer")
        if buffers is not None and ranks_per_node is not None:
            raise ValueError("ranks_per_node places the ranks of the buffers this dispatcher builds: give it to "
                             "the buffers (ep_buffers(ranks_per_node=...)), not beside them")
        if buffers is not None and buffers.layout.row_regions < row_regions:
            raise ValueError(f"buffers hold {buffers.layout.row_regions} row regions, fewer than row_regions="
                             f"{row_regions}: build them with SymmBuffers(row_regions=...) / ep_buffers(row_regions=...)")
        self._asked = _shorthand_config(config, timeout_s, overlap, copy_engine)  # None: the buffer set's
        self.group = group
        self.buffers = buffers
        self.max_tokens = max_tokens
        self.capacity = check_capacity(capacity)
        self.row_regions = row_regions
        self.ranks_per_node = ranks_per_node
        self._claimed_regions = 0
        if buffers is not None and self._asked is not None:
            adopt(buffers, self._asked)

    @property
    def config(self) -> ExchangeConfig:
        """The settings this dispatcher's ops run with: its buffer set's once it has one."""
        if self.buffers is not None:
            return self.buffers.config
        return self._asked if self._asked is not None else ExchangeConfig()

    @property
    def overlap(self) -> bool:
        return self.config.overlap

    def claim_rows_region(self) -> Optional[int]:
        """The next free per-layer receive region (``row_regions``), or None when none is left (the
        layer then gets copies). Claims are made in model-construction order, the same on every rank."""
        if self._claimed_regions >= self.row_regions:
            return None
        self._claimed_regions += 1
        return self._claimed_regions - 1

    def _check_ranks_agree(self) -> None:
        """Every rank must have handed out the same regions (the senders store a layer's rows at
        its region's offset on the receiver) and ask for the same config (senders and receivers
        must take the same forms): one collective when the buffers are first needed."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        asked = repr(self._asked if self._asked is not None else ExchangeConfig())  # (None builds the default)
        digest = int.from_bytes(hashlib.sha256(asked.encode()).digest()[:7], "little")
        t = torch.tensor([self._claimed_regions, -self._claimed_regions, digest, -digest], dtype=torch.int64,
                         device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            raise RuntimeError(f"ranks claimed different numbers of receive regions ({lo} to {hi}; this rank "
                               f"{self._claimed_regions}): every rank must build the same MoE layers in the same order")
        if int(t[2]) != -int(t[3]):
            raise RuntimeError(f"ranks asked for different exchange configs (this rank: {asked}): every rank of the "
                               "EP group must give its SymmDispatcher the same ExchangeConfig")

    def _buffers_for(self, x_TD: torch.Tensor, K: int) -> SymmBuffers:
        if self.buffers is None:
            self._check_ranks_agree()
            T = self.max_tokens
            if T is None:
                t = torch.tensor([max(1, x_TD.shape[0])], device=x_TD.device)
                if self.group is not None:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                T = int(t.item())  # one-time setup sync
            self.buffers = ep_buffers(self.group, T, x_TD.shape[1], K, self.num_experts, x_TD.dtype,
                                      device=x_TD.device, row_regions=self.row_regions, config=self._asked,
                                      ranks_per_node=self.ranks_per_node)
        return self.buffers

    def dispatch(self, x_TD, idx_TK, gate_TK=None):
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        if gate_TK is not None and (not isinstance(gate_TK, torch.Tensor) or gate_TK.shape != idx_TK.shape):
            raise ValueError(f"gate_TK must be a tensor of idx_TK's shape {tuple(idx_TK.shape)}, "
                             f"got {getattr(gate_TK, 'shape', type(gate_TK))}")
        bufs = self._buffers_for(x_TD, idx_TK.shape[1])
        return _Dispatch.apply(x_TD, idx_TK, gate_TK, bufs, self.capacity)

    def dispatch_payload(self, payload_TP, idx_TK, gate_TK, x_TD):
        """:meth:`Dispatcher.dispatch_payload` over symmetric memory: the payload rows cross through a
        second buffer set of width P (:func:`ep_buffers`, the same T_max, top-k, experts, dtype and
        config as this dispatcher's own set), each token row once per destination rank, the gates
        travelling with them as in :meth:`dispatch`; the returned handle belongs to the own set (width
        D): :meth:`combine_weighted` and :meth:`dispatch_backward` run there."""
        check_dispatch_args(payload_TP, idx_TK, self.num_experts, self.validate)
        if gate_TK is not None and (not isinstance(gate_TK, torch.Tensor) or gate_TK.shape != idx_TK.shape):
            raise ValueError(f"gate_TK must be a tensor of idx_TK's shape {tuple(idx_TK.shape)}, "
                             f"got {getattr(gate_TK, 'shape', type(gate_TK))}")
        if payload_TP.dtype != x_TD.dtype or payload_TP.shape[0] != x_TD.shape[0]:
            raise ValueError(f"payload_TP must be [T={x_TD.shape[0]}, P] {x_TD.dtype} (x_TD's rows and dtype), got "
                             f"{tuple(payload_TP.shape)} {payload_TP.dtype}")
        bufs = self._buffers_for(x_TD, idx_TK.shape[1])
        L = bufs.layout
        pbufs = ep_buffers(self.group, L.max_tokens, payload_TP.shape[1], L.top_k, self.num_experts, L.dtype,
                           device=bufs.device, config=bufs.config)
        with torch.no_grad():
            recv, h = run_steps(dispatch_steps(pbufs, payload_TP, idx_TK, gate_TK, self.capacity))
        return recv, dataclasses.replace(h, buffers=bufs)

    def dispatch_backward(self, g_ND, handle):
        """:meth:`Dispatcher.dispatch_backward` over symmetric memory (an ungated combine)."""
        if not isinstance(handle, SymmHandle):
            raise TypeError(f"handle must come from SymmDispatcher.dispatch_payload, got {type(handle).__name__}")
        with torch.no_grad():
            return run_steps(combine_grad_steps(handle.buffers, g_ND.contiguous(), handle))

    def dispatch_rows(self, x_TD, idx_TK, gate_TK, region: Optional[int] = None):
        """The fused EP pipeline's dispatch: the token rows cross once per destination rank and
        stay as received (no expert-major copy). Returns ``(recv_RD, src_N, gate_N, handle)``:
        ``recv_RD`` ``[W*T_max, D]`` receive rows, ``src_N`` ``[N]`` int32 receive row of each
        expanded (expert-major) row, ``gate_N`` ``[N]`` fp32 its gate, differentiable back to
        ``x_TD`` and ``gate_TK``; ``handle.offsets_e`` are the local experts' end rows. Feed them to
        :func:`tlx_dist.fused.fused_experts_rows` with ``dst_N = src_N`` and
        ``num_dst = recv_RD.shape[0]``, then :meth:`combine_rows`. ``region`` (from
        :meth:`claim_rows_region`): ``recv_RD`` is that per-layer receive region, where the rows
        landed (no copy; valid until the next dispatch into it). With ``config.overlap`` (and a
        region, a static capacity, peer pointers) the peers' rows may still be landing on return:
        pass ``handle.overlap`` to ``fused_experts_rows(overlap=...)`` (or call
        ``handle.overlap.wait()`` before reading ``recv_RD``); :meth:`combine_rows` must follow (it
        joins the side stream)."""
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        if not isinstance(gate_TK, torch.Tensor) or gate_TK.shape != idx_TK.shape or not gate_TK.is_floating_point():
            raise ValueError(f"gate_TK must be a float tensor of idx_TK's shape {tuple(idx_TK.shape)}, "
                             f"got {getattr(gate_TK, 'shape', type(gate_TK))}")
        bufs = self._buffers_for(x_TD, idx_TK.shape[1])
        return _DispatchRows.apply(x_TD, gate_TK, idx_TK, bufs, self.capacity, region, bufs.config.overlap)

    def combine_rows(self, part_RD, handle):
        """``out_TD[t] = sum over the ranks t went to of part_RD[row of t there]`` (fp32, one
        rounding); differentiable in ``part_RD``. ``part_RD``: ``[W*T_max, D]``, row r the
        gate-weighted sum of this rank's experts for receive row r."""
        if not isinstance(handle, SymmHandle):
            raise TypeError(f"handle must come from SymmDispatcher.dispatch_rows, got {type(handle).__name__}")
        L = handle.buffers.layout
        if not isinstance(part_RD, torch.Tensor) or part_RD.shape != (L.recv_rows, L.hidden) or part_RD.dtype != L.dtype:
            raise ValueError(f"part_RD must be [{L.recv_rows}, {L.hidden}] {L.dtype}, got "
                             f"{tuple(getattr(part_RD, 'shape', ()))} {getattr(part_RD, 'dtype', type(part_RD))}")
        return _CombineRows.apply(part_RD, handle)

    def combine(self, y_ND, handle):
        raise NotImplementedError("SymmDispatcher returns one row per token (the gate-weighted sum over its "
                                  "experts, summed where they live): use combine_weighted(y_ND, handle, gate_TK)")

    def combine_weighted(self, y_ND, handle, gate_TK):
        self._check_combine(y_ND, handle)
        if not isinstance(handle, SymmHandle):
            raise TypeError(f"handle must come from SymmDispatcher.dispatch, got {type(handle).__name__}")
        L = handle.buffers.layout
        if y_ND.dtype != L.dtype or y_ND.shape[1] != L.hidden:
            raise ValueError(f"y_ND must be [N, {L.hidden}] {L.dtype}, got {tuple(y_ND.shape)} {y_ND.dtype}")
        if gate_TK is not handle.gate_TK:
            raise ValueError("gate_TK must be the tensor given to dispatch: its gates travelled with the tokens "
                             "and are applied where the experts live")
        return _Combine.apply(y_ND, gate_TK, handle)

    @property
    def topology(self) -> Optional[str]:
        """``"hierarchical"`` or ``"flat"``: the exchange its buffer set runs (None before the first
        dispatch builds one; ``config.topology`` decides, from the group's nodes)."""
        if self.buffers is None:
            return None
        return "hierarchical" if self.buffers.hier is not None else "flat"

    def leg_counters(self) -> Optional[torch.Tensor]:
        """The hierarchical exchange's per-leg counters: int64 ``[8]`` on the device (no host sync),
        rows and payload bytes sent over the NIC and into other ranks of the node, by dispatch- and by
        combine-direction ops (``tlx_dist.comm.symm.LEG_COUNTERS`` names them), summed over every op of
        the buffer set (every layer) since :meth:`reset_leg_counters`. None for the flat exchange."""
        if self.buffers is None or self.buffers.hier is None:
            return None
        return self.buffers.hier.counters

    def reset_leg_counters(self) -> None:
        if self.buffers is not None and self.buffers.hier is not None:
            self.buffers.hier.reset()

    def check(self, capacity_hint: str = "the dispatcher's capacity") -> None:
        """Raises if a wait gave up or expanded rows overflowed (host sync; see SymmBuffers.check)."""
        if self.buffers is not None:
            self.buffers.check(capacity_hint)

    def extra_repr(self) -> Optional[str]:
        return f"{super().extra_repr()}, capacity={self.capacity!r}, buffers={self.buffers!r}"
