"""Quantizing a tensor both ways in one pass (tlx_dist/fp8/quant.py ``quantize_both``, the SwiGLU
kernels over the expert tile grid in tlx_dist/fp8/swiglu.py) and the FP8 experts built on them, on
CPU: the references, the custom ops (opcheck, fake shapes), the experts' output and every gradient
equal bit for bit to the single-purpose quantizers' composition on the reference backend, bad
inputs; the Triton kernels under the interpreter in a child process
(tests/fp8_both_interpreted_cases.py)."""

from __future__ import annotations

import pytest
import torch

from _interp import run_interpreted_suite
from fp8_swiglu_cases import assert_experts_equal, fused_experts, previous_experts
from tlx_dist.fp8 import quant as Q


def _x(M, C, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g) * 3
    if M and C:
        x[:, 0] = 1e4
    return x.bfloat16()


def test_cpu_tensors_take_the_references():
    x = _x(230, 200)
    off = torch.tensor([150, 150, 211, 212])
    r, c = Q.quantize_both(x, off)
    rr, cr = Q.quantize_rows_ref(x), Q.quantize_cols_ref(x, off)
    assert torch.equal(r.q_MC.view(torch.uint8), rr.q_MC.view(torch.uint8)) and torch.equal(r.s_MCb, rr.s_MCb)
    assert torch.equal(c.q_CP.view(torch.uint8), cr.q_CP.view(torch.uint8)) and torch.equal(c.s_TC, cr.s_TC)
    assert torch.equal(c.tile_cum_E1, cr.tile_cum_E1) and torch.equal(c.offsets_E, cr.offsets_E)


def test_bad_inputs():
    x = _x(8, 128)
    with pytest.raises(ValueError, match="offsets_E must be a 1-D int32 / int64"):
        Q.quantize_both(x, torch.tensor([4.0]))
    with pytest.raises(ValueError, match="E=0"):
        Q.quantize_both(x, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(TypeError, match="x_MC must be bfloat16"):
        Q.quantize_both(x.double(), torch.tensor([8]))
    with pytest.raises(ValueError, match="x_MC must be 2-D"):
        Q.quantize_both(x[None], torch.tensor([8]))
    with pytest.raises(ValueError, match="fmt="):
        Q.quantize_both(x, torch.tensor([8]), fmt="e5m2")
    with pytest.raises(ValueError, match="backend="):
        Q.quantize_both(x, torch.tensor([8]), backend="cuda")


def test_custom_op_opcheck_and_fake_shapes():
    from tlx_dist.fp8.api import _quant_both_op, _quant_cols_op, _quant_rows_op

    x, off = _x(140, 200), torch.tensor([3, 131], dtype=torch.int32)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")  # test_schema cannot compare fp8 on CPU
    torch.library.opcheck(torch.ops.tlx_dist.fp8_quantize_both, (x, off, "reference"), test_utils=utils)
    both = _quant_both_op(x, off, "reference")
    want = _quant_rows_op(x, "reference") + _quant_cols_op(x, off, "reference")
    assert len(both) == len(want) == 6
    for b, w in zip(both, want):
        assert b.shape == w.shape and b.dtype == w.dtype and b.stride() == w.stride()
        assert torch.equal(b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)


def test_swiglu_custom_ops_opcheck():
    from fp8_swiglu_cases import adversarial_h

    h, dA = adversarial_h(140, 128, torch.bfloat16)
    off = torch.tensor([3, 131], dtype=torch.int64)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.tlx_dist.fp8_swiglu_quant_both, (h, off, "reference"), test_utils=utils)
    torch.library.opcheck(torch.ops.tlx_dist.fp8_swiglu_bwd_quant_both, (h, dA, off, "reference"), test_utils=utils)


def test_swiglu_both_bad_inputs():
    from tlx_dist.fp8 import swiglu as S

    h, dA = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets_E must be a 1-D int32 / int64"):
        S.swiglu_quant_both(h, torch.tensor([[8]]))
    with pytest.raises(ValueError, match="E=0"):
        S.swiglu_bwd_quant_both(h, dA, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"dA_MF must be \[M, F\]"):
        S.swiglu_bwd_quant_both(h, dA[:, :64], torch.tensor([8]))
    with pytest.raises(ValueError, match="odd width"):
        S.swiglu_quant_both(h[:, :255], torch.tensor([8]))


def test_experts_outside_autograd_match_and_skip_the_tiles(monkeypatch):
    # under no_grad the forward equals the recording one and makes no column form (the recording
    # one makes x's and a's)
    from tlx_dist import fp8
    from tlx_dist.fp8 import swiglu as S

    calls = []
    real = Q.quantize_cols_ref
    for mod in (Q, S):
        monkeypatch.setattr(mod, "quantize_cols_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w13, w2, dy, off = _experts_data([40, 0, 50, 7], 110, 256, 64)
    ts = [t.clone().requires_grad_(True) for t in (x, w13, w2)]
    y = fp8.swiglu_experts_fp8(*ts, off, backend="reference")
    assert len(calls) == 2
    calls.clear()
    with torch.no_grad():
        y0 = fp8.swiglu_experts_fp8(*ts, off, backend="reference")
    assert torch.equal(y0, y.detach()) and not calls


def _experts_data(counts, N, D, Fi, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(N, D, generator=g)
    if N > 2:
        x[:, 5 % D] = 1e4  # an outlier per row
        x[1, :128] = 0.0  # an all-zero tile
        x[2] *= 1e-20  # tiny scales
    w13 = torch.randn(E, D, 2 * Fi, generator=g) / D ** 0.5
    w2 = torch.randn(E, Fi, D, generator=g) / Fi ** 0.5
    dy = torch.randn(N, D, generator=g)
    off = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x.bfloat16(), w13.bfloat16(), w2.bfloat16(), dy.bfloat16(), off


# (counts, N, D, F, why)
EXPERT_CASES = [
    ([40, 0, 50, 7], 110, 256, 64, "zero-token expert, 13 padding rows, a 7-row expert"),
    ([0, 300, 0], 300, 128, 200, "one expert takes every row (3 tiles); F = 200"),
    ([130, 126], 270, 208, 128, "experts straddling the 128-row tiles; 14 padding rows; D = 208"),
    ([1], 1, 128, 48, "a single row"),
    ([0, 0], 0, 128, 64, "no rows at all"),
]


@pytest.mark.parametrize("counts,N,D,Fi,why", EXPERT_CASES, ids=[c[4].split(";")[0] for c in EXPERT_CASES])
def test_experts_equal_the_single_purpose_quantizers(counts, N, D, Fi, why):
    x, w13, w2, dy, off = _experts_data(counts, N, D, Fi)
    assert_experts_equal(fused_experts(x, w13, w2, dy, off, "reference"),
                         previous_experts(x, w13, w2, dy, off, "reference"), why)


def test_kernels_interpreted():
    """quantize_both, the tile-grid SwiGLU kernels and the experts on them, interpreted
    (fp8_both_interpreted_cases.py)."""
    pytest.importorskip("triton")
    run_interpreted_suite("fp8_both_interpreted_cases.py")
