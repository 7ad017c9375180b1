"""The fused expert pipeline: gather-on-load gate/up GEMM with a SwiGLU epilogue, down GEMM whose
epilogue scales by the gate and adds into the token's output, and the fused backward.

    out_TD = fused_experts(x_TD, idx_TK, gate_TK, w13_EDF2, w2_EFD)      # one rank
    out    = fused_experts_rows(x_RD, src_N, dst_N, gate_N, w13, w2, offsets_E, num_dst)  # row-index form

Backends: ``tlx`` (Hopper / Blackwell TLX kernels), ``triton`` (portable Triton kernels), ``reference``
(PyTorch); :func:`fused_experts_ref` is the per-expert loop used as the test oracle. Launch choices:
:class:`FusedConfig` (``config=``), with the tile configs of each kernel form.
"""

from .api import check_fused_args, expert_major_layout, expert_major_slots, fused_experts, fused_experts_rows, fused_tlx_supports
from .backends import FusedBackend
from .config import BlackwellFusedTileConfig, FusedConfig, FusedTileConfig, fused_tile_config
from .reference import fused_backward_ref, fused_experts_ref, fused_forward_ref
from .selection import get_fused_backend, select_fused_backend

__all__ = ["fused_experts", "fused_experts_rows", "expert_major_slots", "expert_major_layout", "check_fused_args",
           "fused_tlx_supports", "fused_experts_ref", "fused_forward_ref", "fused_backward_ref", "FusedBackend",
           "get_fused_backend", "select_fused_backend", "FusedConfig", "FusedTileConfig", "BlackwellFusedTileConfig",
           "fused_tile_config"]
