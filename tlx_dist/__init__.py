"""tlx_dist: Mixture-of-Experts training with TLX grouped GEMMs and symmetric-memory dispatch.

Importing this package does no GPU or NCCL work; kernels compile on first use.
"""

from .comm import AllToAllDispatcher, DispatchHandle, Dispatcher, LocalDispatcher
from .config import MoEConfig
from .fp8 import Fp8WeightCache, grouped_mm_fp8, grouped_mm_fp8_wgrad
from .grouped_gemm import grouped_mm, grouped_mm_wgrad
from .moe import MoELayer, make_dispatcher
from .reference import moe_reference
from .router import Router, RouterOutput, RoutingStats

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "MoELayer", "Router", "RouterOutput", "RoutingStats",
    "Dispatcher", "DispatchHandle", "LocalDispatcher", "AllToAllDispatcher", "make_dispatcher",
    "grouped_mm", "grouped_mm_wgrad", "moe_reference",
    "grouped_mm_fp8", "grouped_mm_fp8_wgrad", "Fp8WeightCache",
]
