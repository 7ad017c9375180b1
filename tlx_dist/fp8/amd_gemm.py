"""Host side of the blockwise-scaled FP8 grouped GEMM for AMD (tlx/amd/fp8_grouped_gemm.py).

Legend and operands as in tlx_gemm.py. Formats: e4m3fnuz on gfx942 (MI300), e4m3fn on gfx950
(MI350's OCP FP8). Compile-checked for both targets (tests/test_fp8_compile.py) and run on CPU
under TRITON_INTERPRET=1 (tests/test_fp8_gemm_interpreted.py); not wired into the automatic backend
choice until it has run on AMD hardware (api.py raises for ROCm).
"""

from __future__ import annotations

import torch

from ..grouped_gemm.host import interpret_mode, max_m_tiles, prep_offsets, search_steps
from .quant import GROUP, Fp8Cols, Fp8Rows

__all__ = ["TARGET_FORMAT", "mm_fp8_portable", "wgrad_fp8_portable", "kernel_signature"]

TARGET_FORMAT = {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}
_FNUZ = {torch.float8_e4m3fnuz: True, torch.float8_e4m3fn: False}


def _kernel():
    from tlx.amd.fp8_grouped_gemm import _fp8_grouped_mm_portable_kernel

    return _fp8_grouped_mm_portable_kernel


def mm_fp8_portable(a: Fp8Rows, b_q: torch.Tensor, b_s: torch.Tensor, offsets_E: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = (64, 64)) -> torch.Tensor:
    """As ``tlx_gemm.mm_fp8_tlx`` (``a``: contiguous rows, scales stored ``[Kb, N]``)."""
    N, K = a.q_MC.shape
    E, NN, _ = b_q.shape
    y = torch.empty(N, NN, dtype=out_dtype, device=a.q_MC.device)
    if N == 0:
        return y
    BM, BN = block
    safe, tile_cum = prep_offsets(offsets_E, N, BM)
    grid = (max_m_tiles(N, E, BM) * -(-NN // BN),)
    _kernel()[grid](a.q_MC.view(torch.uint8), b_q.view(torch.uint8), y, a.s_MCb, b_s, safe, tile_cum, N, E, N, K, NN,
                    0, N, WGRAD=False, FNUZ=_FNUZ[a.q_MC.dtype], BM=BM, BN=BN, BK=GROUP,
                    SEARCH_STEPS=search_steps(E), NO_DOT=interpret_mode())
    return y


def wgrad_fp8_portable(x: Fp8Cols, dy: Fp8Cols, out_dtype: torch.dtype = torch.bfloat16,
                       block: tuple[int, int] = (64, 64)) -> torch.Tensor:
    """As ``tlx_gemm.wgrad_fp8_tlx``."""
    D, P = x.q_CP.shape
    F = dy.q_CP.shape[0]
    E = x.offsets_E.shape[0]
    dw = torch.empty(E, D, F, dtype=out_dtype, device=x.q_CP.device)
    BM, BN = block
    grid = (E * -(-D // BM) * -(-F // BN),)
    _kernel()[grid](x.q_CP.view(torch.uint8), dy.q_CP.view(torch.uint8), dw, x.s_TC, dy.s_TC, x.offsets_E,
                    x.tile_cum_E1, x.n_rows, E, D, 0, F, P, 0, WGRAD=True, FNUZ=_FNUZ[x.q_CP.dtype], BM=BM, BN=BN,
                    BK=GROUP, SEARCH_STEPS=search_steps(E), NO_DOT=interpret_mode())
    return dw


def kernel_signature(target: str, wgrad: bool, BM: int = 128, BN: int = 128, E: int = 64, out: str = "bf16"):
    """(kernel, signature, constexprs, attrs, options) for ``triton.compile`` without a GPU (tests)."""
    fn = _kernel()
    types = {"a_ptr": "*u8", "b_ptr": "*u8", "c_ptr": f"*{out}", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
             "offsets_ptr": "*i32", "tile_cum_ptr": "*i32"}
    types |= {n: "i32" for n in ("N_ROWS", "E", "M_DIM", "K_DIM", "NN", "P_COLS", "stride_sa")}
    constexprs = {"WGRAD": wgrad, "FNUZ": TARGET_FORMAT[target] == "e4m3fnuz", "BM": BM, "BN": BN, "BK": GROUP,
                  "SEARCH_STEPS": search_steps(E), "NO_DOT": False}
    types |= {k: "constexpr" for k in constexprs}
    sig = {n: types[n] for n in fn.arg_names}
    # the specialization the JIT gives MoE operands: 16-byte aligned pointers, dims divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr"}
    return fn, sig, constexprs, attrs, {"num_warps": 8, "num_stages": 2}
