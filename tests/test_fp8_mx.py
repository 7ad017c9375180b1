"""MXFP8 operands of the Blackwell kernel (tlx_dist/fp8/mx.py) on CPU: the block-scaling byte order,
dequantization round trips within e4m3's error, the layouts by expert-aligned tile.

Bound per element (power-of-two scale s per 1 x 32 group): ``|x - q*s| <= max(2**-4 |x|, 2**-10 s)``.
"""

import torch

from tlx_dist.fp8 import mx


def test_swizzle_is_the_block_scaling_order():
    s = torch.arange(512, dtype=torch.int32).view(128, 4)
    z = mx.swizzle_128x4(s)
    for r, j in [(0, 0), (1, 2), (31, 3), (32, 0), (77, 1), (127, 3)]:
        assert int(z[(r % 32) * 16 + (r // 32) * 4 + j]) == int(s[r, j])
    assert torch.equal(mx.unswizzle_128x4(z), s)


def _bound_ok(x, xhat, s_full):
    bound = torch.maximum(x.double().abs() * 2.0 ** -4, s_full * 2.0 ** -10) * (1 + 1e-6)
    return bool(((x.double() - xhat).abs() <= bound).all())


def test_rows_round_trip_by_expert_tile():
    g = torch.Generator().manual_seed(0)
    counts, M, C = [150, 0, 61, 1], 230, 192
    x = (torch.randn(M, C, generator=g) * 3)
    x[:, 5] = 1e4
    x[1, :64] = 0
    x = x.bfloat16()
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    q, sa = mx.mx_quantize_rows_ref(x, off)
    assert sa.shape == (M // 128 + 4 + 1, 2, 512)
    xhat = mx.mx_dequantize_rows(q, sa, off)
    n = sum(counts)
    # the scale of each 32-group is the pow2 rule's: recompute it from the values
    xg = torch.nn.functional.pad(x[:n].float(), (0, 256 - C)).view(n, -1, 32)
    s = mx._scales_ref(xg.abs().amax(-1), "e4m3fn", True)[0].double().repeat_interleave(32, 1)[:, :C]
    assert _bound_ok(x[:n].float(), xhat[:n], s)
    assert (xhat[n:] == 0).all()
    # expert 2 (rows 150..210) starts a new tile: tile_cum = [2, 2, 3, 4, ...] -> its scales at tile 2
    e8 = mx.unswizzle_128x4(sa[2, 0])  # [128, 4]: rows 150 + r, k-groups 0..3
    want = (s[150:211, :128:32].float().view(torch.int32) >> 23) & 0xFF
    assert torch.equal(e8[:61].to(torch.int32), want)


def test_weight_and_cols_shapes_and_round_trip():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2, 256, 136, generator=g) * 0.05).bfloat16()
    (qf, sf), (qd, sd) = mx.mx_quantize_weight_ref(w)
    assert qf.shape == (2, 136, 256) and sf.shape == (2, 2, 2, 512)
    assert qd.shape == (2, 256, 136) and sd.shape == (2, 2, 2, 512)
    e8 = mx.unswizzle_128x4(sf[1, 0, 1])  # expert 1, f rows 0..127, d 128..255
    s = mx.e8m0_to_float(e8).double().repeat_interleave(32, 1)  # [128, 128]
    assert _bound_ok(w[1, 128:256, :128].t().float(), qf[1, :128, 128:256].double() * s, s)
    x = torch.randn(200, 64, generator=g).bfloat16()
    off = torch.tensor([130, 200], dtype=torch.int32)
    q, sc = mx.mx_quantize_cols_ref(x, off)
    assert q.shape == (64, 128 * (200 // 128 + 3)) and sc.shape == (1, 200 // 128 + 3, 512)
    e8 = mx.unswizzle_128x4(sc[0, 2])  # expert 1's first token tile (rows 130..199), 64 features
    s = mx.e8m0_to_float(e8[:64]).double().repeat_interleave(32, 1)[:, :70]
    assert _bound_ok(x[130:200].t().float(), q[:, 256:326].double() * s, s)
    assert (q[:, 326:384].float() == 0).all(), "positions past the expert's rows are zero"
