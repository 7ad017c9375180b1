"""Hugging Face ``transformers``: run the sparse-MoE blocks of a model on :class:`tlx_dist.MoELayer`.

    from tlx_dist.integrations.hf import patch_moe, unpatch_moe, hf_state_dict
    model = AutoModelForCausalLM.from_pretrained(...)
    patch_moe(model)                        # every supported sparse-MoE block -> an HFMoELayer
    ...                                     # train / fine-tune as before
    model.save_pretrained(path, state_dict=hf_state_dict(model))   # HF layout (or unpatch_moe first)

Supported blocks, where the installed ``transformers`` has them (``supported_blocks()``): Mixtral,
OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3. Legend: E experts, e = E/W local experts, D hidden,
F expert intermediate, Fs shared-expert intermediate.

Weights (converted once; the block is dropped, so there is one copy):
    gate.weight [E, D]                      -> router.weight            (its dtype: DeepSeek-V3's is fp32)
    gate.e_score_correction_bias [E]        -> router.expert_bias       (DeepSeek-V3: selection only)
    experts.gate_up_proj [E, 2F, D]         -> w13 [e, D, 2F]           (gate | up order kept)
    experts.down_proj [E, D, F]             -> w2 [e, F, D]
    shared_experts.{gate,up,down}_proj      -> shared_w13 [D, 2Fs], shared_w2 [Fs, D]   (DeepSeek-V3)
    shared_expert, shared_expert_gate       -> kept as modules: out += sigmoid(gate(x)) * mlp(x)  (Qwen2-MoE)

Routing: softmax top-K renormalised (Mixtral always, OLMoE / Qwen by ``norm_topk_prob``); DeepSeek-V3:
sigmoid scores, correction bias for selection, group-limited top-K (``n_group`` / ``topk_group``,
group score = sum of its top-2), ``norm_topk_prob``, ``routed_scaling_factor``. Logits are fp32.

Aux loss: the model's own convention. The layers' own aux and z losses are off (coefficients 0);
each layer hands its router logits to transformers' output recorder, so ``model(...,
output_router_logits=True)`` returns the ``router_logits``, ``aux_loss`` and loss (``+
router_aux_loss_coef * load_balancing_loss_func``) of the original model. DeepSeek-V3 has no aux
loss in transformers; its bias can be trained aux-loss-free with ``layer.update_bias()``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Dispatcher
from ..config import DTYPES, MoEConfig
from ..moe import MoELayer

__all__ = ["HFMoELayer", "patch_moe", "unpatch_moe", "hf_state_dict", "supported_blocks"]


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("tlx_dist.integrations.hf needs Hugging Face transformers: "
                          "pip install 'tlx_dist[hf]'") from err
    return transformers


@dataclass(frozen=True)
class _Arch:
    """How one transformers sparse-MoE block class maps onto an MoELayer."""

    name: str
    module: str                        # transformers module that defines the block class
    block: str                         # the block class
    score_func: str
    norm_attr: Optional[str] = "norm_topk_prob"  # router attribute; None = always renormalised
    shared_mlp: Optional[str] = None   # ungated shared MLP, fused into MoELayer's shared experts
    gated_shared: bool = False         # Qwen2-MoE: shared_expert + shared_expert_gate, kept as modules
    deepseek: bool = False             # sigmoid, correction bias, groups, routed_scaling_factor

    @property
    def block_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.block)

    def hf_keys(self) -> set[str]:
        keys = {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
        if self.deepseek:
            keys.add("gate.e_score_correction_bias")
        if self.shared_mlp:
            keys |= {f"{self.shared_mlp}.{p}_proj.weight" for p in ("gate", "up", "down")}
        if self.gated_shared:
            keys |= {f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")} | {"shared_expert_gate.weight"}
        return keys


_M = "transformers.models."
_ARCHS = (
    _Arch("mixtral", _M + "mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "softmax", norm_attr=None),
    _Arch("olmoe", _M + "olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", "softmax"),
    _Arch("qwen2_moe", _M + "qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "softmax", gated_shared=True),
    _Arch("qwen3_moe", _M + "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "softmax"),
    _Arch("deepseek_v3", _M + "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "sigmoid",
          shared_mlp="shared_experts", deepseek=True),
)


def supported_blocks() -> dict[type, _Arch]:
    """The sparse-MoE block classes of the installed transformers that :func:`patch_moe` converts
    (matched by exact class: a subclass may compute something else)."""
    _transformers()
    found = {}
    for arch in _ARCHS:
        try:
            found[arch.block_class] = arch
        except (ImportError, AttributeError):
            continue
    return found


_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _dtype_name(t: torch.Tensor, what: str) -> str:
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{what} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
    return _DTYPE_NAMES[t.dtype]


def _is_silu(act: Any) -> bool:
    probe = torch.linspace(-6.0, 6.0, 25, dtype=torch.float64)
    try:
        return bool(torch.allclose(act(probe), F.silu(probe)))
    except Exception:  # an activation that cannot run on a probe is not SiLU
        return False


def _moe_config(block: nn.Module, arch: _Arch, what: str) -> MoEConfig:
    """The :class:`MoEConfig` computing what ``block`` computes (aux/z losses off: the model's own)."""
    gate, experts = block.gate, block.experts
    E, D = gate.weight.shape
    up, down = experts.gate_up_proj, experts.down_proj
    F2 = up.shape[1]
    if tuple(up.shape) != (E, F2, D) or F2 % 2 or tuple(down.shape) != (E, D, F2 // 2):
        raise ValueError(f"{what}: experts.gate_up_proj {tuple(up.shape)} / down_proj {tuple(down.shape)} are not "
                         f"the [E, 2F, D] / [E, D, F] layout with E={E}, D={D}")
    if not _is_silu(experts.act_fn):
        raise ValueError(f"{what}: config.hidden_act is not silu ({experts.act_fn!r}); tlx_dist experts are SwiGLU")
    if getattr(block, "jitter_noise", 0):
        raise ValueError(f"{what}: config.router_jitter_noise={block.jitter_noise} is not supported (use 0)")
    kw: dict[str, Any] = dict(
        dim=D, moe_inter_dim=F2 // 2, num_experts=E, top_k=int(gate.top_k), score_func=arch.score_func,
        route_norm=True if arch.norm_attr is None else bool(getattr(gate, arch.norm_attr)),
        dtype=_dtype_name(up, f"{what}.experts.gate_up_proj"),
        router_dtype=_dtype_name(gate.weight, f"{what}.gate.weight"))
    if arch.deepseek:
        kw.update(route_scale=float(gate.routed_scaling_factor), load_balance_bias=True,
                  n_group=int(gate.num_group), topk_group=int(gate.topk_group))
    if arch.shared_mlp:
        mlp = getattr(block, arch.shared_mlp)
        if not _is_silu(mlp.act_fn):
            raise ValueError(f"{what}: the shared experts' activation is not silu ({mlp.act_fn!r})")
        kw.update(num_shared_experts=1, shared_inter_dim=mlp.gate_proj.weight.shape[0])
    try:
        return MoEConfig(**kw)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from err


class _RouterLogits(nn.Identity):
    """Passes the router logits through: a module whose output they are, for transformers' output
    recorder (``router_logits`` outputs and the load-balancing loss) to hook."""


class HFMoELayer(MoELayer):
    """An :class:`MoELayer` standing in for a transformers sparse-MoE block.

    ``forward(hidden_states [B, S, D] or [T, D]) -> same shape``, like the block. Build it with
    :meth:`from_hf_block`; :meth:`hf_state_dict` and :meth:`to_hf_block` go back to the block's
    layout (with expert parallelism they gather the experts: call them on every rank).
    """

    def __init__(self, cfg: MoEConfig, arch: _Arch, hf_layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 hf_config: Any = None, ep_group: Optional[dist.ProcessGroup] = None,
                 dispatcher: Union[str, Dispatcher] = "auto", gemm_backend: Optional[str] = None,
                 device: Optional[Union[str, torch.device]] = None, pipeline: str = "auto"):
        object.__setattr__(self, "_skip_init", True)  # the weights come from the block: no init work
        super().__init__(cfg, ep_group, dispatcher, gemm_backend, device, pipeline)
        self._skip_init = False
        self.arch = arch
        self.hf_layout = dict(hf_layout)  # key -> (shape, dtype) of the original block's state dict
        self.hf_config = hf_config        # what the block class is rebuilt from (unpatch)
        self.router_logits = _RouterLogits()
        self.shared_expert: Optional[nn.Module] = None       # Qwen2-MoE's gated shared expert
        self.shared_expert_gate: Optional[nn.Module] = None

    def reset_parameters(self, seed: Optional[int] = None) -> None:
        if not self._skip_init:
            super().reset_parameters(seed)

    @classmethod
    def from_hf_block(cls, block: nn.Module, hf_config: Any = None, ep_group: Optional[dist.ProcessGroup] = None,
                      dispatcher: Union[str, Dispatcher] = "auto", gemm_backend: Optional[str] = None,
                      pipeline: str = "auto", name: str = "block") -> "HFMoELayer":
        """Converts one transformers sparse-MoE ``block`` (the block is not modified). ``hf_config``
        is the model config the block was built from (needed only to rebuild it); with
        ``ep_group`` this rank keeps its ``E/W`` experts; the other options are :class:`MoELayer`'s."""
        arch = supported_blocks().get(type(block))
        if arch is None:
            raise TypeError(f"{name}: {type(block).__name__} is not a supported sparse-MoE block "
                            f"({sorted(a.block for a in _ARCHS)})")
        what = f"{name} ({arch.block})"
        sd = block.state_dict()
        expected = arch.hf_keys()
        if set(sd) != expected:
            raise ValueError(f"{what}: state-dict keys differ from the layout tlx_dist converts: unknown "
                             f"{sorted(set(sd) - expected)}, missing {sorted(expected - set(sd))}")
        cfg = _moe_config(block, arch, what)
        layout = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
        device = block.gate.weight.device
        layer = cls(cfg, arch, layout, hf_config, ep_group, dispatcher, gemm_backend, device="meta", pipeline=pipeline)
        layer.to_empty(device=device)
        lo, hi = layer.expert_range
        gate = block.gate
        with torch.no_grad():
            layer.router.weight.copy_(gate.weight)
            layer.w13.copy_(block.experts.gate_up_proj[lo:hi].transpose(1, 2))
            layer.w2.copy_(block.experts.down_proj[lo:hi].transpose(1, 2))
            layer.router.expert_bias.zero_()
            layer.router.tokens_since_update.zero_()
            if arch.deepseek:
                bias = gate.e_score_correction_bias
                wide = torch.promote_types(bias.dtype, layer.router.expert_bias.dtype)
                if wide != layer.router.expert_bias.dtype:  # an fp64 bias stays fp64: export/unpatch exact
                    layer.router.expert_bias = torch.empty(bias.shape, dtype=wide, device=device)
                layer.router.expert_bias.copy_(bias)
            if arch.shared_mlp:
                mlp, Fs = getattr(block, arch.shared_mlp), cfg.shared_dim
                layer.shared_w13[:, :Fs].copy_(mlp.gate_proj.weight.t())
                layer.shared_w13[:, Fs:].copy_(mlp.up_proj.weight.t())
                layer.shared_w2.copy_(mlp.down_proj.weight.t())
        layer.router.weight.requires_grad_(gate.weight.requires_grad)
        layer.w13.requires_grad_(block.experts.gate_up_proj.requires_grad)
        layer.w2.requires_grad_(block.experts.down_proj.requires_grad)
        if arch.shared_mlp:
            layer.shared_w13.requires_grad_(mlp.gate_proj.weight.requires_grad)
            layer.shared_w2.requires_grad_(mlp.down_proj.weight.requires_grad)
        if arch.gated_shared:
            layer.shared_expert, layer.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        return layer.train(block.training)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states)
        self.router_logits(self.last_stats.logits_TE)  # for transformers' output recorder
        if self.shared_expert is not None:
            x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
            shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
            out = out + shared_TD.view(out.shape)
        return out

    # --- back to the transformers layout ----------------------------------------------------------
    def _global_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``w13 [E, D, 2F]``, ``w2 [E, F, D]`` of all experts (all-gathered over the EP group)."""
        if self.ep_size == 1:
            return self.w13.detach(), self.w2.detach()
        out = []
        for w in (self.w13, self.w2):
            parts = [torch.empty_like(w) for _ in range(self.ep_size)]
            dist.all_gather(parts, w.detach().contiguous(), group=self.ep_group)
            out.append(torch.cat(parts))
        return out[0], out[1]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The block's state dict in the transformers layout (keys relative to the block, original
        shapes and dtypes). Detached; collective over the EP group when there is one."""
        w13, w2 = self._global_experts()
        sd = {"gate.weight": self.router.weight, "experts.gate_up_proj": w13.transpose(1, 2),
              "experts.down_proj": w2.transpose(1, 2)}
        if self.arch.deepseek:
            sd["gate.e_score_correction_bias"] = self.router.expert_bias
        if self.arch.shared_mlp:
            Fs, p = self.cfg.shared_dim, self.arch.shared_mlp
            sd[f"{p}.gate_proj.weight"] = self.shared_w13[:, :Fs].t()
            sd[f"{p}.up_proj.weight"] = self.shared_w13[:, Fs:].t()
            sd[f"{p}.down_proj.weight"] = self.shared_w2.t()
        if self.arch.gated_shared:
            sd.update(self.shared_expert.state_dict(prefix="shared_expert."))
            sd.update(self.shared_expert_gate.state_dict(prefix="shared_expert_gate."))
        if set(sd) != set(self.hf_layout):
            raise RuntimeError(f"export keys {sorted(sd)} differ from the block's {sorted(self.hf_layout)}")
        out = {}
        for k, (shape, dtype) in self.hf_layout.items():
            v = sd[k].detach()
            if tuple(v.shape) != shape:
                raise RuntimeError(f"export of {k}: shape {tuple(v.shape)} != the block's {shape}")
            out[k] = v.to(dtype).contiguous()
        return out

    def to_hf_block(self) -> nn.Module:
        """A new transformers block holding this layer's current weights (train/eval mode kept)."""
        if self.hf_config is None:
            raise ValueError("to_hf_block needs hf_config (the model config the block was built from)")
        sd = self.hf_state_dict()
        def kept(key: str) -> bool:  # Qwen2-MoE's shared expert goes back as the same modules
            return self.arch.gated_shared and key.startswith(("shared_expert.", "shared_expert_gate."))

        with torch.device("meta"):
            block = self.arch.block_class(self.hf_config)
        missing, unexpected = block.load_state_dict({k: v for k, v in sd.items() if not kept(k)},
                                                    strict=False, assign=True)
        if self.arch.gated_shared:
            block.shared_expert, block.shared_expert_gate = self.shared_expert, self.shared_expert_gate
        missing = [k for k in missing if not kept(k)]
        left = [n for n, t in list(block.named_parameters()) + list(block.named_buffers()) if t.is_meta]
        if missing or unexpected or left:
            raise RuntimeError(f"rebuilding {self.arch.block}: missing {missing}, unexpected {unexpected}, "
                               f"uninitialised {left}")
        return block.train(self.training)

    def extra_repr(self) -> str:
        return f"hf={self.arch.block}, " + super().extra_repr()


# --- whole models --------------------------------------------------------------------------------

def _owner(model: nn.Module, name: str) -> Optional[nn.Module]:
    """The innermost transformers ``PreTrainedModel`` holding submodule ``name`` (its config built
    the block; its output recorder collects the block's router logits)."""
    pretrained = _transformers().PreTrainedModel
    owner = model if isinstance(model, pretrained) else None
    parts = name.split(".")[:-1]
    for i in range(len(parts)):
        m = model.get_submodule(".".join(parts[: i + 1]))
        if isinstance(m, pretrained):
            owner = m
    return owner


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _install_recorder_hook(module: nn.Module, index: int) -> None:
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook as install
    except ImportError as err:
        raise ImportError("this transformers has no utils.output_capturing; tlx_dist.integrations.hf needs "
                          "transformers>=5.24,<6 (pip install 'tlx_dist[hf]')") from err
    install(module, "router_logits", index)


def patch_moe(model: nn.Module, *, ep_group: Optional[dist.ProcessGroup] = None,
              dispatcher: Union[str, Dispatcher] = "auto", gemm_backend: Optional[str] = None,
              pipeline: str = "auto") -> nn.Module:
    """Replaces, in place, every supported sparse-MoE block of ``model`` with an :class:`HFMoELayer`
    holding its weights, and returns ``model``. Options go to :class:`MoELayer` (``ep_group``:
    expert parallelism, each rank keeps ``E/W`` experts; ``dispatcher``; ``gemm_backend``;
    ``pipeline``: fused or separate experts).

    Parameters are new objects: build the optimizer after patching. Raises ``ValueError`` when the
    model holds no supported block, naming what it does hold."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    archs = supported_blocks()
    targets = [(n, m) for n, m in model.named_modules() if type(m) in archs]
    if not targets:
        done = sum(isinstance(m, HFMoELayer) for m in model.modules())
        raise ValueError(f"patch_moe: {type(model).__name__} holds no supported sparse-MoE block "
                         f"({sorted(a.block for a in archs.values())}); already patched: {done}")
    if targets[0][0] == "":
        raise ValueError("patch_moe: model is itself a block; convert it with HFMoELayer.from_hf_block")
    for name, block in targets:
        owner = _owner(model, name)
        hf_config = owner.config if owner is not None else getattr(block, "config", None)
        layer = HFMoELayer.from_hf_block(block, hf_config, ep_group, dispatcher, gemm_backend, pipeline, name=name)
        _replace(model, name, layer)
        # The recorder hooks modules by class, once, lazily; this one it cannot know: hook it now.
        _install_recorder_hook(layer.router_logits, 0)
    return model


def unpatch_moe(model: nn.Module) -> nn.Module:
    """Puts transformers blocks back in place of every :class:`HFMoELayer` of ``model``, holding
    the current weights; returns ``model``. Collective over the EP group when patched with one."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoELayer)]
    if not layers:
        raise ValueError(f"unpatch_moe: {type(model).__name__} holds no HFMoELayer (was it patched?)")
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder
    for name, layer in layers:
        block = layer.to_hf_block()
        _replace(model, name, block)
        owner = _owner(model, name)
        # If the owner already hooked its modules, it will not look again: hook the new router.
        if owner is not None and getattr(owner, "_output_capturing_hooks_installed", False):
            spec = _CAN_RECORD_REGISTRY.get(owner).get("router_logits")
            if isinstance(spec, OutputRecorder) and spec.target_class is not None:
                target, index = spec.target_class, spec.index
            elif isinstance(spec, type):
                target, index = spec, 1
            else:
                continue
            for m in block.modules():
                if isinstance(m, target):
                    _install_recorder_hook(m, index)
    return model


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every :class:`HFMoELayer` in the transformers layout, i.e. the
    state dict of the unpatched model (for ``save_pretrained(..., state_dict=...)``). Collective
    over the EP group when patched with one."""
    sd = model.state_dict()
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoELayer)]:
        prefix = name + "."
        for k in [k for k in sd if k.startswith(prefix)]:
            del sd[k]
        sd.update({prefix + k: v for k, v in layer.hf_state_dict().items()})
    return sd
