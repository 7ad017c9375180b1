"""MXFP8 operands for the Blackwell block-scaled kernel (tlx/blackwell/fp8_grouped_gemm.py): torch
references of the quantization and the scale layouts, and the kernel's compile signature.

Legend: M rows (expert-major), C columns, E experts, T the expert-aligned 128-row tile bound
(``M // 128 + E + 1``), Cb = cdiv(C, 128). MX: e4m3 values with one e8m0 scale (a power of two,
stored as its biased exponent byte) per 1 x 32 values along the GEMM's reduction dim; the scale is
``2**ceil(log2(amax / 448))`` (quant.py's pow2 rule). The kernel reads a 128-row block's scales
for one 128-wide k-step as 512 bytes in cuBLAS's block-scaling order: byte
``(r % 32) * 16 + (r // 32) * 4 + j`` holds row r's scale of 32-group j (:func:`swizzle_128x4`).

  mx_quantize_rows_ref(x_MC, offsets_E) -> q [M, C], sa [T, Cb, 512] (m-tile t = tile_cum[e-1] + mt)
  mx_quantize_weight_ref(w_EDF)        -> (q_EFD, s [E, Fb, Db, 512]) forward, (q_EDF, s [E, Db, Fb, 512]) dX
  mx_quantize_cols_ref(x_MC, offsets_E) -> q [C, P] (quantize_cols' layout), s [Cb, T, 512]

Not yet run on hardware (no B200 here): the host launch is left to the change that runs it.
"""

from __future__ import annotations

import torch

from .quant import GROUP, _encode_ref, _scales_ref, tile_cum_ref
from ..grouped_gemm.host import max_m_tiles

__all__ = ["MX_GROUP", "swizzle_128x4", "unswizzle_128x4", "mx_quantize_rows_ref", "mx_quantize_weight_ref",
           "mx_quantize_cols_ref", "mx_dequantize_rows", "e8m0_to_float", "kernel_signature"]

MX_GROUP = 32


def e8m0_to_float(s_u8: torch.Tensor) -> torch.Tensor:
    return (s_u8.to(torch.int32) << 23).view(torch.float32)


def swizzle_128x4(s_RJ: torch.Tensor) -> torch.Tensor:
    """``[..., 128, 4]`` uint8 (row r, 32-group j) -> ``[..., 512]`` in the block-scaling order."""
    lead = s_RJ.shape[:-2]
    return s_RJ.reshape(*lead, 4, 32, 4).transpose(-3, -2).reshape(*lead, 512)


def unswizzle_128x4(s_512: torch.Tensor) -> torch.Tensor:
    lead = s_512.shape[:-1]
    return s_512.reshape(*lead, 32, 4, 4).transpose(-3, -2).reshape(*lead, 128, 4)


def _mx_groups(x_RK: torch.Tensor, fmt: str = "e4m3fn") -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[R, K]`` (R % 128 == 0, K % 128 == 0, zero-padded) -> (q ``[R, K]``, e8m0 ``[R, K // 32]``)."""
    R, K = x_RK.shape
    xg = x_RK.float().view(R, K // MX_GROUP, MX_GROUP)
    s, inv = _scales_ref(xg.abs().amax(-1), fmt, pow2=True)
    q = _encode_ref(xg, inv[..., None], fmt).view(R, K)
    return q, ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _blocks(e8: torch.Tensor) -> torch.Tensor:
    """e8m0 ``[R, K // 32]`` -> ``[R // 128, K // 128, 512]``."""
    R, J = e8.shape
    return swizzle_128x4(e8.view(R // 128, 128, J // 4, 4).transpose(1, 2))


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def mx_quantize_rows_ref(x_MC: torch.Tensor, offsets_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in 1 x 32 MX groups; scales by expert-aligned 128-row tile (reads offsets on the host)."""
    M, C = x_MC.shape
    E = offsets_E.shape[0]
    T, Cb = max_m_tiles(M, E, GROUP), -(-C // GROUP)
    safe, tile_cum = tile_cum_ref(offsets_E, M)
    q = torch.zeros(M, C, dtype=torch.float8_e4m3fn, device=x_MC.device)
    sa = torch.zeros(T, Cb, 512, dtype=torch.uint8, device=x_MC.device)
    ends, first = safe.tolist(), [0] + tile_cum.tolist()[:-1]
    for e in range(E):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        n_t = -(-(hi - lo) // GROUP)
        if n_t:
            qe, e8 = _mx_groups(_pad(x_MC[lo:hi], n_t * GROUP, Cb * GROUP))
            q[lo:hi] = qe[:hi - lo, :C]
            sa[first[e]:first[e] + n_t] = _blocks(e8)
    return q, sa


def mx_dequantize_rows(q: torch.Tensor, sa: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, C]`` from :func:`mx_quantize_rows_ref`'s outputs (rows outside experts: zero)."""
    M, C = q.shape
    safe, tile_cum = tile_cum_ref(offsets_E, M)
    out = torch.zeros(M, C, dtype=torch.float64, device=q.device)
    ends, first = safe.tolist(), [0] + tile_cum.tolist()[:-1]
    for e in range(len(ends)):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        n_t = -(-(hi - lo) // GROUP)
        if n_t:
            e8 = unswizzle_128x4(sa[first[e]:first[e] + n_t]).transpose(1, 2).reshape(n_t * GROUP, -1)
            s = e8m0_to_float(e8).double().repeat_interleave(MX_GROUP, dim=1)[:hi - lo, :C]
            out[lo:hi] = q[lo:hi].double() * s
    return out


def mx_quantize_weight_ref(w_EDF: torch.Tensor):
    """((q_EFD, s_EFbDb512), (q_EDF, s_EDbFb512)): each layout quantized along its own reduction dim."""
    E, D, F = w_EDF.shape
    Db, Fb = -(-D // GROUP), -(-F // GROUP)
    out = []
    for w_RK, R, K in ((w_EDF.transpose(1, 2), F, D), (w_EDF, D, F)):
        Rb, Kb = -(-R // GROUP), -(-K // GROUP)
        qs, ss = [], []
        for e in range(E):
            q, e8 = _mx_groups(_pad(w_RK[e], Rb * GROUP, Kb * GROUP))
            qs.append(q[:R, :K])
            ss.append(_blocks(e8))
        out.append((torch.stack(qs).contiguous(), torch.stack(ss)))
    assert out[0][1].shape == (E, Fb, Db, 512)
    return tuple(out)


def mx_quantize_cols_ref(x_MC: torch.Tensor, offsets_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight gradient's operand: quantize_cols' layout ``[C, P]`` with MX groups along the
    tokens, scales ``[Cb, T, 512]``."""
    M, C = x_MC.shape
    E = offsets_E.shape[0]
    T, Cb = max_m_tiles(M, E, GROUP), -(-C // GROUP)
    safe, tile_cum = tile_cum_ref(offsets_E, M)
    q = torch.zeros(C, GROUP * T, dtype=torch.float8_e4m3fn, device=x_MC.device)
    s = torch.zeros(Cb, T, 512, dtype=torch.uint8, device=x_MC.device)
    ends, first = safe.tolist(), [0] + tile_cum.tolist()[:-1]
    for e in range(E):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        n_t = -(-(hi - lo) // GROUP)
        if n_t:
            xt = _pad(x_MC[lo:hi].t(), Cb * GROUP, n_t * GROUP)  # [C, tokens of e]
            qe, e8 = _mx_groups(xt)
            q[:, GROUP * first[e]:GROUP * (first[e] + n_t)] = qe[:C]
            s[:, first[e]:first[e] + n_t] = _blocks(e8)
    return q, s


def kernel_signature(wgrad: bool, BN: int = 128, stages: int = 4, E: int = 64, out: str = "bf16"):
    """(kernel, signature, constexprs, options) of the Blackwell MXFP8 kernel for ``triton.compile``."""
    from tlx.blackwell.fp8_grouped_gemm import _mxfp8_grouped_gemm_blackwell_kernel

    from ..grouped_gemm.host import search_steps

    if wgrad:
        b, c = f"tensordesc<fp8e4nv[{BN},128]>", f"tensordesc<{out}[1,128,{min(BN, 128)}]>"
    else:
        b, c = f"tensordesc<fp8e4nv[1,{BN},128]>", f"tensordesc<{out}[1,1,128,{min(BN, 128)}]>"
    sig = {"a_desc": "tensordesc<fp8e4nv[128,128]>", "b_desc": b, "c_desc": c,
           "sa_desc": "tensordesc<u8[1,1,1,2,256]>", "sb_desc": f"tensordesc<u8[1,{BN // 128},1,2,256]>",
           "offsets_ptr": "*i32", "tile_cum_ptr": "*i32", "N_ROWS": "i32", "E": "i32", "M_DIM": "i32",
           "K_DIM": "i32", "NN": "i32"}
    constexprs = {"WGRAD": wgrad, "BM": 128, "BN": BN, "BK": 128, "NUM_STAGES": stages, "NUM_SMS": 148,
                  "SEARCH_STEPS": search_steps(E)}
    for k in constexprs:
        sig[k] = "constexpr"
    return _mxfp8_grouped_gemm_blackwell_kernel, sig, constexprs, {"num_warps": 4, "num_stages": 1}
