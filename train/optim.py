"""AdamW over fp32 masters that reads the bf16 gradients and writes the bf16 compute copies
(``train.optimizer = "adamw_bf16_grads"``, one rank, bf16 training; opt-in).

With :class:`~train.mixed_precision.LocalMixedPrecision` and torch's fused AdamW, a step moves per
parameter: the bf16 compute copy refreshed from the master (4 B read + 2 B written), the bf16
gradient cast to an fp32 ``master.grad`` (2 + 4), the clipping norm over it (4) and AdamW over
fp32 p, g, m, v (16 read, 12 written): 44 B. Here the gradient stays bf16 (kept by
``LocalMixedPrecision(keep_grads=True)``), its norm is taken in bf16 with fp32 accumulation, and
one kernel per parameter does the AdamW update and writes the next step's compute copy: 2 + 28 B.
On the ``h200_1gpu`` recipe's 3.36B parameters that is ~47 GB less traffic a step (not yet
measured on a GPU).

The update is torch's AdamW (decoupled weight decay) in fp32, in torch's order:

    p  = p * (1 - lr * wd)
    m  = beta1 * m + (1 - beta1) * g          g = grad / grad_scale (the clipping factor), in fp32
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    copy = bf16(p)

State per parameter as torch's AdamW (``step`` a CPU float tensor, ``exp_avg``, ``exp_avg_sq`` fp32),
so DCP checkpoints and ``get_state_dict`` treat it alike. A parameter without a compute copy (or
with an fp32 ``.grad``, as ``get_state_dict`` hands it when it initialises the state) takes the same
update without the copy. The kernel runs on CUDA (and under ``TRITON_INTERPRET=1``);
:func:`adamw_step_ref` is the same math in PyTorch (the CPU path and the test oracle).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

__all__ = ["AdamWBf16Grads", "adamw_step_ref", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "adamw_bf16_grads", "auto")  # auto: adamw_bf16_grads where it applies, else adamw

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path
    triton = None

if triton is not None:
    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, scale_ptr, n, lr, beta1, beta2, eps, decay, step_size,
                      bc2_sqrt, HAS_COPY: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)  # IEEE, as torch
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_COPY:
            tl.store(c_ptr + offs, _to_bf16_rne(p), mask=mask)

    @triton.jit
    def _to_bf16_rne(x):
        """fp32 -> bf16, round to nearest even, NaN kept NaN: on the bits (torch's rounding; the
        interpreter's float cast truncates)."""
        b = x.to(tl.uint32, bitcast=True)
        hi = b >> 16
        r = hi + (((b & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16)  # never wraps (the interpreter checks)
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def adamw_step_ref(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, copy: Optional[torch.Tensor],
                   lr: float, beta1: float, beta2: float, eps: float, wd: float, step: int,
                   grad_scale: Optional[torch.Tensor] = None) -> None:
    """One update in place (the kernel's math in PyTorch, fp32)."""
    g = g.float()
    if grad_scale is not None:
        g = g / grad_scale.float()
    p.mul_(1.0 - lr * wd)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
    if copy is not None:
        copy.copy_(p)


def _use_kernel(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class AdamWBf16Grads(torch.optim.Optimizer):
    """AdamW for the masters of ``local_mp`` (a :class:`LocalMixedPrecision` in ``keep_grads``
    mode): reads each master's bf16 gradient from ``local_mp`` and writes its compute copy.
    ``grad_scale`` (a 0-dim tensor or None) divides every gradient as it is read, as torch's fused
    AdamW does (``applies_grad_scale``: ``clip_grad_norm_`` hands the clip factor here). Not marked
    ``fused`` in its defaults: torch's ``load_state_dict`` would move ``step`` to the device, and
    reading it would sync the host every step after a resume.

    Limitation: DCP's ``get_state_dict`` between a backward and the first ``step()`` of a run would
    take that step's kept gradients into its zero-gradient initialisation (it only sees ``.grad``);
    the training loop checkpoints after the step."""

    applies_grad_scale = True

    BLOCK = 2048

    def __init__(self, params, local_mp, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if not 0.0 <= lr:
            raise ValueError(f"lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas} must be in [0, 1)")
        if local_mp.dtype != torch.bfloat16:
            raise ValueError(f"AdamWBf16Grads needs bf16 compute copies, got {local_mp.dtype}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.local_mp = local_mp
        self.grad_scale: Optional[torch.Tensor] = None
        local_mp.keep_grads = True
        local_mp.copies_current = False  # refresh once: the masters may have changed since any install

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copied = 0
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                g, copy = self.local_mp.grad_and_copy(p)
                if g is None:
                    g = p.grad
                    if g is None:
                        continue
                    # an fp32 .grad on the master (get_state_dict's zero-grad init step): the copy
                    # is still written, so it stays equal to the master
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if st["step"].device.type != "cpu":  # a checkpoint written by a fused optimizer: once
                    st["step"] = st["step"].cpu()
                st["step"] += 1
                t = int(st["step"].item())  # a CPU tensor: no device sync
                copied += copy is not None
                self._update(p, g, st["exp_avg"], st["exp_avg_sq"], copy, lr, b1, b2, eps, wd, t)
        self.local_mp.clear_grads()
        # Every copy written: current whatever they were. Some not (no gradient: the master did not
        # change): as current as before.
        if copied == len(self.local_mp.slots):
            self.local_mp.copies_current = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.local_mp.clear_grads()

    def _update(self, p, g, m, v, copy, lr, b1, b2, eps, wd, t):
        if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()
                and (copy is None or copy.is_contiguous())) or not _use_kernel(p):
            adamw_step_ref(p, g, m, v, copy, lr, b1, b2, eps, wd, t, self.grad_scale)
            return
        n = p.numel()
        if n == 0:
            return
        scale = self.grad_scale
        _adamw_kernel[(triton.cdiv(n, self.BLOCK),)](
            p, g, m, v, copy if copy is not None else p, scale if scale is not None else p, n,
            float(lr), float(b1), float(b2), float(eps), 1.0 - lr * wd, lr / (1.0 - b1 ** t),
            math.sqrt(1.0 - b2 ** t), HAS_COPY=copy is not None, HAS_SCALE=scale is not None, BLOCK=self.BLOCK,
            num_warps=8)
