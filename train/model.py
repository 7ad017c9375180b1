"""A small decoder-only MoE transformer, written for one device.

Legend: B batch, S sequence, D hidden, H heads, Dh = D / H head dim, V vocab, L layers.

    h_BSD = embed(tokens_BS)
    for each block:   h = h + attn(rmsnorm(h))             causal SDPA with RoPE
                      h = h + ffn(rmsnorm(h))              dense SwiGLU (first n_dense_layers) or MoELayer
    logits_BSV = head(rmsnorm(h))

Parallelism is not written here: ``train.parallelize`` builds the model with an expert-parallel
group for the MoE layers (``tlx_dist.MoELayer`` owns the token exchange) and applies FSDP2.
``init_weights(seed)`` draws every weight from ``seed`` so that any expert-parallel degree starts
from the same model (experts are drawn per global expert id, see ``tlx_dist.moe``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tlx_dist import MoELayer

from .config import ModelConfig

__all__ = ["Transformer", "rope_tables"]


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[S, Dh/2]`` fp32 for rotary embeddings (rotating pairs (2i, 2i+1))."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    return ang.cos(), ang.sin()


def apply_rope(x_BHSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    x = x_BHSd.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack((x0 * cos_Sd - x1 * sin_Sd, x0 * sin_Sd + x1 * cos_Sd), dim=-1)
    return out.flatten(-2).to(x_BHSd.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False, device=device)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False, device=device)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.wqkv(x_BSD).view(B, S, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, Dh]
        return self.wo(o.transpose(1, 2).reshape(B, S, D))


class DenseMLP(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, inter: int, device=None):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * inter, bias=False, device=device)
        self.w2 = nn.Linear(inter, dim, bias=False, device=device)

    def forward(self, x):
        g, u = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ep_group: Optional[dist.ProcessGroup],
                 gemm_backend: Optional[str], device=None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.attn = Attention(cfg, device)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        if layer_id < cfg.n_dense_layers:
            self.ffn: nn.Module = DenseMLP(cfg.dim, cfg.dense_inter_dim, device)
        else:
            self.ffn = MoELayer(cfg.moe, ep_group=ep_group, gemm_backend=gemm_backend, device=device)

    @property
    def moe(self) -> Optional[MoELayer]:
        return self.ffn if isinstance(self.ffn, MoELayer) else None

    def forward(self, h, cos, sin):
        h = h + self.attn(self.attn_norm(h), cos, sin)
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens_BS int64) -> logits_BSV`` (fp32). ``aux_loss()`` sums the MoE layers'
    aux + z losses of the last forward (in the graph)."""

    def __init__(self, cfg: ModelConfig, ep_group: Optional[dist.ProcessGroup] = None,
                 gemm_backend: Optional[str] = None, device=None, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.layers = nn.ModuleList(Block(cfg, i, ep_group, gemm_backend, device) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        self._rope_len = 0
        self.init_weights(seed)

    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.layers if b.moe is not None]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic in ``seed`` and independent of the expert-parallel degree: the global RNG
        is consumed in the same order whatever the number of local experts."""
        torch.manual_seed(seed)
        std = self.cfg.moe.init_std
        nn.init.normal_(self.embed.weight, std=1.0)
        for i, b in enumerate(self.layers):
            nn.init.normal_(b.attn.wqkv.weight, std=std)
            # Residual-branch outputs scaled down with depth (GPT-2 / torchtitan habit).
            nn.init.normal_(b.attn.wo.weight, std=std / (2 * (i + 1)) ** 0.5)
            if b.moe is not None:
                b.moe.reset_parameters(seed=seed * 1_000_003 + 7919 * (i + 1))
            else:
                nn.init.normal_(b.ffn.w13.weight, std=std)
                nn.init.normal_(b.ffn.w2.weight, std=std / (2 * (i + 1)) ** 0.5)
            b.attn_norm.reset_parameters()
            b.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.head.weight, std=self.cfg.dim ** -0.5)

    def _rope(self, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        # Cached outside the parameter/buffer lists so FSDP and checkpoints never see it.
        if self._rope_len < S or self._rope_cos.device != device:
            self._rope_cos, self._rope_sin = rope_tables(S, self.cfg.head_dim, self.cfg.rope_theta, device)
            self._rope_len = S
        return self._rope_cos[:S], self._rope_sin[:S]

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens_BS)
        cos, sin = self._rope(tokens_BS.shape[1], h.device)
        for b in self.layers:
            h = b(h, cos, sin)
        return self.head(self.norm(h)).float()

    def aux_loss(self) -> torch.Tensor:
        losses = [m.aux_loss for m in self.moe_layers()]
        return torch.stack(losses).sum() if losses else torch.zeros(())
