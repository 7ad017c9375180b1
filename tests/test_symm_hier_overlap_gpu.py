"""The overlapped hierarchical dispatch on one GPU (tier T4): emulated worlds of N "nodes" of L
virtual ranks, the compiled exchange kernels and the default fused backend (TLX on Hopper), the
overlapped layer against the plain hierarchical one -- the same expert-major rows, layout and
per-leg counters exactly; the fused forward's partial rows within one bf16 rounding of the row's
scale (their fp32 atomic sums run in another order); the overlapped combine (the other nodes'
partial rows sent early) equal to the plain combine of the same partial rows, bit for bit -- and bench/hier_overlap.py's
paced mode end to end at a small shape (its output check included).

    pytest -m gpu tests/test_symm_hier_overlap_gpu.py -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]


def _within_a_rounding(a, b, what):
    """``|a - b| <= 2**-7 * max |b| of the row`` (one bf16 ulp at the row's scale)."""
    a, b = a.float(), b.float()
    scale = b.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert bool(torch.isfinite(a).all()), f"{what}: not finite"
    assert bool(((a - b).abs() <= 2.0 ** -7 * scale).all()), what


@pytest.mark.parametrize("W,L,kind", [(8, 4, "random"), (4, 2, "random"), (8, 4, "one_node"),
                                      (4, 2, "empty_node")])
def test_overlapped_hier_layer_on_gpu(W, L, kind):
    from symm_hier_interpreted_cases import HierWorld, _inputs

    from tlx_dist.fused import fused_experts_rows
    E, K, D, F = 4 * W, 4, 512, 256
    Ts = [200 + 31 * s for s in range(W)]
    Ts[1] = 0  # a rank with no tokens
    dev = torch.device("cuda")
    dt = torch.bfloat16
    xs, idxs, gates = _inputs(W, L, E, K, Ts, D, kind, dt)
    xs, idxs, gates = [x.to(dev) for x in xs], [i.to(dev) for i in idxs], [g.to(dev) for g in gates]
    gen = torch.Generator().manual_seed(1)
    w13 = (torch.randn(E, D, 2 * F, generator=gen) * D ** -0.5).to(dt).to(dev)
    w2 = (torch.randn(E, F, D, generator=gen) * F ** -0.5).to(dt).to(dev)
    e = E // W

    def layer(world, overlap):
        res = world.dispatch_rows(xs, idxs, gates, overlap=overlap)
        parts, rows = [], []
        for d, (recv, src, gate_N, h) in enumerate(res):
            assert (h.overlap is not None) == overlap, d
            parts.append(fused_experts_rows(recv, src, src, gate_N, w13[d * e:(d + 1) * e], w2[d * e:(d + 1) * e],
                                            h.offsets_e, recv.shape[0], overlap=h.overlap))
            n = int(h.offsets_e[-1])
            rows.append((recv[src[:n].long()].clone(), gate_N[:n].clone(), h.offsets_e.clone()))
        return res, parts, rows

    world = HierWorld(W, max(Ts), D, K, E, dt, L, device="cuda")
    res, parts_o, rows_o = layer(world, True)
    out_o = [o.clone() for o in world.combine_rows(parts_o, [r[3] for r in res])]
    torch.cuda.synchronize()
    world.check()
    legs_o = world.leg_counters()
    world.close()
    world = HierWorld(W, max(Ts), D, K, E, dt, L, device="cuda")
    res, parts_p, rows_p = layer(world, False)
    # the plain combine of the overlapped form's partial rows: the early send + the rest is that
    # combine (the relays and the sources sum in rank order), bit for bit
    out_p = world.combine_rows(parts_o, [r[3] for r in res])
    torch.cuda.synchronize()
    world.check()
    legs_p = world.leg_counters()
    world.close()
    for d in range(W):
        for a, b in zip(rows_p[d], rows_o[d]):
            assert torch.equal(a, b), f"{kind}: rank {d}'s expert-major rows, gates or layout"
        _within_a_rounding(parts_o[d], parts_p[d], f"{kind}: rank {d}'s partial rows")
        assert torch.equal(out_o[d], out_p[d]), f"{kind}: rank {d}'s combine"
    assert legs_o == legs_p, "per-leg counters"


@pytest.mark.parametrize("pace", ["timer", "host"])
def test_paced_bench_runs(pace):
    """bench/hier_overlap.py at a small shape, either pacing: the paced transfer, the serial and the
    overlapped forms run, the overlapped output passes the bench's own check (no NaN-poisoned row
    read)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import hier_overlap

    assert hier_overlap.main(["--tokens", "1024", "--dim", "1024", "--inter", "256", "--iters", "2",
                              "--nic-gbs", "50", "--pace", pace, "--no-results"]) == 0
