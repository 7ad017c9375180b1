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

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .config import MoEConfig

__all__ = ["Router", "RouterOutput", "RoutingStats", "expert_counts", "router_logits", "group_limited_select"]


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


def group_limited_select(select_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3 group-limited routing: ``select_TE`` with ``-inf`` on every expert outside the
    ``topk_group`` best of ``n_group`` contiguous groups, a group scoring the sum of its top-2
    entries (top-1 for groups of one expert). No host sync, no data-dependent shape."""
    T, E = select_TE.shape
    S = E // n_group
    group_TG = select_TE.view(T, n_group, S).topk(min(2, S), dim=-1).values.sum(-1)
    keep_TG = torch.zeros(T, n_group, dtype=torch.bool, device=select_TE.device)
    keep_TG.scatter_(1, group_TG.topk(topk_group, dim=-1).indices, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(T, n_group, S).reshape(T, E)
    return select_TE.masked_fill(~keep_TE, float("-inf"))


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
    the router weight is float64)."""

    def __init__(self, cfg: MoEConfig, device: Optional[torch.device] = None):
        super().__init__()
        self.cfg = cfg
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
        acc = logits_TE.dtype
        if cfg.score_func == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)

        select_TE = scores_TE.detach()
        if cfg.load_balance_bias:
            select_TE = select_TE + self.expert_bias.to(acc)
        if cfg.group_limited:
            select_TE = group_limited_select(select_TE, cfg.n_group, cfg.topk_group)
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
