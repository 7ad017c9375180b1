"""Top-K router: scores, selection, gates, load-balancing losses, aux-loss-free bias.

Legend: T tokens, D hidden, E experts, K top-k.

    logits_TE = x_TD @ W_ED^T          (fp32)
    scores_TE = softmax(logits) | sigmoid(logits)
    idx_TK    = topk(scores + bias_E)  (bias only steers *selection*, DeepSeek-V3)
    gate_TK   = scores.gather(idx)  [/ sum_k]  * route_scale

Losses (both returned already multiplied by their coefficients, fp32 scalars):
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

__all__ = ["Router", "RouterOutput", "RoutingStats", "expert_counts"]


def expert_counts(idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64 number of (token, k) slots routed to each expert. No host sync
    (``bincount`` would size its output from the data)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx_TK.device)
    return counts.scatter_add_(0, idx_TK.reshape(-1).long(), torch.ones_like(idx_TK.reshape(-1), dtype=torch.int64))


@dataclass(frozen=True)
class RoutingStats:
    """What one forward of the router measured.

    tokens_per_expert: ``[E]`` int64 slots routed to each expert on this rank (no grad).
    aux_loss, z_loss: fp32 scalars, coefficient applied, part of the autograd graph.
    """

    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor

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
    """Linear gate + top-K selection. ``weight`` is ``[E, D]`` in the config dtype; logits, scores
    and gates are fp32 (fp64 when the config dtype is float64)."""

    def __init__(self, cfg: MoEConfig, device: Optional[torch.device] = None):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim, dtype=cfg.torch_dtype, device=device))
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
        acc = torch.promote_types(torch.float32, self.weight.dtype)  # fp32 (fp64 for fp64 layers)
        logits_TE = F.linear(x_TD.to(acc), self.weight.to(acc))
        if cfg.score_func == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)

        select_TE = scores_TE + self.expert_bias.to(acc) if cfg.load_balance_bias else scores_TE
        idx_TK = torch.topk(select_TE.detach(), cfg.top_k, dim=-1, sorted=True).indices
        gate_TK = scores_TE.gather(1, idx_TK)
        if cfg.route_norm:
            gate_TK = gate_TK / (gate_TK.sum(dim=-1, keepdim=True) + 1e-20)
        gate_TK = gate_TK * cfg.route_scale

        counts_E = expert_counts(idx_TK, cfg.num_experts)
        if self.training and cfg.load_balance_bias:
            self.tokens_since_update.add_(counts_E)

        zero = logits_TE.new_zeros(())
        aux = zero
        if cfg.aux_loss_coef > 0:
            if cfg.score_func == "softmax":
                p_TE = scores_TE
            else:
                p_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
            T = x_TD.shape[0]
            f_E = counts_E.to(p_TE.dtype) / max(T * cfg.top_k, 1)
            P_E = p_TE.sum(dim=0) / max(T, 1)  # not .mean(): an empty batch gives 0, not NaN
            aux = cfg.aux_loss_coef * cfg.num_experts * (f_E * P_E).sum()
        z = zero
        if cfg.z_loss_coef > 0:
            z = cfg.z_loss_coef * torch.logsumexp(logits_TE, dim=-1).square().sum() / max(x_TD.shape[0], 1)
        return RouterOutput(idx_TK, gate_TK, RoutingStats(counts_E, aux, z))

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
