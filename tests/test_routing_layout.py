"""Runs tests/routing_interpreted_cases.py (the one-launch expert-major layout under the Triton
interpreter) in a TRITON_INTERPRET=1 child, and checks on CPU that the fused passes take the
precomputed scheduler tables instead of launching the prep and order kernels."""

from __future__ import annotations

import os

import pytest
import torch
from _interp import run_interpreted_suite

from tlx_dist.fused.backends import Primitives

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted: pytest collects it directly")
def test_routing_layout_interpreted():
    run_interpreted_suite("routing_interpreted_cases.py", timeout=300)


class _Prims(Primitives):
    """Primitives that record what the composition asks for (no kernels; the default config)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def tile_cum(self, offsets_E, n_rows, x):
        self.calls.append("tile_cum")
        return torch.full((offsets_E.shape[0] + 1,), -1, dtype=torch.int32)

    def wgrad_order(self, offsets_E):
        self.calls.append("wgrad_order")
        return torch.full((offsets_E.shape[0],), -1, dtype=torch.int32)

    def gate_up_swiglu(self, x, src, w13, offsets, tile_cum):
        self.seen_fwd = tile_cum
        return torch.zeros(src.shape[0], w13.shape[2]), torch.zeros(src.shape[0], w13.shape[2] // 2)

    def down_scatter(self, a, w, offsets, dst, scale, num_dst, tile_cum):
        self.seen_scatter = tile_cum
        return torch.zeros(num_dst, w.shape[2])

    def down_dswiglu(self, dout, dst, w2, offsets, h, gate, tile_cum):
        self.seen_bwd = tile_cum
        return torch.zeros_like(h), torch.zeros(h.shape[0], h.shape[1] // 2), torch.zeros(h.shape[0])

    def wgrad_gather(self, a, ia, b, ib, offsets, order):
        self.seen_order = order
        return torch.zeros(offsets.shape[0], a.shape[1], b.shape[1])


@pytest.mark.parametrize("given", [False, True])
def test_composition_uses_the_precomputed_schedule(given):
    from tlx_dist.fused.backends import compose_backward, compose_forward

    E, N, D, F, T = 3, 6, 4, 2, 2
    x, w13, w2 = torch.zeros(T, D), torch.zeros(E, D, 2 * F), torch.zeros(E, F, D)
    src = torch.zeros(N, dtype=torch.int32)
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    sched = torch.arange(8 + E, dtype=torch.int32) if given else None  # order from sched_order_offset(3) = 4
    p = _Prims()
    _, h = compose_forward(p, x, src, src, torch.ones(N), w13, w2, offs, T, sched=sched)
    compose_backward(p, torch.zeros(T, D), x, src, src, torch.ones(N), w13, w2, offs, h, sched=sched)
    if given:
        assert p.calls == []  # neither the prep kernel nor the order kernel
        for t in (p.seen_fwd, p.seen_scatter, p.seen_bwd):
            assert t.tolist() == [0, 1, 2, 3]
        assert p.seen_order.tolist() == [4, 5, 6]  # sched[4:7]
    else:
        assert p.calls == ["tile_cum", "tile_cum", "wgrad_order"]
        assert p.seen_fwd.tolist() == [-1] * 4 and p.seen_order.tolist() == [-1] * 3


def test_routing_kernel_switch(monkeypatch):
    """The layout kernel runs where it can (CUDA; CPU only interpreted) unless the config turns it off
    (``FusedConfig.layout_kernel``)."""
    import types

    from tlx_dist.fused import api

    cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    for interp, wanted, want_cuda, want_cpu in (("0", True, True, False), ("1", True, False, True),
                                                ("0", False, False, False), ("1", False, False, False)):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        assert api._routing_kernel_runs(cuda, wanted) is want_cuda, (interp, wanted)
        assert api._routing_kernel_runs(cpu, wanted) is want_cpu, (interp, wanted)
