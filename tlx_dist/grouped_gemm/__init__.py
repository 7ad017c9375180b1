"""Host side of the experts' grouped GEMM: checks, backend choice, tile configs, custom ops, autograd, reference."""

from .api import check_grouped_mm_args, check_grouped_mm_wgrad_args, grouped_mm, grouped_mm_wgrad, tune_grouped_mm
from .backends import Backend, available_backends, get_backend, register_backend, select_backend
from .config import GroupedGemmConfig, grouped_mm_config
from .guard import check_offsets, offsets_flag
from .reference import grouped_mm_ref, grouped_mm_wgrad_ref

__all__ = [
    "grouped_mm", "grouped_mm_wgrad", "tune_grouped_mm", "GroupedGemmConfig", "grouped_mm_config",
    "check_grouped_mm_args", "check_grouped_mm_wgrad_args",
    "Backend", "available_backends", "get_backend", "register_backend", "select_backend",
    "grouped_mm_ref", "grouped_mm_wgrad_ref", "check_offsets", "offsets_flag",
]
