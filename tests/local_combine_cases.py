"""Shared inputs and checks for the single-rank combine (tlx_dist/comm/local_combine.py), used by
tests/test_local_combine.py (the references), tests/local_combine_interpreted_cases.py (the kernels
under TRITON_INTERPRET=1) and tests/test_local_combine_gpu.py (the kernels on a GPU).

The oracle is the torch composition of ``Dispatcher.combine_weighted`` / ``dispatch_backward``
(tlx_dist/comm/dispatcher.py) and its autograd, with float64 beside it. What is bit for bit and
what is bounded (STYLE.md 6):
  * forward and dispatch backward: each product is rounded as torch rounds it, then an fp32 k-sum
    rounded once. For K <= 2 the sum has one order (0 + a + b is commutative), so bit for bit; for
    larger K the order may differ from torch's reduction: within the rule against float64 with
    torch's composition as the same-dtype computation, and (bf16) within one ulp of it.
  * g_y: one rounded product per element, bit for bit what torch's mul backward gives.
  * g_gate: fp32 products and sum (torch rounds each product to y's dtype first): within the rule
    against the float64 dot product, torch's autograd value the same-dtype computation.
"""

from __future__ import annotations

import torch

from tlx_dist.comm import LocalDispatcher
from tlx_dist.comm.dispatcher import Dispatcher
from tlx_dist.testing import assert_close_ksum_bf16, assert_close_to_ref

# (T, K, E, D, routing, values, why)
CASES = [
    (37, 4, 8, 300, "random", "normal", "T not a multiple of the 4-row tile, D = 300 past one 256-wide block"),
    (16, 1, 4, 64, "random", "normal", "K = 1: the combine is one rounded product per element"),
    (12, 6, 6, 40, "all_experts", "signed", "K = E: every token picks every expert; negative gates"),
    (20, 3, 5, 72, "one_expert", "mixed", "all k of a token to one expert (duplicate ids); mixed magnitudes"),
    (24, 2, 16, 48, "two_experts", "normal", "14 of 16 experts receive no token"),
    (9, 8, 8, 520, "random", "huge", "values near half the dtype's max, normalized signed gates: no overflow"),
    (11, 4, 4, 33, "random", "tiny", "subnormal-range products: rounding below the normal range"),
    (1, 2, 4, 100, "random", "normal", "a single token"),
    (0, 4, 4, 64, "random", "normal", "no tokens: empty outputs, nothing launched"),
    (5, 3, 4, 1, "random", "signed", "D = 1"),
]
CASE_IDS = [c[6].split(":")[0].split(",")[0] for c in CASES]


def make_case(T, K, E, D, routing, values, dtype, gate_dtype=torch.float32, seed=0, device="cpu"):
    """(dispatcher, handle, y_ND [T*K, D] dtype, gate_TK [T, K] gate_dtype, g_TD [T, D] dtype)."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "random":
        idx = torch.randint(0, E, (T, K), generator=gen)
    elif routing == "all_experts":
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    elif routing == "one_expert":
        idx = torch.randint(0, E, (T, 1), generator=gen).expand(T, K)
    elif routing == "two_experts":
        idx = torch.tensor([0, 3])[torch.randint(0, 2, (T, K), generator=gen)]
    else:
        raise ValueError(routing)
    idx = idx.long().contiguous().to(device)
    gate = torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.05
    if values in ("signed", "huge", "mixed"):
        gate = gate * (torch.randint(0, 2, (T, K), generator=gen) * 2 - 1)
    gate = gate / gate.abs().sum(1, keepdim=True).clamp_min(1e-30)
    y = torch.randn(T * K, D, generator=gen, dtype=torch.float64)
    g = torch.randn(T, D, generator=gen, dtype=torch.float64)
    big = torch.finfo(dtype).max
    if values == "huge":
        y = (y.sign() * (0.3 + 0.2 * y.abs().clamp(max=1))) * big
        g = g / (4 * max(D, 1))  # the gate gradient's D-term dot product stays finite too
    elif values == "tiny":
        y = y * torch.finfo(dtype).tiny * 4
    elif values == "mixed":
        y = y * 10.0 ** torch.randint(-3, 3, (T * K, 1), generator=gen)  # fp16: products and dots stay finite
    disp = LocalDispatcher(E)
    _, handle = disp.dispatch(torch.zeros(T, D, dtype=dtype, device=device), idx)
    return (disp, handle, y.to(dtype).to(device), gate.to(gate_dtype).to(device), g.to(dtype).to(device))


def reference(disp, handle, y_ND, gate_TK, g_TD):
    """Torch's composition and its autograd: (out, g_y, g_gate), plus the float64 (out, g_gate)."""
    y = y_ND.clone().requires_grad_(True)
    w = gate_TK.clone().requires_grad_(True)
    out = Dispatcher.combine_weighted(disp, y, handle, w)
    g_y, g_gate = torch.autograd.grad(out, [y, w], g_TD) if out.numel() else (torch.zeros_like(y), torch.zeros_like(w))
    T, K = gate_TK.shape
    inv = handle.inverse_S
    y64 = y_ND.double().index_select(0, inv).view(T, K, y_ND.shape[1])
    out64 = (y64 * gate_TK.double().unsqueeze(-1)).sum(1)
    dot_S = (g_TD.double().unsqueeze(1) * y64).sum(-1).reshape(-1)
    return out.detach(), g_y, g_gate, out64, dot_S.view(T, K)


def _same_or_bounded(ours, torch_val, ref64, K, name):
    assert ours.dtype == torch_val.dtype and ours.shape == torch_val.shape, name
    if K <= 2:
        torch.testing.assert_close(ours, torch_val, rtol=0, atol=0, equal_nan=True, msg=name)
        return
    assert_close_to_ref(ours, ref64, torch_val, name=name)
    if ours.dtype == torch.bfloat16:
        assert_close_ksum_bf16(torch_val, ours)


def check_combine(fn, disp, handle, y_ND, gate_TK, g_TD, what=""):
    """``fn(y, handle, gate) -> out`` (differentiable) against :func:`reference`."""
    out_t, g_y_t, g_gate_t, out64, dot64 = reference(disp, handle, y_ND, gate_TK, g_TD)
    y = y_ND.clone().requires_grad_(True)
    w = gate_TK.clone().requires_grad_(True)
    out = fn(y, handle, w)
    K = gate_TK.shape[1]
    _same_or_bounded(out.detach(), out_t, out64, K, f"out {what}")
    if not out.numel():
        return
    g_y, g_gate = torch.autograd.grad(out, [y, w], g_TD)
    assert g_y.dtype == y_ND.dtype and g_gate.dtype == gate_TK.dtype, what
    torch.testing.assert_close(g_y, g_y_t, rtol=0, atol=0, equal_nan=True, msg=f"g_y {what}")
    # a NaN / inf input makes the same gate gradients non-finite (same NaN / +-inf places); the rule
    # holds on the rest
    fin = torch.isfinite(g_gate_t)
    assert torch.equal(torch.isnan(g_gate), torch.isnan(g_gate_t)), what
    assert torch.equal(g_gate[torch.isinf(g_gate_t)], g_gate_t[torch.isinf(g_gate_t)]), what
    assert_close_to_ref(g_gate[fin], dot64[fin], g_gate_t[fin], name=f"g_gate {what}")


def check_dispatch_backward(fn, disp, handle, g_ND):
    """``fn(g_ND, handle) -> g_TD`` against ``Dispatcher.dispatch_backward`` and float64."""
    ref = Dispatcher.dispatch_backward(disp, g_ND, handle)
    T, K = handle.num_tokens, handle.top_k
    ref64 = g_ND.double().index_select(0, handle.inverse_S).view(T, K, g_ND.shape[1]).sum(1)
    _same_or_bounded(fn(g_ND, handle), ref, ref64, K, "dispatch_backward")
