"""FP8 (e4m3, blockwise-scaled) expert GEMMs: quantization, references, custom ops with autograd.

Importing this package does no GPU work; the TLX kernels compile on first use. See ``api.py``
(functions, backends), ``experts.py`` (the SwiGLU experts of an FP8 MoE layer), ``swiglu.py`` (the
SwiGLU fused with its quantizations), ``quant.py`` (the recipe and layouts) and ``reference.py``
(oracles).
"""

from .api import (BACKENDS, Fp8WeightCache, grouped_mm_fp8, grouped_mm_fp8_wgrad, mm_fp8, select_fp8_backend,
                  wgrad_fp8)
from .experts import swiglu_experts_fp8, swiglu_experts_ref
from .quant import (Fp8Cols, Fp8Rows, Fp8Weight, dequantize_cols, dequantize_rows, dequantize_weight,
                    quantize_both, quantize_both_ref, quantize_cols, quantize_cols_from_rows,
                    quantize_cols_from_rows_ref, quantize_cols_ref, quantize_rows, quantize_rows_ref, quantize_weight,
                    quantize_weight_ref)
from .reference import mm_fp8_ref, mm_fp8_torch, wgrad_fp8_ref, wgrad_fp8_torch
from .swiglu import (swiglu_bwd_quant, swiglu_bwd_quant_both, swiglu_bwd_quant_both_ref, swiglu_bwd_quant_ref,
                     swiglu_quant, swiglu_quant_both, swiglu_quant_both_ref, swiglu_quant_ref)

__all__ = [
    "grouped_mm_fp8", "grouped_mm_fp8_wgrad", "mm_fp8", "wgrad_fp8", "select_fp8_backend", "BACKENDS",
    "Fp8WeightCache", "swiglu_experts_fp8", "swiglu_experts_ref", "Fp8Rows", "Fp8Cols", "Fp8Weight",
    "quantize_rows", "quantize_cols", "quantize_weight", "quantize_rows_ref", "quantize_cols_ref",
    "quantize_weight_ref", "quantize_both", "quantize_both_ref", "quantize_cols_from_rows",
    "quantize_cols_from_rows_ref", "dequantize_rows", "dequantize_cols", "dequantize_weight",
    "mm_fp8_ref", "wgrad_fp8_ref", "mm_fp8_torch", "wgrad_fp8_torch",
    "swiglu_quant", "swiglu_bwd_quant", "swiglu_quant_ref", "swiglu_bwd_quant_ref",
    "swiglu_quant_both", "swiglu_bwd_quant_both", "swiglu_quant_both_ref", "swiglu_bwd_quant_both_ref",
]
