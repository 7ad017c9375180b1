"""Host side of the TLX FP8 grouped GEMM (tlx/hopper/fp8_grouped_gemm.py): configs, checks, launch.

Legend: N rows (expert-major), K reduction, NN output columns, E experts, G = 128.

    y_N_NN = mm_fp8_tlx(a_q [N, K], a_s [N, Kb], b_q [E, NN, K], b_s [E, NNb, Kb], offsets_E)
    dw_EDF = wgrad_fp8_tlx(x_cols: Fp8Cols over [N, D], dy_cols: Fp8Cols over [N, F])

The forward passes the weight's ``q_EFD`` / ``s_EFbDb`` as B, dX its ``q_EDF`` / ``s_EDbFb`` (both
K-contiguous for the reduction they run). Nothing reads device values on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Optional

import torch

from ..grouped_gemm.host import max_m_tiles, num_sms, prep_offsets, ragged_descriptor, search_steps
from .quant import GROUP, Fp8Cols

__all__ = ["Fp8GemmConfig", "CANDIDATES", "default_config", "with_default_raster", "mm_fp8_tlx", "wgrad_fp8_tlx", "kernel_signature", "shape_reason",
           "SMEM_LIMIT", "config_from_json"]

SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on sm_90
_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch knobs of the Hopper FP8 kernel. BM = 128 rows (two consumer groups of 64) and BK = 128
    (the scale group) are fixed. Each consumer keeps BN / 2 fp32 accumulator registers and runs
    its wgmmas SUBN columns at a time into a partial of SUBN / 2 registers (ptxas may keep two
    partials live to overlap one's promotion with the next wgmma), so BN / 2 + SUBN <= 192 of its
    240 registers: 128 x 256 tiles go in 64-column slices, 128 x 128 tiles in one.

    ``precision`` is always ``"fp8"``: it is what ``MoELayer(precision=..., gemm_config=...)``
    checks against (the bf16 kernels' configs are :class:`~tlx_dist.grouped_gemm.GroupedGemmConfig`)."""

    BN: int = 256
    SUBN: int = 64
    STAGES: int = 3
    GROUP_M: int = 1  # rows of tiles walked together (L2 reuse); 1 = row-major
    precision: str = "fp8"

    def __post_init__(self):
        if self.precision != "fp8":
            raise ValueError(f"Fp8GemmConfig.precision={self.precision!r} must be 'fp8' (bf16 tile configs are "
                             "GroupedGemmConfig)")
        if self.BN not in (128, 256):
            raise ValueError(f"Fp8GemmConfig.BN={self.BN} must be 128 or 256")
        if self.SUBN not in (64, 128) or self.SUBN > self.BN:
            raise ValueError(f"Fp8GemmConfig.SUBN={self.SUBN} must be 64 or 128 and at most BN={self.BN}")
        if self.BN // 2 + self.SUBN > 192:
            raise ValueError(f"Fp8GemmConfig(BN={self.BN}, SUBN={self.SUBN}): BN/2 + SUBN = {self.BN // 2 + self.SUBN} "
                             "fp32 registers a thread exceed the 192 the consumer groups can hold without spilling")
        if not 2 <= self.STAGES <= 8:
            raise ValueError(f"Fp8GemmConfig.STAGES={self.STAGES} must be in [2, 8]")
        if self.GROUP_M not in (1, 2, 4, 8, 16):
            raise ValueError(f"Fp8GemmConfig.GROUP_M={self.GROUP_M} must be one of 1, 2, 4, 8, 16")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"Fp8GemmConfig(BN={self.BN}, STAGES={self.STAGES}) needs {self.smem_bytes()} bytes of "
                             f"shared memory (limit {SMEM_LIMIT})")

    def smem_bytes(self) -> int:
        ring = self.STAGES * (128 + self.BN) * GROUP  # fp8 A [128, 128] + B [BN, 128] per stage
        return ring + 128 * self.BN * 2  # + the bf16 epilogue tile

    def to_json(self) -> str:
        """The fields as JSON (how a pinned config travels through the FP8 custom ops)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@functools.lru_cache(maxsize=64)
def config_from_json(text: str) -> Optional[Fp8GemmConfig]:
    """Inverse of :meth:`Fp8GemmConfig.to_json`; ``""`` (no pinned config) gives None."""
    return Fp8GemmConfig(**json.loads(text)) if text else None


# The configs the bench compares (``bench/grouped_gemm.py --precision fp8 --fp8-configs``) and the
# compile tests check. 128 x 128 in one 128-column slice: the default (docs/decisions.md). 128 x 256
# in four 64-column slices halves the L2 traffic per FLOP but reads A from shared memory twice as
# often and spills in the dW form: a config to pin for the forward / dX shapes where it wins.
CANDIDATES = (Fp8GemmConfig(128, 128, 5), Fp8GemmConfig(256, 64, 3))


def with_default_raster(cfg: Fp8GemmConfig, form: str, NN: int) -> Fp8GemmConfig:
    """``cfg`` with the default tile walk: wide outputs (>= 16 column tiles) walk 8 rows of tiles
    together so the tiles in flight share B in L2 (mm forms; dW's tiles of one expert already share
    its K range); row-major otherwise."""
    group_m = 8 if form != "dW" and -(-NN // cfg.BN) >= 16 else 1
    return dataclasses.replace(cfg, GROUP_M=group_m)


def default_config(form: str, NN: int) -> Fp8GemmConfig:
    """The first candidate (128 x 128 tiles, 5-deep ring; no register spills in any form) for every
    form (``"mm"`` or ``"dW"``), with the default tile walk (:func:`with_default_raster`)."""
    return with_default_raster(CANDIDATES[0], form, NN)


def shape_reason(K: int, NN: int) -> Optional[str]:
    """Why the kernel cannot take a reduction dim K / output width NN, or None. TMA needs 16-byte
    aligned rows: the fp8 operands' rows are K (mm) or NN (dX's B, the wgrad operands) bytes."""
    if K == 0 or NN == 0:
        return f"empty dimension (K, NN) = ({K}, {NN})"
    if K % 16 or NN % 16:
        return f"K={K} and NN={NN} must be multiples of 16 (16-byte aligned fp8 rows for TMA)"
    return None


def _kernel():
    from tlx.hopper.fp8_grouped_gemm import _fp8_grouped_gemm_hopper_kernel

    return _fp8_grouped_gemm_hopper_kernel


def _launch(cfg: Fp8GemmConfig, wgrad: bool, a_desc, b_desc, c_desc, sa, sb, offsets, tile_cum, n_rows, E, M_DIM,
            K_DIM, NN, stride_sa, bound: int, device: torch.device) -> None:
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    grid = (max(1, min(sms, bound)),)
    _kernel()[grid](a_desc, b_desc, c_desc, sa, sb, offsets, tile_cum, n_rows, E, M_DIM, K_DIM, NN, stride_sa,
                    WGRAD=wgrad, BM=128, BN=cfg.BN, BK=GROUP, SUBN=cfg.SUBN, NUM_STAGES=cfg.STAGES, NUM_SMS=grid[0],
                    SEARCH_STEPS=search_steps(E), GROUP_M=cfg.GROUP_M, num_warps=4, num_stages=1)


def mm_fp8_tlx(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, offsets_E: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, cfg: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """``y[rows of e] = dequant(a)[rows of e] @ dequant(b[e])^T``.

    Args:
        a_q: ``[N, K]`` e4m3, unit column stride, rows 16-byte aligned (a packed row view will do); a_s: ``[N, Kb]`` fp32 with unit row stride (``Fp8Rows.s_MCb``).
        b_q: ``[E, NN, K]`` e4m3 (contiguous); b_s: ``[E, NNb, Kb]`` fp32 (contiguous).
        offsets_E: ``[E]`` int32 / int64 cumulative end rows (clamped on the device, guard.py).
    Returns:
        ``[N, NN]`` in ``out_dtype``; rows past ``offsets_E[-1]`` are zero.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    N, K = a_q.shape
    E, NN, _ = b_q.shape
    if not (b_q.is_contiguous() and b_s.is_contiguous() and a_s.t().is_contiguous()):
        raise ValueError("mm_fp8_tlx: b_q, b_s must be contiguous and a_s stored [Kb, N] (Fp8Rows.s_MCb)")
    if a_q.stride(1) != 1 or (N > 1 and a_q.stride(0) % 16) or a_q.data_ptr() % 16:
        raise ValueError(f"mm_fp8_tlx: a_q needs a unit column stride and 16-byte aligned rows (TMA), got strides "
                         f"{a_q.stride()}")
    y = torch.empty(N, NN, dtype=out_dtype, device=a_q.device)
    if N == 0:
        return y
    cfg = cfg or default_config("mm", NN)
    a_desc = TensorDescriptor(a_q, [N, K], [a_q.stride(0) if N > 1 else K, 1], [64, GROUP])
    b_desc = TensorDescriptor(b_q, [E, NN, K], [NN * K, K, 1], [1, cfg.SUBN, GROUP])
    c_desc = ragged_descriptor(y, 64, cfg.SUBN)
    offsets, tile_cum = prep_offsets(offsets_E, N, 128)
    bound = max_m_tiles(N, E, 128) * -(-NN // cfg.BN)
    _launch(cfg, False, a_desc, b_desc, c_desc, a_s, b_s, offsets, tile_cum, N, E, N, K, NN, N, bound, a_q.device)
    return y


def wgrad_fp8_tlx(x_cols: Fp8Cols, dy_cols: Fp8Cols, out_dtype: torch.dtype = torch.bfloat16,
                  cfg: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """``dw[e] = dequant(x)[rows of e]^T @ dequant(dy)[rows of e]`` from the transposed, expert-tile
    aligned operands of ``quantize_cols`` (the same offsets for both).

    Returns:
        ``[E, D, F]`` in ``out_dtype``; an expert without rows gets zeros.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    D, P = x_cols.q_CP.shape
    F = dy_cols.q_CP.shape[0]
    E = x_cols.offsets_E.shape[0]
    dw = torch.empty(E, D, F, dtype=out_dtype, device=x_cols.q_CP.device)
    cfg = cfg or default_config("dW", F)
    a_desc = TensorDescriptor(x_cols.q_CP, [D, P], [P, 1], [64, GROUP])
    b_desc = TensorDescriptor(dy_cols.q_CP, [F, P], [P, 1], [cfg.SUBN, GROUP])
    c_desc = TensorDescriptor(dw, [E, D, F], [D * F, F, 1], [1, 64, cfg.SUBN])
    bound = E * -(-D // 128) * -(-F // cfg.BN)
    _launch(cfg, True, a_desc, b_desc, c_desc, x_cols.s_TC, dy_cols.s_TC, x_cols.offsets_E, x_cols.tile_cum_E1,
            x_cols.n_rows, E, D, 0, F, 0, bound, x_cols.q_CP.device)
    return dw


def kernel_signature(wgrad: bool, cfg: Optional[Fp8GemmConfig] = None, E: int = 64, out: str = "bf16"):
    """(kernel, signature, constexprs, options) for ``triton.compile`` without a GPU (tests)."""
    cfg = cfg or Fp8GemmConfig()
    a = f"tensordesc<fp8e4nv[64,{GROUP}]>"
    if wgrad:
        b = f"tensordesc<fp8e4nv[{cfg.SUBN},{GROUP}]>"
        c = f"tensordesc<{out}[1,64,{cfg.SUBN}]>"
    else:
        b = f"tensordesc<fp8e4nv[1,{cfg.SUBN},{GROUP}]>"
        c = f"tensordesc<{out}[1,1,64,{cfg.SUBN}]>"
    sig = {"a_desc": a, "b_desc": b, "c_desc": c, "sa_ptr": "*fp32", "sb_ptr": "*fp32", "offsets_ptr": "*i32",
           "tile_cum_ptr": "*i32", "N_ROWS": "i32", "E": "i32", "M_DIM": "i32", "K_DIM": "i32", "NN": "i32",
           "stride_sa": "i32"}
    constexprs = {"WGRAD": wgrad, "BM": 128, "BN": cfg.BN, "BK": GROUP, "SUBN": cfg.SUBN, "NUM_STAGES": cfg.STAGES, "NUM_SMS": 132,
                  "SEARCH_STEPS": search_steps(E), "GROUP_M": cfg.GROUP_M}
    for k in constexprs:
        sig[k] = "constexpr"
    return _kernel(), sig, constexprs, {"num_warps": 4, "num_stages": 1}
