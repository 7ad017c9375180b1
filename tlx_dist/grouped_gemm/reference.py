"""Reference grouped GEMM: a plain loop over experts. CPU fallback and test oracle.

Legend: N rows (tokens routed to this rank, expert-major), D input features, F output features,
E experts. ``offsets_E[e]`` is the exclusive end row of expert ``e``; expert ``e`` owns rows
``[offsets_E[e-1], offsets_E[e])`` (``offsets_E[-1] := 0``). Rows at or past ``offsets_E[E-1]`` belong
to no expert (padding of a worst-case receive buffer): the forward writes zeros there and the
weight gradient ignores them.

Out-of-range offsets (negative, past N, decreasing) are read as ``safe_offsets_ref`` makes them --
clamped into ``[0, N]`` and made non-decreasing -- which is what every backend computes
(``guard.py``); E = 0 experts is a ValueError.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm_ref", "grouped_mm_wgrad_ref", "safe_offsets_ref", "check_num_experts"]

_NEGATIVE, _PAST_END, _DECREASING = 1, 2, 4  # the offsets-flag bits (guard.py, tlx/common/scheduler.py)


def check_num_experts(n_experts: int, what: str) -> None:
    if n_experts == 0:
        raise ValueError(f"{what} has E=0 experts; a grouped GEMM needs at least one expert")


def safe_offsets_ref(offsets_E: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``safe_E`` int32, ``bits`` int32 0-d) on ``offsets_E``'s device, no host sync:
    ``safe_E = min(N, running max(max(0, offsets_E)))``; ``bits`` ORs 1 (an offset < 0),
    2 (an offset > N), 4 (an offset below its predecessor). Compared in int64, so an int64 offset
    past 2**31 is flagged rather than wrapped."""
    check_num_experts(offsets_E.shape[0], "offsets_E")
    o = offsets_E.to(torch.int64)
    bits = ((o < 0).any().to(torch.int32) * _NEGATIVE + (o > n_rows).any().to(torch.int32) * _PAST_END
            + (o[1:] < o[:-1]).any().to(torch.int32) * _DECREASING)
    safe = o.clamp(0, n_rows).cummax(0).values.to(torch.int32)
    return safe, bits


def _bounds(offsets_E: torch.Tensor, n_rows: int) -> list[tuple[int, int]]:
    ends = safe_offsets_ref(offsets_E, n_rows)[0].tolist()  # host sync: fine for the reference path
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def grouped_mm_ref(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e]``.

    Args:
        x_ND: ``[N, D]`` rows in expert-major order.
        w_EDF: ``[E, D, F]`` weights (any strides, e.g. a transposed view for dX).
        offsets_E: ``[E]`` int32/int64 cumulative end rows.
    Returns:
        ``[N, F]`` in ``x_ND.dtype``; rows past ``offsets_E[-1]`` are zero.
    """
    y_NF = x_ND.new_zeros(x_ND.shape[0], w_EDF.shape[2])
    for e, (lo, hi) in enumerate(_bounds(offsets_E, x_ND.shape[0])):
        if hi > lo:
            torch.mm(x_ND[lo:hi], w_EDF[e], out=y_NF[lo:hi])
    return y_NF


def grouped_mm_wgrad_ref(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``dw[e] = x[rows of e]^T @ dy[rows of e]`` (varlen-K GEMM).

    Args:
        x_ND: ``[N, D]``; dy_NF: ``[N, F]``; offsets_E: ``[E]`` cumulative end rows.
    Returns:
        ``[E, D, F]`` in ``x_ND.dtype``; an expert with no rows gets zeros.
    """
    E = offsets_E.shape[0]
    dw_EDF = x_ND.new_zeros(E, x_ND.shape[1], dy_NF.shape[1])
    for e, (lo, hi) in enumerate(_bounds(offsets_E, x_ND.shape[0])):
        if hi > lo:
            torch.mm(x_ND[lo:hi].t(), dy_NF[lo:hi], out=dw_EDF[e])
    return dw_EDF
