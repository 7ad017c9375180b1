"""Host side of the portable stock-Triton grouped GEMM (``tlx/portable/grouped_gemm.py``).

Registers ``Backend("triton", priority=40)`` when ``triton`` imports. The host helpers it shares with
the other kernel backends are in ``host.py``. Nothing here reads device values on the host: every
launch is CUDA-graph safe.

Legend: N rows, D input features, F output features, E experts, ``offsets_E`` cumulative end rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from tlx import triton_available

from .registry import Backend, register_backend, register_unavailable
from .host import interpret_mode, max_m_tiles, prep_offsets, search_steps
from .reference import check_num_experts


# --- the portable backend -------------------------------------------------------------------------

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _supports(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> Optional[str]:
    if not triton_available():
        return "triton is not importable"
    if x_ND.dtype not in _DTYPES or w_EDF.dtype != x_ND.dtype:
        return f"dtype {x_ND.dtype}/{w_EDF.dtype} (needs one of bfloat16, float16, float32)"
    if x_ND.device.type == "cpu":
        return None if interpret_mode() else "CPU tensors (set TRITON_INTERPRET=1 to run the kernel interpreted)"
    if x_ND.device.type != "cuda":
        return f"device {x_ND.device}"
    return None


def _blocks(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    # (BM, BN, BK, num_warps, num_stages); small tiles under the interpreter keep CI fast.
    if x.device.type == "cpu":
        return 32, 32, 32, 4, 1
    if x.dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return 128, 128, 64, 8, 3


def _mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    from tlx.portable.grouped_gemm import _grouped_mm_kernel

    N, D = x_ND.shape
    E, _, F = w_EDF.shape
    y_NF = torch.empty(N, F, dtype=x_ND.dtype, device=x_ND.device)
    if N == 0 or F == 0:
        return y_NF
    BM, BN, BK, warps, stages = _blocks(x_ND)
    offsets, tile_cum = prep_offsets(offsets_E, N, BM)
    grid = (max_m_tiles(N, E, BM) * -(-F // BN),)
    _grouped_mm_kernel[grid](
        x_ND, w_EDF, y_NF, offsets, tile_cum, N, E, D, F,
        x_ND.stride(0), x_ND.stride(1), w_EDF.stride(0), w_EDF.stride(1), w_EDF.stride(2),
        y_NF.stride(0), y_NF.stride(1),
        BM=BM, BN=BN, BK=BK, SEARCH_STEPS=search_steps(E), IEEE=x_ND.dtype == torch.float32, NO_DOT=interpret_mode(),
        num_warps=warps, num_stages=stages,
    )
    return y_NF


def _wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    from tlx.portable.grouped_gemm import _grouped_wgrad_kernel

    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets_E.shape[0]
    check_num_experts(E, "offsets_E")
    dw_EDF = torch.empty(E, D, F, dtype=x_ND.dtype, device=x_ND.device)
    if dw_EDF.numel() == 0:
        return dw_EDF
    offsets = prep_offsets(offsets_E, N)[0]
    BM, BN, BK, warps, stages = _blocks(x_ND)
    grid = (E * -(-D // BM) * -(-F // BN),)
    _grouped_wgrad_kernel[grid](
        x_ND, dy_NF, dw_EDF, offsets, N, E, D, F,
        x_ND.stride(0), x_ND.stride(1), dy_NF.stride(0), dy_NF.stride(1),
        dw_EDF.stride(0), dw_EDF.stride(1), dw_EDF.stride(2),
        BM=BM, BN=BN, BK=BK, IEEE=x_ND.dtype == torch.float32, NO_DOT=interpret_mode(), num_warps=warps, num_stages=stages,
    )
    return dw_EDF


if triton_available():
    # After torch: on Hopper the portable kernel is slower than torch._grouped_mm, so it is the
    # automatic choice only where torch._grouped_mm cannot run (AMD, pre-sm_90 GPUs).
    register_backend(Backend("triton", _mm, _wgrad, _supports, priority=40))
else:
    register_unavailable("triton", "triton is not importable (pip install -e '.[tlx]')")
