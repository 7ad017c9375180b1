"""bf16 compute copies of fp32 parameters that no FSDP group manages, kept between steps.

FSDP2 on a one-rank mesh still copies: every forward (and again every backward, after resharding)
it casts each fp32 parameter to a fresh bf16 buffer, and every backward it casts the bf16 gradient
to fp32 through a reduce-scatter staging buffer. When the data-parallel mesh of a module has one
rank, ``train.parallelize`` leaves its parameters out of FSDP and hands them to
:class:`LocalMixedPrecision`, which does the minimum:

    master_P (fp32, in the module, owned by the optimizer and the checkpoint)
    compute_P (bf16 copy, persistent)     refreshed from master at every install (one fused cast
                                          per forward). Not skipped on an unchanged version
                                          counter: fused optimizers (torch's fused AdamW, the GPU
                                          default) update in place without bumping it, so a
                                          version check left the copies stale and the model
                                          never learned on GPU.
    forward:   the root's pre-forward hook swaps compute_P into the modules
    backward:  each compute_P gradient is added into master_P.grad in fp32 as soon as it is
               accumulated, and freed (one cast per step, no staging copies)
    after:     ``uninstall()`` (called by ``finish_grads``, and by state_dict / load_state_dict
               pre-hooks) puts master_P back, so the optimizer, clipping and DCP see fp32.

Numerically this is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on one
rank: the same bf16 rounding of the weights, the same bf16 gradients cast to fp32.

``keep_grads`` (set by :class:`train.optim.AdamWBf16Grads`): the bf16 gradients are kept as they are
(``grad_and_copy`` / ``pending_grads``) instead of cast into ``master.grad``; that optimizer writes
the compute copies itself, so the next install skips the refresh while ``copies_current`` holds
(cleared by a ``load_state_dict`` of the model, the only other writer of the masters).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

__all__ = ["LocalMixedPrecision"]


class LocalMixedPrecision:
    """Manages ``params`` (parameters of ``model``, fp32) with ``dtype`` compute copies.

    Installs hooks on ``model`` (forward pre/post, state_dict and load_state_dict pre-hooks) and a
    post-accumulate-grad hook on every compute copy. ``installed`` says which copy the modules hold.
    """

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter], dtype: torch.dtype):
        wanted = {id(p) for p in params}
        self.dtype = dtype
        self.keep_grads = False
        self.copies_current = False
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        for mod in model.modules():
            for name, p in mod.named_parameters(recurse=False):
                if id(p) not in wanted:
                    continue
                if p.dtype == dtype:
                    raise ValueError(f"parameter {name} of {type(mod).__name__} is already {dtype}; "
                                     "LocalMixedPrecision expects higher-precision masters")
                compute = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
                if p.requires_grad:
                    compute.register_post_accumulate_grad_hook(self._grad_hook(p, len(self.slots)))
                self.slots.append((mod, name, p, compute))
                wanted.discard(id(p))
        if wanted:
            raise ValueError(f"{len(wanted)} parameter(s) passed to LocalMixedPrecision are not in the model")
        self.installed = False
        self.grads: list = [None] * len(self.slots)   # keep_grads: the bf16 gradient of each slot
        self._slot_of = {id(s[2]): i for i, s in enumerate(self.slots)}
        model.register_forward_pre_hook(lambda *_: self.install())
        model.register_forward_hook(lambda *_: None if torch.is_grad_enabled() else self.uninstall())
        model.register_state_dict_pre_hook(lambda *_: self.uninstall())
        model.register_load_state_dict_pre_hook(lambda *_: self._masters_replaced())

    def _masters_replaced(self) -> None:
        self.uninstall()
        self.copies_current = False

    def grad_and_copy(self, master: nn.Parameter):
        """``(bf16 gradient or None, compute copy or None)`` of ``master`` (keep_grads mode)."""
        i = self._slot_of.get(id(master))
        if i is None:
            return None, None
        return self.grads[i], self.slots[i][3]

    def pending_grads(self) -> list:
        """The kept bf16 gradients of this step (keep_grads mode)."""
        return [g for g in self.grads if g is not None]

    def clear_grads(self) -> None:
        self.grads = [None] * len(self.slots)

    def _grad_hook(self, master: nn.Parameter, i: int):
        def hook(compute: nn.Parameter) -> None:
            g = compute.grad
            if self.keep_grads:
                # a second gradient in one step (accumulation, reentrant recomputation) sums in
                # fp32, as the cast path does
                self.grads[i] = g if self.grads[i] is None else self.grads[i].to(master.dtype).add_(g)
                compute.grad = None
                return
            if master.grad is None:
                master.grad = g.to(master.dtype)
            else:
                master.grad.add_(g)
            compute.grad = None
        return hook

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies every master into its compute copy (one ``_foreach_copy_`` cast)."""
        torch._foreach_copy_([s[3] for s in self.slots], [s[2] for s in self.slots])

    def install(self) -> None:
        """Modules hold the (refreshed) compute copies. Idempotent."""
        if self.installed:
            return
        if not (self.keep_grads and self.copies_current):
            self.refresh()
            self.copies_current = True
        for mod, name, _, compute in self.slots:
            mod._parameters[name] = compute
        self.installed = True

    def uninstall(self) -> None:
        """Modules hold the fp32 masters again. Idempotent."""
        if not self.installed:
            return
        for mod, name, master, _ in self.slots:
            mod._parameters[name] = master
        self.installed = False
