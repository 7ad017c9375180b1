"""The rowwise-FP8 MoE anchor of ``bench/moe_layer.py --precision fp8``: the torchtitan-style layer
(router -> argsort -> gather -> two grouped GEMMs with SwiGLU -> gate scale -> index_add) with every
expert GEMM (forward, dX, dW) through ``torch._scaled_grouped_mm`` on rowwise-scaled e4m3 operands,
as torchao's FP8 MoE training does.

Legend: N expanded rows (expert-major), D input features, F output features, E experts, G = E groups.

``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=bf16, use_fast_accum)`` (sm_90+):
  2d x 3d (forward, dX): a [N, K] e4m3 row-major, b [E, K, NN] e4m3 column-major (stored [E, NN, K]),
      scale_a [N] fp32 (one per row of a), scale_b [E, NN] fp32 (one per output column and expert),
      offs [E] int32 cumulative end rows; out [N, NN].
  2d x 2d (dW, jagged K): a [M, N] row-major, b [N, NN] column-major, offs over N;
      scale_a [G * M] and scale_b [G * NN] fp32, one per (group, row of a / column of b) over the
      group's slice of N; out [G, M, NN]. The order of those per-group scales is probed once on a
      small problem (:func:`probe_2d2d_scale_layout`) rather than assumed.
Scales are dequantization factors (``out = (a * scale_a) @ (b * scale_b)``), ``amax / 448`` here. The
quantization is plain torch ops (amax, divide, cast; torchao fuses it into Triton kernels), so this
anchor's GEMMs are torch's best and its quantization is not.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def available() -> str:
    """'' when ``torch._scaled_grouped_mm`` runs here, else the one-line reason it does not."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return "torch._scaled_grouped_mm needs an sm_90+ GPU"
    try:
        probe_2d2d_scale_layout()
    except Exception as err:  # noqa: BLE001 -- any failure means the anchor cannot run
        return f"torch._scaled_grouped_mm failed on a probe: {type(err).__name__}: {str(err)[:200]}"
    return ""


def _rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of ``x`` with one scale per slice along ``dim`` (amax over ``dim``), and the scales."""
    s = x.abs().amax(dim=dim, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.squeeze(dim)


def _per_group_cols(x_NC: torch.Tensor, offs: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of ``x_NC`` scaled per (group of rows, column): e4m3 [N, C] and scales [G, C]."""
    N, C = x_NC.shape
    gid = torch.searchsorted(offs, torch.arange(N, device=x_NC.device, dtype=offs.dtype), right=True)
    gid = gid.clamp_max(G - 1)  # padding rows past the last offset join the last group (never read)
    amax = torch.zeros(G, C, dtype=torch.float32, device=x_NC.device)
    amax.scatter_reduce_(0, gid[:, None].expand(N, C), x_NC.abs().float(), "amax")
    s = amax.clamp_min(1e-12) / FP8_MAX
    return (x_NC.float() / s[gid]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


@functools.lru_cache(maxsize=None)
def probe_2d2d_scale_layout() -> str:
    """``"group_major"`` (scale index ``g * M + m``) or ``"row_major"`` (``m * G + g``): which order
    of the 2d x 2d per-group scales reproduces the dequantized product on a small problem."""
    g = torch.Generator(device="cuda").manual_seed(0)
    M, NN, G, n = 32, 48, 3, 64
    a = torch.randn(M, G * n, device="cuda", generator=g)
    b = torch.randn(G * n, NN, device="cuda", generator=g)
    offs = torch.arange(1, G + 1, device="cuda", dtype=torch.int32) * n
    sa = torch.rand(G, M, device="cuda", generator=g) + 0.5
    sb = torch.rand(G, NN, device="cuda", generator=g) + 0.5
    aq, bq = a.to(FP8), b.to(FP8)
    exact = torch.stack([(aq[:, i * n:(i + 1) * n].float() * sa[i, :, None])
                         @ (bq[i * n:(i + 1) * n].float() * sb[i]) for i in range(G)])
    for name, (xa, xb) in {"group_major": (sa.reshape(-1), sb.reshape(-1)),
                           "row_major": (sa.t().reshape(-1), sb.t().reshape(-1))}.items():
        out = torch._scaled_grouped_mm(aq, bq.t().contiguous().t(), xa.contiguous(), xb.contiguous(), offs=offs,
                                       out_dtype=torch.bfloat16)
        if ((out.float() - exact).norm() / exact.norm()).item() < 1e-2:
            return name
    raise RuntimeError("neither order of the 2d x 2d per-group scales reproduces the dequantized product")


def _order(s_GC: torch.Tensor) -> torch.Tensor:
    return (s_GC if probe_2d2d_scale_layout() == "group_major" else s_GC.t()).contiguous().reshape(-1)


class _RowwiseGroupedMM(torch.autograd.Function):
    """``y[rows e] = x[rows e] @ w[e]`` with all three GEMMs in rowwise FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs, fast_accum: bool):
        xq, xs = _rowwise(x_ND, -1)  # [N, D], [N]
        wq, ws = _rowwise(w_EDF, 1)  # per (e, f) over D: [E, D, F], [E, F]
        wq = wq.transpose(1, 2).contiguous().transpose(1, 2)  # column-major [E, D, F]
        ctx.save_for_backward(x_ND, w_EDF, offs)
        ctx.fast_accum = fast_accum
        return torch._scaled_grouped_mm(xq, wq, xs, ws, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)

    @staticmethod
    def backward(ctx, dy_NF):
        x_ND, w_EDF, offs = ctx.saved_tensors
        dy_NF = dy_NF.contiguous()
        E = w_EDF.shape[0]
        dyq, dys = _rowwise(dy_NF, -1)  # [N, F], [N]
        wq, ws = _rowwise(w_EDF, 2)  # per (e, d) over F: [E, D, F] row-major = [E, F, D] column-major
        dx = torch._scaled_grouped_mm(dyq, wq.transpose(1, 2), dys, ws, offs=offs, out_dtype=torch.bfloat16,
                                      use_fast_accum=ctx.fast_accum)
        xq, xs = _per_group_cols(x_ND, offs, E)  # [N, D], [E, D]
        gq, gs = _per_group_cols(dy_NF, offs, E)  # [N, F], [E, F]
        dw = torch._scaled_grouped_mm(xq.t().contiguous(), gq.t().contiguous().t(), _order(xs), _order(gs), offs=offs,
                                      out_dtype=torch.bfloat16, use_fast_accum=ctx.fast_accum)
        return dx, dw.to(w_EDF.dtype), None, None


ALIGN = 16  # rows: torch's grouped GEMMs need every group's byte extent along the jagged dim % 16 == 0


def _padded_layout(flat_N: torch.Tensor, E: int, order_N: torch.Tensor):
    """Expert-major rows with each expert's group padded to a multiple of ``ALIGN`` rows, as torchao
    pads FP8 MoE token groups: the dW GEMM's jagged K dimension is e4m3 (one byte per row), so a
    group of 5 rows would break the 16-byte rule. Returns (``pos_N``: padded row of sorted row j,
    ``offs_E`` int32 padded cumulative ends, ``Np`` static padded size). No host sync: the padded
    size is the static bound ``N + E * (ALIGN - 1)`` rounded up; rows past the last group are zeros."""
    N = flat_N.numel()
    counts = torch.zeros(E, dtype=torch.int64, device=flat_N.device)
    counts.scatter_add_(0, flat_N, torch.ones_like(flat_N))
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    end_p = torch.cumsum(padded, 0)
    start, start_p = torch.cumsum(counts, 0) - counts, end_p - padded
    e_sorted = flat_N[order_N]
    pos = start_p[e_sorted] + (torch.arange(N, device=flat_N.device) - start[e_sorted])
    Np = -(-(N + E * (ALIGN - 1)) // ALIGN) * ALIGN
    return pos, end_p.to(torch.int32), Np


def scaled_grouped_mm_experts(x_TD, idx_TK, gate_TK, w13_EDF2, w2_EFD, fast_accum: bool = True):
    """torchtitan's experts (bench/moe_layer.py ``torchtitan_experts``) with rowwise-FP8 GEMMs over
    16-row-aligned expert groups (:func:`_padded_layout`). ``x_TD`` [T, D] bf16, ``idx_TK`` /
    ``gate_TK`` [T, K] from the router; returns [T, D] bf16."""
    T, K = idx_TK.shape
    E, Fe = w13_EDF2.shape[0], w2_EFD.shape[1]
    flat = idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pos, offs, Np = _padded_layout(flat, E, order)
    tok = order // K
    x_pad = x_TD.new_zeros(Np, x_TD.shape[1]).index_copy(0, pos, x_TD[tok])  # padding rows stay 0
    h = _RowwiseGroupedMM.apply(x_pad, w13_EDF2, offs, fast_accum)
    y = _RowwiseGroupedMM.apply(F.silu(h[:, :Fe]) * h[:, Fe:], w2_EFD, offs, fast_accum)[pos]
    y = y * gate_TK.reshape(-1)[order].to(y.dtype).unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, tok, y)
