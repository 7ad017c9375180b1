"""Interpreter-only cases (run by tests/test_fp8_quant.py in a child with TRITON_INTERPRET=1): the
FP8 quantization kernels (tlx/common/fp8_quant.py, FP8 encoding emulated) == their torch
references (tlx_dist/fp8/quant.py), bit for bit, on random and adversarial inputs."""

import os

import pytest
import torch

from tlx_dist.fp8 import quant as Q

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else t


def _x(M, C, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, C, generator=g) * 3
    x[:, 3 % C] = 1e4  # outlier per row
    if M > 3:
        x[1, :min(C, 128)] = 0.0  # all-zero tile
        x[2] = 1e-30 * torch.randn(C, generator=g)  # tiny scales
        x[3, ::2] = -0.0
        x[3, 1::2] = torch.rand(len(range(1, C, 2)), generator=g) * 2.0 ** -12  # subnormal e4m3 after scaling
    return x.bfloat16()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("M,C", [(70, 300), (5, 64), (33, 128)])
def test_rows(fmt, pow2, M, C):
    x = _x(M, C, M + C)
    a, b = Q.quantize_rows(x, fmt=fmt, pow2=pow2, backend="triton"), Q.quantize_rows_ref(x, fmt, pow2)
    assert torch.equal(_bits(a.q_MC), _bits(b.q_MC)) and torch.equal(a.s_MCb, b.s_MCb)
    assert a.s_MCb.t().is_contiguous()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("counts,M,C", [([150, 0, 61, 1], 230, 96), ([40], 40, 72), ([0, 0], 9, 64),
                                        ([128, 3], 140, 130)])
def test_cols(fmt, counts, M, C):
    x = _x(M, C, sum(counts) + C)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    a, b = Q.quantize_cols(x, off, fmt=fmt, backend="triton"), Q.quantize_cols_ref(x, off, fmt)
    T = int(b.tile_cum_E1[-2])  # tiles of the experts; the slack past them is unwritten
    assert torch.equal(a.tile_cum_E1, b.tile_cum_E1) and torch.equal(a.offsets_E, b.offsets_E)
    assert torch.equal(_bits(a.q_CP[:, :128 * T]), _bits(b.q_CP[:, :128 * T]))
    assert torch.equal(a.s_TC[:T], b.s_TC[:T])


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("pow2", [False, True])
def test_weight(fmt, pow2):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 200, 136, generator=g) * 0.05).bfloat16()
    w[1, :128, :128] = 0
    w[2, 0, 0] = 300.0
    a, b = Q.quantize_weight(w, fmt=fmt, pow2=pow2, backend="triton"), Q.quantize_weight_ref(w, fmt, pow2)
    for f in ("q_EFD", "s_EFbDb", "q_EDF", "s_EDbFb"):
        assert torch.equal(_bits(getattr(a, f)), _bits(getattr(b, f))), f
