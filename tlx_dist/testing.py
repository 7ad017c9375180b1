"""Tolerances and comparison helpers shared by the CPU and GPU test suites (STYLE.md 6).

The rule: ``max|ours - ref64| <= 2 * max|torch_same_dtype - ref64| + atol`` where ``ref64`` is the
float64 reference and ``torch_same_dtype`` is the plain-PyTorch computation in the dtype under test.
PyTorch's own error sets the scale; the factor 2 leaves room for a different (not worse) summation
order. ``atol`` is a floor, relative to the reference's magnitude, for the rare case where the
PyTorch computation happens to be exact.
"""

from __future__ import annotations

import math

from typing import Optional

import torch

__all__ = ["REL_ATOL", "assert_close_to_ref", "assert_close_ksum_bf16", "max_err", "memcheck_mismatch"]

# Relative floors, one per dtype: a few ulps of the dtype at the reference's scale. float64 is only
# ever compared with the float64 reference, so its floor is the accumulated rounding of sums of a
# few hundred terms (~1e3 ulps).
REL_ATOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def assert_close_to_ref(ours: torch.Tensor, ref64: torch.Tensor, same_dtype: Optional[torch.Tensor] = None,
                        *, dtype: Optional[torch.dtype] = None, name: str = "tensor", factor: float = 2.0) -> None:
    """Asserts the STYLE.md 6 bound. Without ``same_dtype`` only the floor applies (use that for
    float64 against float64, where both sides should agree to rounding)."""
    if ours.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}")
    dtype = dtype or ours.dtype
    scale = float(ref64.detach().abs().max()) if ref64.numel() else 0.0
    atol = REL_ATOL[dtype] * max(scale, 1e-30)
    torch_err = max_err(same_dtype, ref64) if same_dtype is not None else 0.0
    bound = factor * torch_err + atol
    err = max_err(ours, ref64)
    if not torch.isfinite(torch.tensor(err)) or err > bound:
        raise AssertionError(
            f"{name}: max|ours-ref64|={err:.3e} exceeds {factor}*max|torch-ref64|={torch_err:.3e} + atol={atol:.3e}")


def assert_close_ksum_bf16(ref: torch.Tensor, ours: torch.Tensor) -> None:
    """For gradients that are each a K-term sum accumulated in fp32 and rounded once to bf16 on
    both sides (dispatch backward of the gather-based dispatchers and of the symm kernel): only the
    fp32 summation order differs, which can move a result by at most one bf16 ulp of its value,
    bounded here by the ulp of the largest magnitude: 2**(e - 8) for a max of m * 2**e, m in
    [0.5, 1) (bf16 keeps 8 significant bits; 0.5 for a max of 122, where 2**-8 * 122 = 0.48 would
    be less than one ulp)."""
    top = float(ref.detach().abs().max()) if ref.numel() else 0.0
    atol = math.ldexp(1.0, math.frexp(top)[1] - 8) if top > 0 else 0.0
    err = max_err(ours, ref)
    if err > atol:
        raise AssertionError(f"k-sum gradients differ by {err:.3e} > one bf16 ulp at the max ({atol:.3e})")


def memcheck_mismatch(got: torch.Tensor, ref: torch.Tensor) -> Optional[str]:
    """The memcheck scripts' check (``scripts/memcheck_*.py``): None when ``got`` is within a loose
    5% of ``ref``'s magnitude (+1e-3), else a message. They hunt memory errors -- NaN or garbage
    from a stray access fails it; the test suites hold the accuracy bounds."""
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    if not math.isfinite(err) or err > 0.05 * scale + 1e-3:
        return f"max error {err:.3g} (scale {scale:.3g})"
    return None
