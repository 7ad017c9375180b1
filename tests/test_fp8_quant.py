"""FP8 block quantization (tlx_dist/fp8/quant.py): the references' semantics on CPU, the Triton
kernels against them bit for bit under TRITON_INTERPRET=1 (child process), bad-input errors.

Error bound of one e4m3 value: round-to-nearest-even to 3 mantissa bits is off by at most 2**-4
of the value (normal range) or half the subnormal step, 2**-10 (e4m3fn; 2**-11 for fnuz) times
the group's scale. Every dequantized element must meet ``|x - q*s| <= max(2**-4 |x|, 2**-10 s)``.
"""

import math

import pytest
import torch

from tlx_dist.fp8 import quant as Q

from _interp import run_interpreted_suite

SUB_HALF = {"e4m3fn": 2.0 ** -10, "e4m3fnuz": 2.0 ** -11}


def _assert_elementwise_bound(x: torch.Tensor, xhat: torch.Tensor, scale_full: torch.Tensor, fmt: str) -> None:
    x64, xh = x.double(), xhat.double()
    bound = torch.maximum(x64.abs() * 2.0 ** -4, scale_full.double() * SUB_HALF[fmt]) * (1 + 1e-6)
    assert torch.isfinite(xh).all()
    bad = (x64 - xh).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by more than half an e4m3 step, e.g. {x64[bad][:4]} -> {xh[bad][:4]}"


def _row_scales_full(r: Q.Fp8Rows) -> torch.Tensor:
    return r.s_MCb.repeat_interleave(Q.GROUP, dim=1)[:, :r.q_MC.shape[1]]


def _adversarial_rows(M: int, C: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(M * 31 + C)
    x = torch.randn(M, C, generator=g) * 2
    x[:, 3 % C] = 1e4  # an outlier in every row: its tile's other values go subnormal or to zero
    if M > 2:
        x[1, :min(C, 128)] = 0.0  # an all-zero tile
        x[2] = 1e-30 * torch.randn(C, generator=g)  # tiny values: tiny scales, still finite
    return x.bfloat16()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("M,C", [(64, 256), (37, 200), (5, 40), (1, 129)],
                         ids=["aligned", "C_partial_tile", "C_below_tile", "one_row_C_129"])
def test_rows_ref_bound_and_scales(fmt, pow2, M, C):
    x = _adversarial_rows(M, C)
    r = Q.quantize_rows_ref(x, fmt, pow2)
    assert r.q_MC.shape == (M, C) and r.q_MC.dtype == Q.FORMATS[fmt][0]
    assert r.s_MCb.shape == (M, -(-C // 128)) and r.s_MCb.t().is_contiguous()  # stored [Cb, M]
    _assert_elementwise_bound(x.float(), Q.dequantize_rows(r, torch.float64), _row_scales_full(r), fmt)
    top = Q.FORMATS[fmt][1]
    xf = torch.nn.functional.pad(x.float(), (0, -C % 128)).view(M, -1, 128)
    amax = xf.abs().amax(-1)
    s = r.s_MCb
    assert (s > 0).all() and torch.isfinite(s).all()
    assert (amax <= s * top * (1 + 1e-6)).all(), "a value exceeds the format's range after scaling"
    if pow2:
        m, _ = torch.frexp(s)
        assert (m == 0.5).all(), "pow2 scales must be powers of two"
        assert (amax > s * top / 2).logical_or(amax <= Q.AMAX_FLOOR).all(), "pow2 scale is not the smallest one"
    else:
        # a group's largest value lands on the format's largest value (groups well above the floor)
        big = amax > 1e-6
        qmax = torch.nn.functional.pad(r.q_MC.float(), (0, -C % 128)).view(M, -1, 128).abs().amax(-1)
        assert torch.all(qmax[big] == top)


def test_rows_all_zero_and_negative_zero():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    x[1] = -0.0
    r = Q.quantize_rows_ref(x)
    assert torch.isfinite(r.s_MCb).all() and (r.s_MCb > 0).all()
    assert (r.q_MC.float() == 0).all() and not torch.isnan(Q.dequantize_rows(r)).any()


def _tile_rows(counts, M):
    """(expert, first row, count) per expert and the padding rows past the last offset."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    return [(e, (ends[e - 1] if e else 0), c) for e, c in enumerate(counts)], M - (ends[-1] if ends else 0)


# (counts, M, C, why)
COL_CASES = [
    ([300, 0, 129, 1], 430, 200, "zero-token expert; expert of 1 row; 129 rows = a full tile + 1; C partial tile"),
    ([50], 50, 64, "one expert takes all and T < 128"),
    ([0, 0, 0], 7, 128, "every expert empty: 7 padding rows, nothing quantized"),
    ([128, 128], 300, 136, "tile-aligned experts and 44 padding rows past the last offset"),
]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("counts,M,C,why", COL_CASES, ids=[c[3] for c in COL_CASES])
def test_cols_ref_layout_and_bound(counts, M, C, why, pow2):
    x = _adversarial_rows(M, C)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    c = Q.quantize_cols_ref(x, off, "e4m3fn", pow2)
    E = len(counts)
    T = M // 128 + E + 1
    assert c.q_CP.shape == (C, 128 * T) and c.s_TC.shape == (T, C)
    assert c.tile_cum_E1.tolist() == torch.tensor([-(-n // 128) for n in counts] + [-(-(M - sum(counts)) // 128)]
                                                  ).cumsum(0).tolist()
    xhat = Q.dequantize_cols(c, torch.float64)
    rows, pad = _tile_rows(counts, M)
    first = [0] + c.tile_cum_E1.tolist()[:-1]
    full = torch.zeros(M, C, dtype=torch.float64)
    for e, lo, n in rows:
        for j in range(-(-n // 128)):
            r0, r1 = lo + 128 * j, lo + min(n, 128 * (j + 1))
            full[r0:r1] = c.s_TC[first[e] + j].double()
            # the tile's columns past the expert's last row are zeros (another expert's k-step never sees them)
            tail = c.q_CP[:, 128 * (first[e] + j) + (r1 - r0):128 * (first[e] + j + 1)]
            assert (tail.float() == 0).all()
            # the tile's scale is over exactly its rows
            amax = x[r0:r1].float().abs().amax(0)
            assert (amax <= c.s_TC[first[e] + j] * 448 * (1 + 1e-6)).all()
    n_valid = sum(counts)
    _assert_elementwise_bound(x.float()[:n_valid], xhat[:n_valid], full[:n_valid], "e4m3fn")
    assert (xhat[n_valid:] == 0).all(), "padding rows belong to no expert"


def test_weight_ref_layouts_and_bound():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3, 200, 136, generator=g) * 0.02).bfloat16()
    w[1, :128, :128] = 0  # an all-zero block
    w[2, 5, 7] = 50.0  # an outlier block
    q = Q.quantize_weight_ref(w)
    E, D, F = w.shape
    assert q.q_EDF.shape == (E, D, F) and q.q_EFD.shape == (E, F, D)
    assert q.s_EDbFb.shape == (E, 2, 2) and torch.equal(q.s_EFbDb, q.s_EDbFb.transpose(1, 2))
    assert torch.equal(q.q_EFD.view(torch.uint8), q.q_EDF.transpose(1, 2).contiguous().view(torch.uint8))
    assert q.q_EDF.is_contiguous() and q.q_EFD.is_contiguous()
    s_full = q.s_EDbFb.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :D, :F]
    _assert_elementwise_bound(w.float(), Q.dequantize_weight(q, torch.float64), s_full, "e4m3fn")
    assert (q.q_EDF[1, :128, :128].float() == 0).all() and torch.isfinite(q.s_EDbFb).all()


@pytest.mark.parametrize("pow2", [False, True])
def test_scale_formula(pow2):
    amax = torch.tensor([0.0, 1e-30, 1.0, 448.0, 3.0e4, 1e-12, 2.0 ** -20])
    s, inv = Q._scales_ref(amax, "e4m3fn", pow2)
    a = amax.clamp_min(Q.AMAX_FLOOR).double()
    if pow2:
        want = torch.tensor([2.0 ** math.ceil(math.log2(float(v) / 448)) for v in a], dtype=torch.float64)
        assert torch.equal(s.double(), want) and torch.equal((s * inv).double(), torch.ones(7, dtype=torch.float64))
    else:
        assert torch.allclose(s.double(), a / 448, rtol=1e-7, atol=0)
    assert torch.isfinite(inv).all()


def test_bad_inputs():
    x = torch.randn(4, 128)
    with pytest.raises(TypeError, match="x_MC"):
        Q.quantize_rows(x.double())
    with pytest.raises(ValueError, match="x_MC must be 2-D"):
        Q.quantize_rows(x[None])
    with pytest.raises(ValueError, match="fmt="):
        Q.quantize_rows(x, fmt="e5m2")
    with pytest.raises(ValueError, match="offsets_E"):
        Q.quantize_cols(x, torch.tensor([4.0]))
    with pytest.raises(ValueError, match="E=0"):
        Q.quantize_cols(x, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="w_EDF must be 3-D"):
        Q.quantize_weight(x)
    with pytest.raises(ValueError, match="backend="):
        Q.quantize_rows(x, backend="cuda")
    with pytest.raises(ValueError, match="backend='triton' needs"):
        if not Q.interpret_mode():
            Q.quantize_rows(x, backend="triton")
        else:
            raise ValueError("backend='triton' needs (interpreted run: the check does not apply)")


@pytest.mark.slow
def test_kernels_match_references_interpreted():
    """The three Triton kernels == their references, bit for bit (fp8_quant_interpreted_cases.py)."""
    pytest.importorskip("triton")
    run_interpreted_suite("fp8_quant_interpreted_cases.py")
