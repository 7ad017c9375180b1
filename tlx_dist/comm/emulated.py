"""Emulated world (tier T4): W virtual ranks in one process drive the real symmetric kernels.

Each virtual rank has its own slice of one allocation and its own peer table
(:meth:`SymmBuffers.emulated`). An op is run by advancing every rank's phase generator
(``symm/steps.py``) one phase at a time, in rank order, on one stream: every kernel a phase waits on was
launched in an earlier phase, so nothing spins on a signal a later launch would raise.
Not differentiable (autograd would run one rank at a time); the gradient ops are exposed directly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .symm import (check_capacity, combine_grad_steps, combine_rows_grad_steps, combine_rows_steps, combine_steps,
                   dispatch_grad_steps, dispatch_rows_grad_steps, dispatch_steps)
from .symm.buffers import SymmBuffers
from .symm.config import ExchangeConfig
from .symm.hier_layout import leg_counters_dict

__all__ = ["EmulatedWorld", "run_lockstep", "reference_dispatch"]


def run_lockstep(gens: list) -> list:
    """Advances W phase generators together; returns their results in rank order."""
    results = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        still = []
        for v in live:
            try:
                next(gens[v])
                still.append(v)
            except StopIteration as stop:
                results[v] = stop.value
        if still and len(still) != len(live):
            raise RuntimeError("virtual ranks ran different numbers of phases")
        live = still
    return results


class EmulatedWorld:
    """W virtual ranks of one EP group on one device (``"cpu"`` runs the kernels in the Triton
    interpreter). Methods take and return per-rank lists. ``capacity``: expanded rows per rank,
    as for :class:`SymmDispatcher` (default ``"worst"``: static, no host sync). ``ranks_per_node``:
    nodes of that many ranks. Across them the exchange is the hierarchical one where
    ``config.topology`` asks for it (``"auto"``: more than one rank a node) -- in the interpreter
    over the emulated NVSHMEM route, on a GPU by pointer stores -- else the flat one over the
    emulated NVSHMEM route (interpreter only); ``nvshmem=False``: the hierarchical one by pointer
    stores in the interpreter too (``SymmBuffers.emulated``).
    ``config``: every virtual rank's :class:`ExchangeConfig`; ``copy_engine=True`` (not with
    ``config``): the copy-engine row form (``ExchangeConfig(copy_engine="on")``; copies in line:
    ``memmove`` on CPU, same-device copies on a GPU) for the row form into a region with a static
    capacity."""

    def __init__(self, world_size: int, max_tokens: int, hidden: int, top_k: int, num_experts: int,
                 dtype: torch.dtype, *, capacity="worst", device=None, timeout_s: Optional[float] = None,
                 ranks_per_node: Optional[int] = None, row_regions: int = 0, copy_engine: bool = False,
                 config: Optional[ExchangeConfig] = None, nvshmem: Optional[bool] = None):
        if copy_engine:
            if config is not None:
                raise TypeError("give copy_engine inside config= (ExchangeConfig(copy_engine='on')), not beside it")
            config = ExchangeConfig(copy_engine="on")
        self.buffers = SymmBuffers.emulated(world_size, max_tokens, hidden, top_k, num_experts, dtype,
                                            device=device, timeout_s=timeout_s, ranks_per_node=ranks_per_node,
                                            row_regions=row_regions, config=config, nvshmem=nvshmem)
        self.world_size = world_size
        self.num_experts = num_experts
        self.capacity = check_capacity(capacity)

    def _check(self, xs: Sequence, name: str) -> None:
        if len(xs) != self.world_size:
            raise ValueError(f"{name} must hold one tensor per virtual rank ({self.world_size}), got {len(xs)}")

    def dispatch(self, xs_TD: Sequence[torch.Tensor], idxs_TK: Sequence[torch.Tensor],
                 gates_TK: Optional[Sequence[torch.Tensor]] = None):
        """Returns ``[(x_exp_ND, SymmHandle)]`` per rank (gates default to 1)."""
        self._check(xs_TD, "xs_TD")
        self._check(idxs_TK, "idxs_TK")
        gates = [None] * self.world_size if gates_TK is None else gates_TK
        self._check(gates, "gates_TK")
        return run_lockstep([dispatch_steps(b, x, i, g, self.capacity)
                             for b, x, i, g in zip(self.buffers, xs_TD, idxs_TK, gates)])

    def combine(self, ys_ND: Sequence[torch.Tensor], handles: Sequence):
        """``out_TD = sum_k gate * y`` per rank, with the gates given to dispatch."""
        self._check(ys_ND, "ys_ND")
        return run_lockstep([combine_steps(b, y, h) for b, y, h in zip(self.buffers, ys_ND, handles)])

    def dispatch_grad(self, gs_TD: Sequence[torch.Tensor], ys_ND: Sequence[torch.Tensor], handles: Sequence):
        """Combine's backward: ``g_TD`` -> ``(g_y_ND, g_gate_TK)`` per rank."""
        self._check(gs_TD, "gs_TD")
        return run_lockstep([dispatch_grad_steps(b, g, y, h)
                             for b, g, y, h in zip(self.buffers, gs_TD, ys_ND, handles)])

    def combine_grad(self, gs_ND: Sequence[torch.Tensor], handles: Sequence):
        """Dispatch's backward: ``g_ND`` -> ``g_TD`` (summed over k) per rank."""
        self._check(gs_ND, "gs_ND")
        return run_lockstep([combine_grad_steps(b, g, h) for b, g, h in zip(self.buffers, gs_ND, handles)])

    # ---- the fused EP pipeline's row form (SymmDispatcher.dispatch_rows / combine_rows) ----
    def dispatch_rows(self, xs_TD: Sequence[torch.Tensor], idxs_TK: Sequence[torch.Tensor],
                      gates_TK: Sequence[torch.Tensor], region: Optional[int] = None, overlap: bool = False):
        """Returns ``[(recv_RD, src_N, gate_N, SymmHandle)]`` per rank (no expert-major copy);
        ``region``: every rank's per-layer receive region of that index (``row_regions``);
        ``overlap``: the overlapped form (``SymmDispatcher(overlap=True)``; its second send runs in
        line here, so every row has landed on return, and ``handle.overlap.wait()`` only checks
        and resets the region counters)."""
        for v, n in ((xs_TD, "xs_TD"), (idxs_TK, "idxs_TK"), (gates_TK, "gates_TK")):
            self._check(v, n)
        return run_lockstep([dispatch_steps(b, x, i, g, self.capacity, rows=True, region=region, overlap=overlap)
                             for b, x, i, g in zip(self.buffers, xs_TD, idxs_TK, gates_TK)])

    def combine_rows(self, parts_RD: Sequence[torch.Tensor], handles: Sequence):
        self._check(parts_RD, "parts_RD")
        return run_lockstep([combine_rows_steps(b, p, h) for b, p, h in zip(self.buffers, parts_RD, handles)])

    def combine_rows_grad(self, gs_TD: Sequence[torch.Tensor], handles: Sequence):
        """combine_rows' backward: ``g_TD`` -> ``g_part_RD`` per rank."""
        self._check(gs_TD, "gs_TD")
        return run_lockstep([combine_rows_grad_steps(b, g, h) for b, g, h in zip(self.buffers, gs_TD, handles)])

    def dispatch_rows_grad(self, gs_RD: Sequence[torch.Tensor], gs_gate_N: Sequence, handles: Sequence):
        """dispatch_rows' backward: ``(g_recv_RD, g_gate_N)`` -> ``(g_TD, g_gate_TK)`` per rank."""
        self._check(gs_RD, "gs_RD")
        return run_lockstep([dispatch_rows_grad_steps(b, g, gg, h)
                             for b, g, gg, h in zip(self.buffers, gs_RD, gs_gate_N, handles)])

    @property
    def hierarchical(self) -> bool:
        """Whether the world runs the hierarchical exchange (``config.topology``, ``ranks_per_node``)."""
        return self.buffers[0].hier is not None

    def leg_counters(self) -> list:
        """Per rank, the hierarchical exchange's per-leg counters as ``{name: int}`` (a host sync;
        ``SymmDispatcher.leg_counters`` gives them as device tensors); ValueError for the flat one."""
        if not self.hierarchical:
            raise ValueError("leg counters belong to the hierarchical exchange: build the world with "
                             "ranks_per_node and ExchangeConfig(topology='hierarchical' or 'auto')")
        return [leg_counters_dict(b.hier.counters) for b in self.buffers]

    def reset_leg_counters(self) -> None:
        for b in self.buffers:
            if b.hier is not None:
                b.hier.reset()

    def check(self) -> None:
        for b in self.buffers:
            b.check()

    def close(self) -> None:
        for b in self.buffers:
            b.close()


def reference_dispatch(xs_TD: Sequence[torch.Tensor], idxs_TK: Sequence[torch.Tensor], num_experts: int):
    """Pure-torch oracle of a W-rank dispatch, independent of ``layout.py``: returns per rank the
    received rows ``[n_d, D]`` (expert-major, then source rank, then source slot) and the ``[e]``
    rows per local expert. One stable sort of every slot of the world by (expert, source, slot)."""
    W = len(xs_TD)
    e = num_experts // W
    s_max = max(1, max(int(i.numel()) for i in idxs_TK))
    keys, rows = [], []
    for s, (x, idx) in enumerate(zip(xs_TD, idxs_TK)):
        K = idx.shape[1]
        flat = idx.reshape(-1).long()
        slot = torch.arange(flat.numel(), device=flat.device)
        keys.append(flat * (W * s_max) + s * s_max + slot)
        rows.append(x.index_select(0, torch.div(slot, K, rounding_mode="floor")))
    key = torch.cat(keys)
    order = torch.sort(key, stable=True).indices
    all_rows = torch.cat(rows).index_select(0, order)
    expert = torch.div(key[order], W * s_max, rounding_mode="floor")
    per_expert = torch.bincount(expert, minlength=num_experts)
    out, start = [], 0
    for d in range(W):
        cnt = per_expert[d * e:(d + 1) * e]
        n = int(cnt.sum())
        out.append((all_rows[start:start + n], cnt))
        start += n
    return out
