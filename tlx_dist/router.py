"""Top-K router: scores, (group-limited) selection, gates, load-balancing losses, aux-loss-free bias.

Legend: T tokens, D hidden, E experts, K top-k, G expert groups (``n_group``), S = E/G experts per
group.

    logits_TE = x_TD @ W_ED^T          (fp32; bf16 operands accumulate in fp32, see router_logits)
    scores_TE = softmax(logits) | sigmoid(logits)
    select_TE = scores + bias_E        (bias only steers *selection*, DeepSeek-V3)
    [groups]    group_TG = sum of the top-2 select scores of each group's S experts; experts
                outside the topk_group best groups are excluded (DeepSeek-V3 group-limited routing)
    idx_TK    = topk(select_TE)
    gate_TK   = scores.gather(idx)  [/ sum_k]  * route_scale

Losses (both returned already multiplied by their coefficients, fp32 scalars), over the tokens whose
logits are all finite (NaN policy: a non-finite token is left out of the losses rather than turning
them into NaN; no host sync):
    aux  = coef * E * sum_e f_e * P_e,  f_e = tokens_e / (T*K),  P_e = mean_t p_te
           with p = softmax probabilities, or for sigmoid scores the per-token normalised scores;
    z    = coef * mean_t logsumexp_e(logits_te)^2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tlx

from .config import MoEConfig

__all__ = ["Router", "RouterOutput", "RoutingStats", "expert_counts", "router_logits", "group_limited_topk"]


def expert_counts(idx_TK: torch.Tensor, num_experts: int, weight_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[E]`` number of (token, k) slots routed to each expert (int64), or their summed ``weight_TK``
    (in its dtype) when given. No host sync (``bincount`` would size its output from the data)."""
    flat = idx_TK.reshape(-1).long()
    if weight_TK is None:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=idx_TK.device)
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = torch.zeros(num_experts, dtype=weight_TK.dtype, device=idx_TK.device)
    return counts.scatter_add_(0, flat, weight_TK.reshape(-1))


# --- router GEMM ---------------------------------------------------------------------------------

def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bf16/fp16 matrices with an fp32 result. On CUDA one GEMM that accumulates in
    fp32 and writes fp32 (no fp32 copy of the operands); on CPU the same numbers by upcasting (a
    product of two bf16/fp16 values is exact in fp32, so only the summation order can differ)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _RouterLinear(torch.autograd.Function):
    """``x_TD @ w_ED^T`` for bf16/fp16 ``x`` and ``w`` with fp32 logits.

    Why: the logits decide the routing, so they are kept in fp32 (a bf16 logit has ~3 significant
    digits and would turn near-ties into coin flips). But upcasting ``x_TD`` to fp32 first costs a
    [T, D] fp32 copy, kept alive for the backward, for a GEMM that is only E columns wide. Here the
    operands stay in their dtype and only the [T, E] output is fp32. Backward: ``dlogits`` is
    rounded once to the operands' dtype and both gradient GEMMs run in it with fp32 accumulation;
    the relative error this adds (2^-9 for bf16 per element) is that of rounding dx and dw to bf16,
    which happens anyway.
    """

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return _mm_f32(x_TD, w_ED.t())

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TD, w_ED = ctx.saved_tensors
        g = g_TE.to(x_TD.dtype)
        dx = g @ w_ED if ctx.needs_input_grad[0] else None
        dw = g.t() @ x_TD if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` logits ``x_TD @ w_ED^T`` in fp32 (fp64 when either operand is fp64).

    bf16/fp16 operands of one dtype go through :class:`_RouterLinear` (no fp32 copy of ``x_TD``);
    anything else (fp32, fp64, or a bf16 ``x`` with an fp32 router weight as DeepSeek-V3 keeps it)
    is upcast to the accumulation dtype first, as the fp64 reference does."""
    if x_TD.dtype == w_ED.dtype and x_TD.dtype in (torch.bfloat16, torch.float16):
        return _RouterLinear.apply(x_TD, w_ED)
    acc = torch.promote_types(torch.promote_types(torch.float32, w_ED.dtype), x_TD.dtype)
    return F.linear(x_TD.to(acc), w_ED.to(acc))


def group_limited_topk(select_TE: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3 group-limited routing: ``[T, top_k]`` int64 ids of the ``top_k`` largest entries
    of ``select_TE`` (``[T, E]``, descending) among the experts of the ``topk_group`` best of
    ``n_group`` contiguous groups, a group scoring the sum of its top-2 entries (top-1 for groups
    of one). No host sync, no data-dependent shape.

    The top-K runs over the chosen groups' entries gathered into ``[T, topk_group * E/n_group]``,
    not over ``select_TE`` with the other groups masked to ``-inf``: a chosen group's entries can be
    ``-inf`` themselves (a ``-inf`` selection bias), and a mask of the same value would tie with
    them, so the top-K could take experts of more than ``topk_group`` groups."""
    T, E = select_TE.shape
    S = E // n_group
    sel_TGS = select_TE.view(T, n_group, S)
    group_TG = sel_TGS.topk(min(2, S), dim=-1).values.sum(-1)
    groups_Tg = group_TG.topk(topk_group, dim=-1).indices
    cand_TgS = sel_TGS.gather(1, groups_Tg.unsqueeze(-1).expand(T, topk_group, S))
    pos_TK = cand_TgS.reshape(T, topk_group * S).topk(top_k, dim=-1, sorted=True).indices
    return groups_Tg.gather(1, pos_TK // S) * S + pos_TK % S


# --- the router after its GEMM in one launch (tlx/portable/router.py) --------------------------------

def _router_kernel_runs(logits_TE: torch.Tensor, cfg: MoEConfig, wanted: bool = True) -> bool:
    """Whether :class:`Router` takes the one-launch scores / top-K / loss sums
    (``tlx/portable/router.py``) instead of the torch ops: eager mode, fp32 logits, no group-limited
    selection, at least one token, wherever the kernel runs (CUDA GPUs, and CPU under
    ``TRITON_INTERPRET=1``: the tests) -- unless ``wanted`` (``Router(kernel=False)``) is False. On
    by default: one launch where the torch ops take a dozen small ones, and the layer's eager step
    was at least as fast with it on every benchmarked shape."""
    if not wanted or cfg.group_limited or logits_TE.dtype != torch.float32 or logits_TE.shape[0] == 0:
        return False
    if torch.compiler.is_compiling() or not tlx.triton_available():
        return False
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return (logits_TE.is_cuda and not interp) or (logits_TE.device.type == "cpu" and interp)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _router_block(E: int) -> int:
    """Tokens per program: a [BT, next_pow2(E)] fp32 tile of about 2K elements."""
    return max(1, min(32, 2048 // _pow2(E)))


class _RouteKernel(torch.autograd.Function):
    """``(idx_TK, gate_TK, q_E, zsum, fin_slots_E, slots_E, n_fin)`` of fp32 logits in one launch
    (see ``tlx/portable/router.py``); differentiable in the logits through ``gate_TK``, ``q_E`` (the
    aux loss's score sums) and ``zsum`` (the z loss's sum of squared logsumexps)."""

    @staticmethod
    def forward(ctx, logits_TE, bias_E, K: int, softmax: bool, route_norm: bool, scale: float):
        from tlx.portable.router import _router_fwd_kernel, _router_sums_kernel

        logits_TE = logits_TE.contiguous()
        T, E = logits_TE.shape
        bt = _router_block(E)
        nb = -(-T // bt)
        idx = torch.empty(T, K, dtype=torch.int64, device=logits_TE.device)
        gate = torch.empty(T, K, dtype=torch.float32, device=logits_TE.device)
        part = torch.empty(nb, 3 * E + 2, dtype=torch.float32, device=logits_TE.device)
        ep = _pow2(E)
        _router_fwd_kernel[(nb,)](logits_TE, bias_E if bias_E is not None else logits_TE, idx, gate, part, T,
                                  float(scale), E=E, EP=ep, K=K, KP=_pow2(K),
                                  SOFTMAX=softmax, HAS_BIAS=bias_E is not None, ROUTE_NORM=route_norm, BT=bt)
        # the block partials summed in fp64 (counts: exact) and cast, in one launch
        dev = logits_TE.device
        q_E, fin_slots_E = torch.empty(E, dtype=torch.float32, device=dev), torch.empty(E, dtype=torch.float32, device=dev)
        slots_E = torch.empty(E, dtype=torch.int64, device=dev)
        n_fin, zsum = torch.empty((), dtype=torch.float32, device=dev), torch.empty((), dtype=torch.float32, device=dev)
        bc = min(256, _pow2(3 * E + 2))
        _router_sums_kernel[(-(-(3 * E + 2) // bc),)](part, nb, q_E, fin_slots_E, slots_E, n_fin, zsum,
                                                      E=E, BC=bc, BR=max(1, 4096 // bc))
        ctx.save_for_backward(logits_TE, idx)
        ctx.meta = (K, softmax, route_norm, float(scale), bt, ep)
        ctx.mark_non_differentiable(idx, fin_slots_E, slots_E, n_fin)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: its term is skipped
        return idx, gate, q_E, zsum, fin_slots_E, slots_E, n_fin

    @staticmethod
    def backward(ctx, _g_idx, g_gate, g_q, g_zsum, _g_fs, _g_s, _g_n):
        from tlx.portable.router import _router_bwd_kernel

        logits_TE, idx = ctx.saved_tensors
        K, softmax, route_norm, scale, bt, ep = ctx.meta
        T, E = logits_TE.shape
        if g_gate is None and g_q is None and g_zsum is None:
            return None, None, None, None, None, None
        dl = torch.empty_like(logits_TE)
        dummy = logits_TE
        _router_bwd_kernel[(-(-T // bt),)](
            logits_TE, idx, g_gate.contiguous() if g_gate is not None else dummy,
            g_q.contiguous() if g_q is not None else dummy,
            g_zsum.reshape(1) if g_zsum is not None else dummy, dl, T, scale,
            E=E, EP=ep, K=K, KP=_pow2(K), SOFTMAX=softmax, ROUTE_NORM=route_norm,
            HAS_GGATE=g_gate is not None, HAS_GQ=g_q is not None, HAS_GZ=g_zsum is not None, BT=bt)
        return dl, None, None, None, None, None


@dataclass(frozen=True)
class RoutingStats:
    """What one forward of the router measured.

    tokens_per_expert: ``[E]`` int64 slots routed to each expert on this rank (no grad), every
        token counted (also a non-finite one: its slots were dispatched).
    aux_loss, z_loss: fp32 scalars, coefficient applied, part of the autograd graph; over the
        tokens with finite logits only.
    logits_TE: ``[T, E]`` fp32 router logits (in the graph), e.g. for Hugging Face's
        ``router_logits`` outputs.
    """

    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    logits_TE: Optional[torch.Tensor] = None

    @property
    def loss(self) -> torch.Tensor:
        return self.aux_loss + self.z_loss

    def load_imbalance(self) -> torch.Tensor:
        """max/mean tokens per expert (1.0 is perfectly balanced), fp32 tensor, no host sync."""
        c = self.tokens_per_expert.float()
        return c.max() / c.mean().clamp_min(1e-9)


@dataclass(frozen=True)
class RouterOutput:
    idx_TK: torch.Tensor  # int64 expert ids
    gate_TK: torch.Tensor  # fp32 gate weights
    stats: RoutingStats


class Router(nn.Module):
    """Linear gate + (group-limited) top-K selection. ``weight`` is ``[E, D]`` in
    ``cfg.router_dtype`` (default: the config dtype); logits, scores and gates are fp32 (fp64 when
    the router weight is float64). ``kernel``: after the GEMM, the one-launch scores / top-K / loss
    sums (``tlx/portable/router.py``) where they run (see :func:`_router_kernel_runs`); False: the
    torch ops everywhere (the same selection, gates and losses). A plain attribute: settable on a
    built layer (``layer.router.kernel``)."""

    def __init__(self, cfg: MoEConfig, device: Optional[torch.device] = None, kernel: bool = True):
        super().__init__()
        if type(kernel) is not bool:
            raise TypeError(f"kernel={kernel!r} must be a bool")
        self.cfg = cfg
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim, dtype=cfg.router_torch_dtype, device=device))
        # Aux-loss-free balancing state. Replicated on every rank; `update_bias` keeps it in step.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32, device=device))
        self.register_buffer("tokens_since_update", torch.zeros(cfg.num_experts, dtype=torch.int64, device=device),
                             persistent=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.init_std)
        self.expert_bias.zero_()
        self.tokens_since_update.zero_()

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        cfg = self.cfg
        logits_TE = router_logits(x_TD, self.weight)
        if _router_kernel_runs(logits_TE, cfg, self.kernel):
            return self._forward_kernel(logits_TE)
        acc = logits_TE.dtype
        if cfg.score_func == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)

        select_TE = scores_TE.detach()
        if cfg.load_balance_bias:
            select_TE = select_TE + self.expert_bias.to(acc)
        if cfg.group_limited:
            idx_TK = group_limited_topk(select_TE, cfg.n_group, cfg.topk_group, cfg.top_k)
        else:
            idx_TK = torch.topk(select_TE, cfg.top_k, dim=-1, sorted=True).indices
        gate_TK = scores_TE.gather(1, idx_TK)
        if cfg.route_norm:
            gate_TK = gate_TK / (gate_TK.sum(dim=-1, keepdim=True) + 1e-20)
        gate_TK = gate_TK * cfg.route_scale

        counts_E = expert_counts(idx_TK, cfg.num_experts)
        if self.training and cfg.load_balance_bias:
            self.tokens_since_update.add_(counts_E)

        zero = logits_TE.new_zeros(())
        aux, z = zero, zero
        if cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0:
            # NaN policy: tokens whose logits are not all finite are left out of both losses (one
            # NaN token would otherwise make them NaN). Counted on the device: no host sync.
            finite_T = torch.isfinite(logits_TE).all(dim=-1)
            n_finite = finite_T.sum().to(acc).clamp_min(1.0)  # an empty batch gives 0, not NaN
            fin_T1 = finite_T.unsqueeze(-1)
        if cfg.aux_loss_coef > 0:
            if cfg.score_func == "softmax":
                p_TE = scores_TE
            else:
                p_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
            slots_TK = fin_T1.expand_as(idx_TK).to(acc)
            f_E = expert_counts(idx_TK, cfg.num_experts, slots_TK) / (n_finite * cfg.top_k)
            P_E = torch.where(fin_T1, p_TE, 0.0).sum(dim=0) / n_finite
            aux = cfg.aux_loss_coef * cfg.num_experts * (f_E * P_E).sum()
        if cfg.z_loss_coef > 0:
            lse_T = torch.where(finite_T, torch.logsumexp(logits_TE, dim=-1), 0.0)
            z = cfg.z_loss_coef * lse_T.square().sum() / n_finite
        return RouterOutput(idx_TK, gate_TK, RoutingStats(counts_E, aux, z, logits_TE))

    def _forward_kernel(self, logits_TE: torch.Tensor) -> RouterOutput:
        """:meth:`forward` after the GEMM in one launch (``tlx/portable/router.py``) plus a few [E]
        ops for the losses: the same selection, gates, counts and losses as the torch ops."""
        cfg = self.cfg
        bias = self.expert_bias.float().contiguous() if cfg.load_balance_bias else None
        idx_TK, gate_TK, q_E, zsum, fin_slots_E, counts_E, n_fin = _RouteKernel.apply(
            logits_TE, bias, cfg.top_k, cfg.score_func == "softmax", bool(cfg.route_norm), float(cfg.route_scale))
        if self.training and cfg.load_balance_bias:
            self.tokens_since_update.add_(counts_E)
        zero = logits_TE.new_zeros(())
        aux, z = zero, zero
        if cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0:
            n_finite = n_fin.clamp_min(1.0)  # an empty batch gives 0, not NaN
        if cfg.aux_loss_coef > 0:
            aux = cfg.aux_loss_coef * cfg.num_experts * ((fin_slots_E / (n_finite * cfg.top_k)) * (q_E / n_finite)).sum()
        if cfg.z_loss_coef > 0:
            z = cfg.z_loss_coef * zsum / n_finite
        return RouterOutput(idx_TK, gate_TK, RoutingStats(counts_E, aux, z, logits_TE))

    @torch.no_grad()
    def update_bias(self, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
        """One aux-loss-free balancing step: ``bias_e += rate * sign(mean_count - count_e)`` over the
        tokens routed since the last call (summed over ``group`` when given, so that every rank
        applies the same update). Returns the counts used, then resets them."""
        counts = self.tokens_since_update.clone()
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        c = counts.float()
        self.expert_bias.add_(self.cfg.bias_update_rate * torch.sign(c.mean() - c))
        self.tokens_since_update.zero_()
        return counts
