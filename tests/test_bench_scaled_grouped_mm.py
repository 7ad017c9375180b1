"""bench/_scaled_grouped_mm.py, the rowwise-FP8 anchor's layout (tier T0, CPU): expert groups padded
to 16 rows (torch's grouped GEMMs reject an e4m3 group whose jagged extent is not a multiple of 16
bytes) without changing the layer it computes. The FP8 GEMMs themselves need an sm_90 GPU; here an
fp64 grouped GEMM over the same offsets stands in for them, so what is checked is the padding, the
gather and the scatter back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _scaled_grouped_mm as sgm  # noqa: E402
from tlx_dist.fused.reference import fused_experts_ref  # noqa: E402


def _routings(T, E, K, g):
    yield "random", torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    yield "all_to_one", torch.stack([torch.arange(K) for _ in range(T)])  # experts K..E-1 get nothing
    yield "single_token", torch.randperm(E, generator=g)[:K][None]


@pytest.mark.parametrize("T,E,K", [(37, 8, 2), (16, 4, 4), (1, 6, 3)])
def test_padded_layout_aligns_every_group(T, E, K):
    g = torch.Generator().manual_seed(T * E + K)
    for name, idx in _routings(T, E, K, g):
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        pos, offs, Np = sgm._padded_layout(flat, E, order)
        counts = torch.bincount(flat, minlength=E)
        assert offs.dtype == torch.int32 and Np % sgm.ALIGN == 0, name
        starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
        assert bool(((offs.long() - starts) % sgm.ALIGN == 0).all()), name
        assert bool((offs.long() - starts >= counts).all()) and int(offs[-1]) <= Np, name
        assert pos.unique().numel() == flat.numel(), f"{name}: two rows share a padded slot"
        e_sorted = flat[order]
        assert bool(((pos >= starts[e_sorted]) & (pos < starts[e_sorted] + counts[e_sorted])).all()), name


class _Fp64GroupedMM(torch.autograd.Function):
    """Stand-in for the FP8 GEMMs: ``y[rows e] = x[rows e] @ w[e]`` in fp64 over the offsets, rows
    past the last offset left zero (as torch's kernel never writes them)."""

    @staticmethod
    def apply(x, w, offs, _fast):
        out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
        for e, end in enumerate(offs.tolist()):
            out = out.index_add(0, torch.arange(start, end), x[start:end] @ w[e])
            start = end
        return out


def test_padded_layer_equals_the_unpadded_layer(monkeypatch):
    monkeypatch.setattr(sgm, "_RowwiseGroupedMM", _Fp64GroupedMM)
    T, D, Fe, E, K = 29, 12, 10, 6, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, dtype=torch.float64, generator=g, requires_grad=True)
    w13 = torch.randn(E, D, 2 * Fe, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(E, Fe, D, dtype=torch.float64, generator=g, requires_grad=True)
    for name, idx in _routings(T, E, K, g):
        T_ = idx.shape[0]
        xs = x[:T_]
        gate = torch.rand(T_, K, dtype=torch.float64, generator=g)
        y = sgm.scaled_grouped_mm_experts(xs, idx, gate, w13, w2)
        ref = fused_experts_ref(xs, idx, gate, w13, w2)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12, msg=name)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, w13, w2), dy)
        want = torch.autograd.grad(ref, (x, w13, w2), dy)
        for a, b, n in zip(got, want, ("x", "w13", "w2")):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name}: grad {n}")
