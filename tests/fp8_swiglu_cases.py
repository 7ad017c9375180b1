"""Checks of the fused SwiGLU + FP8 row quantization (tlx_dist/fp8/swiglu.py) shared by the CPU tests
(tests/test_fp8_swiglu.py), the interpreted kernels (tests/fp8_swiglu_interpreted_cases.py) and the
GPU tests (tests/test_fp8_swiglu_gpu.py). Not collected (no test_ prefix).

Bound of one output element against float64 on the same (rounded) inputs: the fp32 formula's own
error plus one rounding to the output dtype,

    |out - out64| <= ulp(out64) + 16 * 2**-24 * (1 + min(|g|, 88)) * mag

``ulp`` the output dtype's spacing at ``|out64|`` (its subnormal spacing below the smallest normal):
rounding the fp32 value, itself within far less than half a unit of ``out64``, lands on one of the
two neighbours of ``out64``. ``mag`` is the sum of the magnitudes the formula combines
(``|silu(g) up|`` for a, ``|dA up| sig (1 + |g| (1 - sig))`` for d gate, ``|dA silu(g)|`` for d up):
d gate cancels where ``1 + g (1 - sig(g)) = 0`` (g ~ -1.28), so its error is relative to the terms,
not the result. Each fp32 operation adds at most 2**-24 relative; 16 covers the formula's dozen and
an exp good to 2 ulps (the GPU's); ``1 + |g|`` the exp's argument rounding on the GPU (exp2 of
``g * log2(e)``), capped at 88 where exp(-g) over- or underflows and sigmoid is exactly 0 or 1.
(Gates in about (-104, -88), where exp(-g) overflows fp32 but silu(g) is still a bf16 normal, give
-0 in any fp32 evaluation -- torch's included -- and are outside this bound; the inputs here avoid
them.) The quantized form must equal ``quantize_rows_ref`` of the kernel's rounded output bit for bit.
"""

from __future__ import annotations

import torch

from tlx_dist.fp8 import quant as Q

U32 = 2.0 ** -24
# dtype -> (significand bits incl. the implicit one, exponent of the smallest normal)
_FMT = {torch.bfloat16: (8, -126), torch.float16: (11, -14), torch.float32: (24, -126)}


def ulp(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    p, emin = _FMT[dtype]
    _, e = torch.frexp(x64.abs())  # |x| = m 2**e, m in [0.5, 1): its binade starts at 2**(e - 1)
    e = torch.where(x64 == 0, torch.full_like(e, emin + 1), e)
    return torch.ldexp(torch.ones_like(x64), (e - 1).clamp_min(emin) - (p - 1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else t


def fwd64(h: torch.Tensor):
    """(a64, mag, g) in float64 from ``h`` ``[M, 2F]``."""
    F_ = h.shape[1] // 2
    g, u = h[:, :F_].double(), h[:, F_:].double()
    s = torch.nn.functional.silu(g)
    return s * u, (s * u).abs(), g


def bwd64(h: torch.Tensor, dA: torch.Tensor):
    """(dh64, mag, g repeated for both halves) in float64."""
    F_ = h.shape[1] // 2
    g, u, da = h[:, :F_].double(), h[:, F_:].double(), dA.double()
    sig = torch.sigmoid(g)
    dg = da * u * sig * (1 + g * (1 - sig))
    du = da * g * sig
    mag = torch.cat([(da * u).abs() * sig * (1 + g.abs() * (1 - sig)), du.abs()], 1)
    return torch.cat([dg, du], 1), mag, torch.cat([g, g], 1)


def assert_within_bound(out: torch.Tensor, out64: torch.Tensor, mag: torch.Tensor, g: torch.Tensor, what: str) -> None:
    assert out.shape == out64.shape, what
    bound = ulp(out64, out.dtype) + 16 * U32 * (1 + g.abs().clamp_max(88)) * mag
    err = (out.double() - out64).abs()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements out of bound, e.g. {out[bad][:4]} vs {out64[bad][:4]}"


def assert_rows_equal(got: Q.Fp8Rows, want: Q.Fp8Rows, what: str) -> None:
    assert got.q_MC.dtype == want.q_MC.dtype and got.q_MC.shape == want.q_MC.shape, what
    assert torch.equal(_bits(got.q_MC), _bits(want.q_MC)), f"{what}: fp8 codes differ"
    assert torch.equal(got.s_MCb, want.s_MCb), f"{what}: scales differ"
    assert got.s_MCb.t().is_contiguous(), f"{what}: scales must be stored [Cb, M]"


def check_swiglu_quant(fn, h: torch.Tensor, fmt: str = "e4m3fn", pow2: bool = False, what: str = "") -> None:
    """``fn(h, fmt, pow2) -> (a, Fp8Rows)`` against float64 and quantize_rows_ref of its a."""
    a, r = fn(h, fmt, pow2)
    assert a.dtype == h.dtype and a.is_contiguous() and a.shape == (h.shape[0], h.shape[1] // 2), what
    a64, mag, g = fwd64(h)
    assert_within_bound(a, a64, mag, g, f"{what} a")
    assert_rows_equal(r, Q.quantize_rows_ref(a, fmt, pow2), f"{what} a_fp8")


def check_swiglu_bwd_quant(fn, h: torch.Tensor, dA: torch.Tensor, fmt: str = "e4m3fn", pow2: bool = False,
                           what: str = "") -> None:
    """``fn(h, dA, fmt, pow2) -> (dh, Fp8Rows)`` against float64 and quantize_rows_ref of its dh."""
    dh, r = fn(h, dA, fmt, pow2)
    assert dh.dtype == h.dtype and dh.is_contiguous() and dh.shape == h.shape, what
    dh64, mag, g = bwd64(h, dA)
    assert_within_bound(dh, dh64, mag, g, f"{what} dh")
    assert_rows_equal(r, Q.quantize_rows_ref(dh, fmt, pow2), f"{what} dh_fp8")


def adversarial_h(M: int, F_: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """(h [M, 2F], dA [M, F]): random, plus a large value per row in a gate and an up column (their
    1 x 128 groups' scales are set by them; fp16 gets 200, bf16 1e4, so that products stay finite),
    an all-zero gate/up tile (a zero tile of a and of dh), rows of tiny values (1e-12: tiny scales;
    1e-20: outputs in the dtype's subnormal range), a zero dA row and a large dA value per row."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, 2 * F_, generator=g) * 3
    dA = torch.randn(M, F_, generator=g)
    big = 200.0 if dtype == torch.float16 else 1e4
    if F_ > 0 and M > 0:
        h[:, 3 % F_] = big
        h[:, F_ + 5 % F_] = -big
        h[::3, 7 % F_] = -big  # silu(-big) = -0: the saturated sigmoid
        dA[:, 11 % F_] = big
        if M > 4:
            h[1, :min(F_, 128)] = 0.0
            h[1, F_:F_ + min(F_, 128)] = 0.0
            h[2] *= 1e-12
            h[3] *= 1e-20
            dA[4] = 0.0
    return h.to(dtype).to(device), dA.to(dtype).to(device)


def previous_experts(x, w13, w2, dy, off, backend: str, x_fp8=None):
    """``[y, dx, dw13, dw2]`` of ``swiglu_experts_fp8(x, w13, w2, off)`` under the loss ``sum(y * dy)``,
    composed from the single-purpose quantizers (every tensor quantized once per form it is read
    in): the oracle the experts' fused quantizations must equal bit for bit. ``x_fp8``: x's rows as
    an FP8 dispatch delivers them (the gate/up GEMM reads them; dW13 still quantizes ``x``)."""
    from tlx_dist import fp8
    from tlx_dist.fp8 import swiglu as S

    qb = "reference" if backend == "reference" else None
    q13, q2 = fp8.quantize_weight(w13, backend=qb), fp8.quantize_weight(w2, backend=qb)

    def mm(rows, b_q, b_s):
        return fp8.mm_fp8(rows, b_q, b_s, off, out_dtype=x.dtype, backend=backend)

    def wgrad(u, v, w):
        return fp8.wgrad_fp8(Q.quantize_cols(u, off, backend=qb), Q.quantize_cols(v, off, backend=qb),
                             out_dtype=w.dtype, backend=backend)

    h = mm(Q.quantize_rows(x, backend=qb) if x_fp8 is None else x_fp8, q13.q_EFD, q13.s_EFbDb)
    a, a_fp8 = S.swiglu_quant(h, backend=qb)
    y = mm(a_fp8, q2.q_EFD, q2.s_EFbDb)
    dA = mm(Q.quantize_rows(dy, backend=qb), q2.q_EDF, q2.s_EDbFb)
    dh, dh_fp8 = S.swiglu_bwd_quant(h, dA, backend=qb)
    return [y, mm(dh_fp8, q13.q_EDF, q13.s_EDbFb), wgrad(x, dh, w13), wgrad(a, dy, w2)]


def fused_experts(x, w13, w2, dy, off, backend: str):
    """``[y, dx, dw13, dw2]`` of ``swiglu_experts_fp8`` through autograd under the loss ``sum(y * dy)``."""
    from tlx_dist import fp8

    ts = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2)]
    y = fp8.swiglu_experts_fp8(*ts, off, backend=backend)
    if not y.numel():
        return [y.detach()] + [torch.zeros_like(t) for t in ts]
    return [y.detach()] + list(torch.autograd.grad((y * dy).sum(), ts))


def assert_experts_equal(got, want, what: str) -> None:
    for n, o, t in zip(("y", "dx", "dw13", "dw2"), got, want):
        assert o.dtype == t.dtype and o.shape == t.shape, f"{what}: {n} {o.dtype} {tuple(o.shape)}"
        assert torch.equal(o, t), f"{what}: {n} differs in {int((o != t).sum())} elements"
