"""Naive per-token MoE: the test oracle for MoELayer and every fast path built under it.

Deliberately written as the textbook loop -- one token, one selected expert at a time, no
permutation, no grouped GEMM, no communication -- so that it shares no code (and no bug) with the
layer. Differentiable; run it in float64 to get the reference gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .config import MoEConfig

__all__ = ["moe_reference"]


def moe_reference(x_TD: torch.Tensor, router_w_ED: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor,
                  cfg: MoEConfig, shared_w13: Optional[torch.Tensor] = None, shared_w2: Optional[torch.Tensor] = None,
                  expert_bias_E: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out_TD, idx_TK, aux_loss, z_loss)`` computed token by token in ``x_TD.dtype``.

    Takes the *global* expert weights (all E experts), whatever the layer's EP degree. Routing as
    :class:`tlx_dist.Router` documents it, including group-limited selection (``cfg.n_group``,
    ``cfg.topk_group``); tokens with non-finite logits are left out of the losses (NaN policy).
    """
    T, D = x_TD.shape
    E, K, Fe = cfg.num_experts, cfg.top_k, cfg.moe_inter_dim
    outs, idxs, probs, lses = [], [], [], []
    counts = [0] * E           # every token's slots (what the layer reports as tokens_per_expert)
    finite_counts = [0] * E    # slots of tokens with finite logits (what the aux loss sees)
    for t in range(T):
        x = x_TD[t]
        logits = router_w_ED.to(x.dtype) @ x
        scores = torch.softmax(logits, 0) if cfg.score_func == "softmax" else torch.sigmoid(logits)
        select = scores.detach() + (expert_bias_E.to(scores.dtype) if cfg.load_balance_bias and expert_bias_E is not None else 0)
        if cfg.group_limited:
            allowed = torch.tensor(_best_group_experts(select, cfg.n_group, cfg.topk_group), device=select.device)
            chosen = allowed[torch.topk(select[allowed], K).indices].tolist()
        else:
            chosen = torch.topk(select, K).indices.tolist()
        gates = scores[chosen]
        if cfg.route_norm:
            gates = gates / (gates.sum() + 1e-20)
        gates = gates * cfg.route_scale
        out = torch.zeros_like(x)
        finite = bool(torch.isfinite(logits).all())
        for k, ex in enumerate(chosen):
            counts[ex] += 1
            finite_counts[ex] += finite
            h = x @ w13_EDF2[ex]
            out = out + gates[k] * ((F.silu(h[:Fe]) * h[Fe:]) @ w2_EFD[ex])
        if shared_w13 is not None:
            hs = x @ shared_w13
            half = hs.shape[0] // 2
            out = out + (F.silu(hs[:half]) * hs[half:]) @ shared_w2
        outs.append(out)
        idxs.append(chosen)
        if finite:  # NaN policy: the losses skip tokens whose logits are not all finite
            probs.append(scores if cfg.score_func == "softmax" else scores / (scores.sum() + 1e-20))
            lses.append(torch.logsumexp(logits, 0))
    out_TD = torch.stack(outs) if T else x_TD * 0  # [0, D], still in the graph
    idx_TK = torch.tensor(idxs, dtype=torch.int64).view(T, K)
    zero = x_TD.new_zeros(())
    aux, z = zero, zero
    n = len(probs)
    if cfg.aux_loss_coef > 0 and n:
        P = torch.stack(probs).mean(0)
        f = torch.tensor(finite_counts, dtype=x_TD.dtype) / (n * K)
        aux = cfg.aux_loss_coef * E * (f * P).sum()
    if cfg.z_loss_coef > 0 and n:
        z = cfg.z_loss_coef * torch.stack(lses).square().mean()
    return out_TD, idx_TK, aux, z


def _best_group_experts(select_E: torch.Tensor, n_group: int, topk_group: int) -> list[int]:
    """Ids of the experts in one token's ``topk_group`` best groups, a group scoring the sum of its
    two best experts (its one expert for groups of one). The top-K is then taken among these ids
    only: masking the other groups with -inf would tie with a chosen group's own -inf entries."""
    size = select_E.shape[0] // n_group
    group_scores = []
    for g in range(n_group):
        members = sorted(select_E[g * size:(g + 1) * size].tolist(), reverse=True)
        group_scores.append(sum(members[:2]))
    best = sorted(range(n_group), key=lambda g: group_scores[g], reverse=True)[:topk_group]
    return [g * size + j for g in sorted(best) for j in range(size)]
