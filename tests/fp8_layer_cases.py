"""Accuracy checks of the FP8 MoE layer shared by the CPU tests (tests/test_moe_fp8.py) and the GPU
tests (tests/test_moe_fp8_gpu.py). Not collected (no test_ prefix).

The rule is STYLE.md 6 with torch's own FP8 path as "torch in the same dtype": the layer (or the
experts function) with ``gemm_backend="torch"`` -- the same quantization of every operand, each
GEMM through ``torch._scaled_mm`` per expert and 128-wide k-group with the block scales applied in
fp32 (tlx_dist/fp8/reference.py) -- and ``ref64`` the *unquantized* computation in float64 on the
same weights (tlx_dist.moe_reference / ``swiglu_experts_ref``). So
``max|ours - ref64| <= 2 * max|torch_fp8 - ref64| + atol`` says the FP8 path under test loses no
more accuracy than torch's FP8 path does, for the output and every gradient. A check beside it
proves FP8 ran at all: the FP8 output's error is several times the bf16 layer's (e4m3 keeps 3
mantissa bits, bf16 7), so a silent bf16 fallback fails.
"""

from __future__ import annotations

import torch

from _util import make_cfg, reference_of
from tlx_dist import MoELayer
from tlx_dist.fp8 import swiglu_experts_fp8, swiglu_experts_ref
from tlx_dist.testing import assert_close_to_ref, max_err

# (name, config overrides, input transform, why)
LAYER_CASES = [
    ("random", {}, None, "random tokens and weights"),
    ("outlier_per_row", {}, "outlier", "a 1e4 outlier in every row: its 128-wide group's scale is set by it"),
    ("zero_blocks", {}, "zero_blocks", "all-zero activation tiles and an all-zero 128 x 128 weight block"),
    ("tiny_scales", {}, "tiny", "rows scaled by 1e-20: scales far below 1, values must not flush to zero"),
    ("k_not_128", dict(dim=208, moe_inter_dim=48), None,
     "D = 208 and F = 48: every reduction ends in a partial 128-group (multiples of 16 for torch's path)"),
]


def _input(T, D, how, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    if how == "outlier":
        x[:, 5 % D] = 1e4
    elif how == "zero_blocks":
        x[: T // 3, :128] = 0.0
    elif how == "tiny":
        x[: T // 2] *= 1e-20
    return x.to(torch.bfloat16).to(device)


def _layer_run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    params = [p for _, p in layer.named_parameters()]
    grads = torch.autograd.grad((out.float() * dy.float()).sum(), [x] + params, allow_unused=True)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    return out.detach(), {n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, [x] + params, grads)}


def check_layer_fp8_vs_fp64(case, backend, device, T=48, seed=0):
    """The FP8 layer with ``gemm_backend=backend`` on ``device`` against the float64 loop, its
    output and the gradients of x and of every parameter bounded by torch's FP8 path's errors."""
    name, over, how, why = case
    # small: torch._scaled_mm (the oracle's FP8 products) is slow on CPU
    kw = dict(dim=256, moe_inter_dim=64, num_experts=4, top_k=2, init_std=0.05, dtype="bfloat16")
    kw.update(over)
    cfg = make_cfg(**kw)
    torch.manual_seed(seed)
    ours = MoELayer(cfg, precision="fp8", gemm_backend=backend, device=device)
    if how == "zero_blocks":
        with torch.no_grad():
            ours.w13[0, :128, :128] = 0.0
    theirs = MoELayer(cfg, precision="fp8", gemm_backend="torch", device=device)
    bf16 = MoELayer(cfg, precision="bf16", device=device)
    theirs.load_state_dict(ours.state_dict())
    bf16.load_state_dict(ours.state_dict())
    x = _input(T, cfg.dim, how, device, seed)
    dy = torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16).to(device)
    out, g = _layer_run(ours, x, dy)
    out_t, g_t = _layer_run(theirs, x, dy)
    out_b, _ = _layer_run(bf16, x, dy)

    x64 = x.detach().cpu().double().requires_grad_(True)
    (ref, _, _, _), p64 = reference_of(ours.cpu() if device == "cpu" else _cpu_copy(ours), x64)
    grads64 = torch.autograd.grad((ref * dy.cpu().double()).sum(), [x64] + [p64[n] for n in p64], allow_unused=True)
    ref_g = {"x": grads64[0]}
    ref_g.update({n: (torch.zeros_like(p64[n]) if gr is None else gr) for n, gr in zip(p64, grads64[1:])})

    assert_close_to_ref(out.cpu(), ref, out_t.cpu(), dtype=torch.bfloat16, name=f"{name}: out")
    for n in g:
        assert_close_to_ref(g[n].cpu(), ref_g[n], g_t[n].cpu(), dtype=torch.bfloat16, name=f"{name}: d{n}")
    # FP8 ran: its error dwarfs the bf16 layer's (not a silent bf16 fallback)
    assert max_err(out.cpu(), ref) > 4 * max_err(out_b.cpu(), ref), f"{name}: the FP8 layer is as exact as bf16"
    assert ours.fp8_quantizations == 2 and theirs.fp8_quantizations == 2


def _cpu_copy(layer):
    twin = MoELayer(layer.cfg, precision=layer.precision, gemm_backend="reference")
    twin.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    return twin


def _offsets(counts, device):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


# (counts, N, D, F, why): routings the layer's router does not produce on demand
EXPERT_CASES = [
    ([0, 40, 0, 23, 0], 64, 256, 64, "zero-token experts (first, middle, last)"),
    ([0, 64, 0, 0], 64, 256, 64, "one expert takes every row"),
    ([40, 0, 50, 7], 110, 208, 48, "K not a multiple of 128, 13 padding rows, a 7-row expert"),
    ([130, 126], 256, 128, 32, "experts straddling the 128-row tiles of the weight gradient"),
]


def check_experts_fp8_vs_fp64(case, backend, device, seed=0):
    """``swiglu_experts_fp8`` (output, dx, dw13, dw2) on explicit routings vs the float64 experts,
    bounded by torch's FP8 path; padding rows exactly zero."""
    counts, N, D, F, why = case
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(N, D, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, D, 2 * F, generator=g) / D ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, F, D, generator=g) / F ** 0.5).to(torch.bfloat16)
    dy = torch.randn(N, D, generator=g).to(torch.bfloat16)
    off = _offsets(counts, device)

    def run(fn, dt, dev):
        xs, a, b = (t.to(dev).to(dt).requires_grad_(True) for t in (x, w13, w2))
        y = fn(xs, a, b, off.to(dev))
        grads = torch.autograd.grad((y.to(dt) * dy.to(dev).to(dt)).sum(), [xs, a, b])
        return [y.detach().cpu()] + [t.cpu() for t in grads]

    ours = run(lambda *a: swiglu_experts_fp8(*a, backend=backend), torch.bfloat16, device)
    theirs = run(lambda *a: swiglu_experts_fp8(*a, backend="torch"), torch.bfloat16, device)
    ref = run(swiglu_experts_ref, torch.float64, "cpu")
    for n, o, t, r in zip(("y", "dx", "dw13", "dw2"), ours, theirs, ref):
        assert_close_to_ref(o, r, t, dtype=torch.bfloat16, name=f"{why}: {n}")
    n_rows = sum(counts)
    assert (ours[0][n_rows:] == 0).all() and (ours[1][n_rows:] == 0).all(), f"{why}: padding rows must be zero"
    for e, c in enumerate(counts):
        if c == 0:
            assert (ours[2][e] == 0).all() and (ours[3][e] == 0).all(), f"{why}: expert {e} has no rows, dW must be 0"
