"""Typed, validated configuration of an MoE layer.

Errors name the field, e.g. ``moe.num_experts=12 is not divisible by expert_parallel=8``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

__all__ = ["MoEConfig", "DTYPES", "PRECISIONS"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Operand precision of the expert GEMMs: "bf16" runs them in the layer dtype; "fp8" in e4m3 with
# blockwise fp32 scales (tlx_dist/fp8: 1 x 128 activation tiles, 128 x 128 weight blocks).
PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class MoEConfig:
    """Configuration of :class:`tlx_dist.MoELayer`.

    Shapes use the legend: D hidden, F expert intermediate, E experts, K top-k.

    Attributes:
        dim: hidden size D.
        moe_inter_dim: intermediate size F of each routed expert (SwiGLU: w13 is [D, 2F]).
        num_experts: routed experts E.
        top_k: experts per token K (1 <= K <= E).
        score_func: ``"softmax"`` (Mixtral/OLMoE/Qwen) or ``"sigmoid"`` (DeepSeek-V3).
        route_norm: renormalise the K selected gates to sum to 1.
        route_scale: multiplies the gates after normalisation (DeepSeek-V3 uses 2.5).
        num_shared_experts: dense SwiGLU experts every token goes through (0 = none).
        shared_inter_dim: intermediate size of each shared expert; ``None`` means F.
        aux_loss_coef: load-balancing loss coefficient (Switch/GShard form), 0 disables.
        z_loss_coef: router z-loss coefficient (ST-MoE), 0 disables.
        load_balance_bias: aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the
            scores for *selection only*; updated by :meth:`MoELayer.update_bias`.
        bias_update_rate: step of the bias update (gamma).
        n_group: group-limited routing (DeepSeek-V3's ``n_group``): the E experts form ``n_group``
            contiguous groups of E/n_group; 1 = no groups.
        topk_group: each token may pick experts only from its ``topk_group`` best groups, a group's
            score being the sum of its top-2 selection scores (scores + bias; the top-1 score for
            groups of one expert). ``None`` = all groups (no limit). With experts laid out
            contiguously over ranks or nodes and ``n_group`` = that count, a token reaches at most
            ``topk_group`` of them.
        dtype: parameter and activation dtype of the experts (router logits are always fp32).
        precision: operand precision of the routed experts' GEMMs (:data:`PRECISIONS`): ``"bf16"``
            multiplies in ``dtype``; ``"fp8"`` quantizes each GEMM's operands to e4m3 with fp32
            scales and accumulates in fp32, the master weights staying in ``dtype`` (needs
            ``dtype`` float32 / bfloat16 / float16; see :class:`tlx_dist.MoELayer`). Router and
            shared experts always run in ``dtype``.
        router_dtype: dtype of the router weight; ``None`` = ``dtype`` (DeepSeek-V3 keeps it fp32).
        init_std: std of the normal init of router and expert weights.
        check_finite: raise ``ValueError`` on NaN/inf in the input. Off by default because it
            synchronises with the host; with it off, a non-finite token stays confined to its own
            output row in the forward pass (rows are independent through routing and the GEMMs).
    """

    dim: int
    moe_inter_dim: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    num_shared_experts: int = 0
    shared_inter_dim: Optional[int] = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    load_balance_bias: bool = False
    bias_update_rate: float = 1e-3
    n_group: int = 1
    topk_group: Optional[int] = None
    dtype: str = "float32"
    precision: str = "bf16"
    router_dtype: Optional[str] = None
    init_std: float = 0.02
    check_finite: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self, expert_parallel: int = 1, prefix: str = "moe") -> "MoEConfig":
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"{prefix}.{field}={getattr(self, field)!r} {msg}")

        def integer(v) -> bool:  # bools are ints to Python, never to a config
            return isinstance(v, int) and not isinstance(v, bool)

        for f in ("dim", "moe_inter_dim", "num_experts", "top_k", "n_group"):
            v = getattr(self, f)
            if not integer(v) or v < 1:
                raise bad(f, "must be a positive integer")
        if self.top_k > self.num_experts:
            raise bad("top_k", f"exceeds num_experts={self.num_experts}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise bad("score_func", "must be 'softmax' or 'sigmoid'")
        if not integer(self.num_shared_experts) or self.num_shared_experts < 0:
            raise bad("num_shared_experts", "must be a non-negative integer")
        if self.shared_inter_dim is not None and (not integer(self.shared_inter_dim) or self.shared_inter_dim < 1):
            raise bad("shared_inter_dim", "must be a positive integer or None")
        if self.num_experts % self.n_group:
            raise bad("n_group", f"does not divide num_experts={self.num_experts}")
        if self.topk_group is not None:
            if not integer(self.topk_group) or not 1 <= self.topk_group <= self.n_group:
                raise bad("topk_group", f"must be an integer in [1, n_group={self.n_group}] or None")
            reachable = self.topk_group * (self.num_experts // self.n_group)
            if self.top_k > reachable:
                raise bad("top_k", f"exceeds the {reachable} experts of topk_group={self.topk_group} groups "
                                   f"of {self.num_experts // self.n_group}")
        for f in ("route_norm", "load_balance_bias", "check_finite"):
            # Strictly bool: a string such as 'False' from a config override is truthy.
            if type(getattr(self, f)) is not bool:
                raise bad(f, "must be a bool (true/false)")

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        for f in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "route_scale", "init_std"):
            v = getattr(self, f)
            # inf is a number but never a sensible scale or coefficient: the layer would output inf/NaN.
            if number(v) and not math.isfinite(v):
                raise bad(f, "must be finite")
        for f in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            v = getattr(self, f)
            if not number(v) or v < 0:
                raise bad(f, "must be a non-negative number")
        for f in ("route_scale", "init_std"):
            v = getattr(self, f)
            if not number(v) or not v > 0:
                raise bad(f, "must be a positive number")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {sorted(DTYPES)}")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"must be one of {PRECISIONS}")
        if self.precision == "fp8" and self.dtype == "float64":
            raise bad("precision", "needs dtype float32, bfloat16 or float16 (the FP8 quantizers take no float64), "
                                   f"got dtype={self.dtype!r}")
        if self.router_dtype is not None and self.router_dtype not in DTYPES:
            raise bad("router_dtype", f"must be None or one of {sorted(DTYPES)}")
        if not integer(expert_parallel) or expert_parallel < 1:
            raise ValueError(f"expert_parallel={expert_parallel!r} must be a positive integer")
        if self.num_experts % expert_parallel:
            raise bad("num_experts", f"is not divisible by expert_parallel={expert_parallel}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def router_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.router_dtype or self.dtype]

    @property
    def group_limited(self) -> bool:
        """True when routing is restricted to the top ``topk_group`` of ``n_group`` groups."""
        return self.n_group > 1 and self.topk_group is not None and self.topk_group < self.n_group

    @property
    def shared_dim(self) -> int:
        """Total intermediate size of the shared experts (they are fused into one SwiGLU MLP)."""
        return self.num_shared_experts * (self.shared_inter_dim or self.moe_inter_dim)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], prefix: str = "moe") -> "MoEConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{prefix}: unknown field(s) {unknown}; known: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in d)
        if missing:
            raise ValueError(f"{prefix}: missing field(s) {missing}")
        return cls(**dict(d))

    def params_per_token(self) -> int:
        """Active parameters of this layer per token (router + K experts + shared)."""
        D, F = self.dim, self.moe_inter_dim
        return D * self.num_experts + self.top_k * 3 * D * F + 3 * D * self.shared_dim
