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

The dense part of a block (norms, attention, residual; the dense MLP) and the loss (final norm,
head, cross-entropy) are plain functions of their weights (``attention_residual``, ``dense_mlp``,
``lm_loss``): the modules hold the parameters, the functions hold the math, and
``Transformer.set_compile(True)`` swaps in one ``torch.compile``d copy of each function shared
by every block (same shapes, so one compilation each). The MoE layers stay eager.
``Transformer.set_activation_checkpoint("moe" | "full")`` recomputes the MoE FFNs or whole blocks
in the backward (``torch.utils.checkpoint``, non-reentrant).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tlx_dist import MoELayer

from .config import ModelConfig

__all__ = ["Transformer", "rope_tables", "attention_residual", "dense_mlp", "lm_loss"]


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


def attention_residual(h_BSD: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor,
                       attn_norm_D: torch.Tensor, wqkv_3DD: torch.Tensor, wo_DD: torch.Tensor,
                       ffn_norm_D: torch.Tensor, n_heads: int, eps: float):
    """``h = h + wo(attn(rmsnorm(h)))`` (causal SDPA, RoPE) and ``rmsnorm_ffn(h)``.

    h_BSD: residual stream; cos/sin ``[S, Dh/2]`` fp32; weights as in ``nn.Linear`` (``[out, in]``).
    Returns ``(h_BSD, x_BSD)`` with ``x = rmsnorm(h, ffn_norm_D)``, the FFN's input.
    """
    B, S, D = h_BSD.shape
    x = F.rms_norm(h_BSD, (D,), attn_norm_D, eps)
    q, k, v = F.linear(x, wqkv_3DD).view(B, S, 3, n_heads, D // n_heads).permute(2, 0, 3, 1, 4)
    q, k = apply_rope(q, cos_Sd, sin_Sd), apply_rope(k, cos_Sd, sin_Sd)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, Dh]
    h_BSD = h_BSD + F.linear(o.transpose(1, 2).reshape(B, S, D), wo_DD)
    return h_BSD, F.rms_norm(h_BSD, (D,), ffn_norm_D, eps)


def dense_mlp(x_BSD: torch.Tensor, w13_2ID: torch.Tensor, w2_DI: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``w2(silu(w1 x) * w3 x)``; ``w13 = [w1; w3]`` as ``[2I, D]``, ``w2`` as ``[D, I]``."""
    g, u = F.linear(x_BSD, w13_2ID).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2_DI)


def lm_loss(h_BSD: torch.Tensor, norm_D: torch.Tensor, head_VD: torch.Tensor, targets_BS: torch.Tensor,
            eps: float) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(rmsnorm(h))`` with fp32 logits; a 0-dim fp32 tensor."""
    logits = F.linear(F.rms_norm(h_BSD, (h_BSD.shape[-1],), norm_D, eps), head_VD).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets_BS.reshape(-1))


_EAGER = {"attention_residual": attention_residual, "dense_mlp": dense_mlp, "lm_loss": lm_loss}


class Attention(nn.Module):
    """Holds the attention weights; the math is :func:`attention_residual`."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False, device=device)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False, device=device)


class DenseMLP(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` (:func:`dense_mlp`)."""

    def __init__(self, dim: int, inter: int, device=None):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * inter, bias=False, device=device)
        self.w2 = nn.Linear(inter, dim, bias=False, device=device)
        self.fn: Callable = dense_mlp

    def forward(self, x):
        return self.fn(x, self.w13.weight, self.w2.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ep_group: Optional[dist.ProcessGroup],
                 gemm_backend: Optional[str], device=None, dispatcher="auto", pipeline: str = "auto"):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.attn = Attention(cfg, device)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        if layer_id < cfg.n_dense_layers:
            self.ffn: nn.Module = DenseMLP(cfg.dim, cfg.dense_inter_dim, device)
        else:
            self.ffn = MoELayer(cfg.moe, ep_group=ep_group, gemm_backend=gemm_backend, device=device,
                                dispatcher=dispatcher, pipeline=pipeline)
        self.layer_id = layer_id
        self.attn_fn: Callable = attention_residual
        self.checkpoint = "none"   # "none" | "moe" | "full" (Transformer.set_activation_checkpoint)

    @property
    def moe(self) -> Optional[MoELayer]:
        return self.ffn if isinstance(self.ffn, MoELayer) else None

    def _forward(self, h, cos, sin):
        h, x = self.attn_fn(h, cos, sin, self.attn_norm.weight, self.attn.wqkv.weight, self.attn.wo.weight,
                            self.ffn_norm.weight, self.attn.n_heads, self.attn_norm.eps)
        if self.checkpoint == "moe" and self.moe is not None and torch.is_grad_enabled():
            return h + checkpoint(self.ffn, x, use_reentrant=False)
        return h + self.ffn(x)

    def forward(self, h, cos, sin):
        if self.checkpoint == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, h, cos, sin, use_reentrant=False)
        return self._forward(h, cos, sin)


def _inductor_in_process_with_fbtriton() -> None:
    """With fbtriton (the TLX build of Triton) in place of the Triton release torch was built
    against, inductor's compile-worker subprocesses fail with "Could not find an active GPU
    backend" (seen on an H200: torch 2.11 + fbtriton 3.7.4): they have no CUDA context and rely on
    the matching release's offline target path. Compiling in-process avoids it."""
    from importlib import metadata
    try:
        metadata.version("fbtriton")
    except metadata.PackageNotFoundError:
        return
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = 1


class Transformer(nn.Module):
    """``forward(tokens_BS int64) -> logits_BSV`` (fp32); ``forward(tokens_BS, targets_BS)`` ->
    the mean cross-entropy (0-dim fp32; the loss goes through ``forward`` so that FSDP's hooks
    run). ``aux_loss()`` sums the MoE layers' aux + z losses of the last forward (in the graph)."""

    def __init__(self, cfg: ModelConfig, ep_group: Optional[dist.ProcessGroup] = None,
                 gemm_backend: Optional[str] = None, device=None, seed: int = 0, dispatcher="auto",
                 pipeline: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        # ``dispatcher``: a name, or one Dispatcher instance shared by every MoE layer (it holds no
        # per-layer state; the symmetric one shares its group's buffers).
        self.layers = nn.ModuleList(Block(cfg, i, ep_group, gemm_backend, device, dispatcher, pipeline)
                                    for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, device=device)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        self._rope_len = 0
        self.loss_fn: Callable = lm_loss
        self.init_weights(seed)

    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.layers if b.moe is not None]

    def moe_layer_ids(self) -> list[int]:
        """Model layer index of each MoE layer, in ``moe_layers()`` order."""
        return [b.layer_id for b in self.layers if b.moe is not None]

    def set_compile(self, enabled: bool, backend: str = "inductor") -> None:
        """``torch.compile`` (or restore the eager versions of) the dense block function, the dense
        MLP and the loss: one compiled function per kind, shared by all blocks (same shapes, so
        one compilation each), whole-graph (``fullgraph=True``: a graph break is an error, not a
        silent slowdown). ``backend`` is for tests (``"aot_eager"`` skips code generation)."""
        fns = dict(_EAGER)
        if enabled:
            _inductor_in_process_with_fbtriton()
            fns = {k: torch.compile(f, dynamic=False, fullgraph=True, backend=backend) for k, f in fns.items()}
        for b in self.layers:
            b.attn_fn = fns["attention_residual"]
            if isinstance(b.ffn, DenseMLP):
                b.ffn.fn = fns["dense_mlp"]
        self.loss_fn = fns["lm_loss"]

    def set_activation_checkpoint(self, mode: str) -> None:
        """``"none"``, ``"moe"`` (recompute MoE FFNs in the backward) or ``"full"`` (whole blocks)."""
        if mode not in ("none", "moe", "full"):
            raise ValueError(f"activation_checkpoint={mode!r} must be 'none', 'moe' or 'full'")
        for b in self.layers:
            b.checkpoint = mode

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

    def forward(self, tokens_BS: torch.Tensor, targets_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.embed(tokens_BS)
        cos, sin = self._rope(tokens_BS.shape[1], h.device)
        for b in self.layers:
            h = b(h, cos, sin)
        if targets_BS is not None:
            return self.loss_fn(h, self.norm.weight, self.head.weight, targets_BS, self.norm.eps)
        return F.linear(F.rms_norm(h, (h.shape[-1],), self.norm.weight, self.norm.eps), self.head.weight).float()

    def aux_loss(self) -> torch.Tensor:
        losses = [m.aux_loss for m in self.moe_layers()]
        return torch.stack(losses).sum() if losses else torch.zeros(())
