"""Pure-PyTorch references of the fused expert pipeline: the test oracle and the CPU fallback.

Legend: T tokens, R source rows (``x_TD`` on one rank; a receive buffer under EP), N expert-major
rows, T_out destination rows, D hidden, F expert intermediate, E experts, K top-k.
``src_N[n]`` is the source row of row n, ``dst_N[n]`` its destination row, ``gate_N[n]`` its gate
weight; ``offsets_E`` the cumulative end row of each expert; rows past ``offsets_E[-1]`` are padding.

* :func:`fused_experts_ref` -- the whole layer body as a textbook per-expert loop on ``(idx_TK,
  gate_TK)``: no sort, no row indices, no grouped GEMM. Run it in float64 for the oracle.
* :func:`fused_forward_ref` / :func:`fused_backward_ref` -- what each fused kernel computes, in the
  same row-index form and with the same roundings (h and a stored in the activation dtype, GEMMs
  accumulated in fp32 or wider, gate applied to the fp32 accumulator, k-sum in fp32). They are the
  ``reference`` backend of :func:`tlx_dist.fused.fused_experts` (any device and dtype; they read
  ``offsets_E[-1]`` on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref

__all__ = ["fused_experts_ref", "fused_forward_ref", "fused_backward_ref"]


def fused_experts_ref(x_TD: torch.Tensor, idx_TK: torch.Tensor, gate_TK: torch.Tensor, w13_EDF2: torch.Tensor,
                      w2_EFD: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k gate[t, k] * (silu(x[t] @ w13[e]_gate) * (x[t] @ w13[e]_up)) @ w2[e]``, e = idx[t, k].

    Args:
        x_TD: ``[T, D]``; idx_TK: ``[T, K]`` expert ids; gate_TK: ``[T, K]`` gate weights;
        w13_EDF2: ``[E, D, 2F]`` (gate | up); w2_EFD: ``[E, F, D]``.
    Returns:
        ``[T, D]`` in ``x_TD.dtype``, differentiable in x, gate, w13 and w2 (plain autograd).
    """
    Fe = w13_EDF2.shape[2] // 2
    out_TD = torch.zeros_like(x_TD)
    for e in range(w13_EDF2.shape[0]):
        t, k = (idx_TK == e).nonzero(as_tuple=True)  # host sync: fine for the reference
        if t.numel() == 0:
            continue
        h = x_TD[t] @ w13_EDF2[e]
        y = (F.silu(h[:, :Fe]) * h[:, Fe:]) @ w2_EFD[e]
        out_TD = out_TD.index_add(0, t, gate_TK[t, k].to(y.dtype).unsqueeze(1) * y)
    return out_TD


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _gather_rows(t_RC: torch.Tensor, idx_N: torch.Tensor, end: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, C]``: row n = t[idx[n]] for n < end, zero for padding rows (whose idx is never read)."""
    out = t_RC.new_zeros(idx_N.shape[0], t_RC.shape[1], dtype=dtype)
    out[:end] = t_RC[idx_N[:end].long()].to(dtype)
    return out


def _end(offsets_E: torch.Tensor) -> int:
    return int(offsets_E[-1]) if offsets_E.numel() else 0


def fused_forward_ref(x_RD: torch.Tensor, src_N: torch.Tensor, dst_N: torch.Tensor, gate_N: torch.Tensor,
                      w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
                      num_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the forward kernels compute. Returns ``(out [num_dst, D] in x's dtype, h_N2F)``."""
    acc, dt = _acc_dtype(x_RD.dtype), x_RD.dtype
    end = _end(offsets_E)
    Fe = w13_EDF2.shape[2] // 2
    x_ND = _gather_rows(x_RD, src_N, end, acc)
    h_N2F = grouped_mm_ref(x_ND, w13_EDF2.to(acc), offsets_E).to(dt)
    hf = h_N2F.to(acc)
    a_NF = (F.silu(hf[:, :Fe]) * hf[:, Fe:]).to(dt)
    y_ND = grouped_mm_ref(a_NF.to(acc), w2_EFD.to(acc), offsets_E) * gate_N.to(acc).unsqueeze(1)
    out = torch.zeros(num_dst, x_RD.shape[1], dtype=acc, device=x_RD.device)
    out.index_add_(0, dst_N[:end].long(), y_ND[:end])
    return out.to(dt), h_N2F


def fused_backward_ref(dout_TD: torch.Tensor, x_RD: torch.Tensor, src_N: torch.Tensor, dst_N: torch.Tensor,
                       gate_N: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
                       h_N2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the backward kernels compute. Returns ``(dx_RD, dgate_N, dw13_EDF2, dw2_EFD)``."""
    acc, dt = _acc_dtype(x_RD.dtype), x_RD.dtype
    end = _end(offsets_E)
    Fe = w13_EDF2.shape[2] // 2
    live_N1 = (torch.arange(src_N.shape[0], device=src_N.device) < end).unsqueeze(1)
    dout_ND = _gather_rows(dout_TD, dst_N, end, acc)
    g_NF = grouped_mm_ref(dout_ND, w2_EFD.transpose(1, 2).to(acc), offsets_E)       # dL/d(gate * a) / gate
    hf = h_N2F.to(acc)
    hg, hu = hf[:, :Fe], hf[:, Fe:]
    sig = torch.sigmoid(hg)
    a_NF = hg * sig * hu
    gate_N1 = torch.where(live_N1, gate_N.to(acc).unsqueeze(1), 0)
    dgate_N = (a_NF * g_NF).sum(1)
    da = g_NF * gate_N1
    dh_N2F = torch.cat([da * hu * sig * (1 + hg * (1 - sig)), da * hg * sig], 1).to(dt)
    ag_NF = (a_NF * gate_N1).to(dt)
    dxr_ND = grouped_mm_ref(dh_N2F.to(acc), w13_EDF2.transpose(1, 2).to(acc), offsets_E)
    dx = torch.zeros(x_RD.shape, dtype=acc, device=x_RD.device).index_add_(0, src_N[:end].long(), dxr_ND[:end])
    x_ND = _gather_rows(x_RD, src_N, end, acc)
    dw13 = grouped_mm_wgrad_ref(x_ND, dh_N2F.to(acc), offsets_E).to(w13_EDF2.dtype)
    dw2 = grouped_mm_wgrad_ref(ag_NF.to(acc), dout_ND, offsets_E).to(w2_EFD.dtype)
    return dx.to(dt), dgate_N.to(gate_N.dtype), dw13, dw2
