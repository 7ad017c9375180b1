"""FP8 (e4m3, blockwise-scaled) expert GEMMs: quantization, references, the TLX kernels' host side."""

from .quant import (Fp8Cols, Fp8Rows, Fp8Weight, dequantize_cols, dequantize_rows, dequantize_weight,
                    quantize_cols, quantize_cols_ref, quantize_rows, quantize_rows_ref, quantize_weight,
                    quantize_weight_ref)

__all__ = [
    "Fp8Rows", "Fp8Cols", "Fp8Weight", "quantize_rows", "quantize_cols", "quantize_weight",
    "quantize_rows_ref", "quantize_cols_ref", "quantize_weight_ref",
    "dequantize_rows", "dequantize_cols", "dequantize_weight",
]
