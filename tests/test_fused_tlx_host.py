"""The TLX fused launchers' host path on CPU (tier T2): every launch of one forward + backward, for
each GPU generation, with the kernels replaced by a recorder that binds the call to the real
kernel's signature.

The kernels themselves need a GPU (and are compiled in test_fused_compile.py /
test_fused_blackwell_compile.py); what this covers is the Python between ``fused_experts`` and the
launch -- descriptors, optional operands, tile configs and the config's row modes -- which no other
CPU test executes: a launcher that reads, say, ``h.shape`` for a form that passes no ``h`` fails
here rather than at the first fused launch on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import tlx

pytestmark = pytest.mark.skipif(not tlx.tlx_available(), reason="TLX (fbtriton) is not importable")

_LAUNCH_OPTS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}


class _Recorder:
    """Stands in for a JITFunction: ``rec[grid](*args, **kw)`` checks that the call binds to the
    kernel's parameters exactly (every parameter once, nothing unknown) and records it."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            names = list(self.fn.arg_names)
            assert len(args) <= len(names), f"{self.fn.__name__}: {len(args)} positional > {len(names)} params"
            bound = dict(zip(names, args))
            extra = {k: v for k, v in kw.items() if k not in _LAUNCH_OPTS}
            unknown = set(extra) - set(names)
            assert not unknown, f"{self.fn.__name__}: unknown arguments {sorted(unknown)}"
            twice = set(extra) & set(bound)
            assert not twice, f"{self.fn.__name__}: given twice {sorted(twice)}"
            bound.update(extra)
            missing = [n for n in names if n not in bound]
            assert not missing, f"{self.fn.__name__}: missing {missing}"
            assert isinstance(grid, tuple) and all(isinstance(g, int) and g >= 1 for g in grid), grid
            self.calls.append((self.fn.__name__, bound))

        return launch


def _prims(arch, monkeypatch, calls):
    from tlx_dist.fused import tlx_backend as tb

    cls = {"sm_90": tb._Hopper, "sm_100": tb._Blackwell}[arch]
    mm, wg = cls._mm_kernel(), cls._wgrad_kernel()
    monkeypatch.setattr(cls, "_mm_kernel", staticmethod(lambda: _Recorder(mm, calls)))
    monkeypatch.setattr(cls, "_wgrad_kernel", staticmethod(lambda: _Recorder(wg, calls)))
    monkeypatch.setattr(tb, "_grid", lambda device, bound: max(1, min(132, bound)))
    # the scheduler's prep kernels are Triton launches of their own (GPU-tested elsewhere): stand-ins
    counts = lambda off: torch.diff(off.long(), prepend=off.new_zeros(1).long())  # noqa: E731
    monkeypatch.setattr(cls, "tile_cum", staticmethod(
        lambda off, n, x=None: torch.cat([off.new_zeros(1), (-(-counts(off) // 128)).cumsum(0).to(off.dtype)])))
    monkeypatch.setattr(cls, "wgrad_order", staticmethod(
        lambda off: torch.argsort(counts(off), descending=True, stable=True).to(torch.int32)))
    return cls


def _operands(T=40, D=256, F=128, E=4, K=2, R=None):
    g = torch.Generator().manual_seed(0)
    R = T if R is None else R
    N = T * K
    x = torch.randn(R, D, generator=g).to(torch.bfloat16)
    e = torch.randint(0, E, (N,), generator=g)
    order = torch.argsort(e, stable=True)
    tok = (torch.arange(N) // K)[order].to(torch.int32)
    offsets = torch.bincount(e, minlength=E).cumsum(0).to(torch.int32)
    gate = torch.rand(N, generator=g)
    w13 = torch.randn(E, D, 2 * F, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, F, D, generator=g).to(torch.bfloat16)
    return x, tok, gate, w13, w2, offsets


def _grouped_wgrad_recorder(monkeypatch, calls):
    """The plain grouped dW (what dW2 / dW13 become when both operands are expert-major copies) is the
    grouped GEMM's TLX kernel, GPU-tested there: a stand-in that records the call."""
    import types

    from tlx_dist.grouped_gemm import backends as gb

    def wgrad(a, b, offsets, config=None, order=None, trusted=False):
        calls.append(("grouped_wgrad", dict(a=a, b=b, config=config, order=order, trusted=trusted)))
        return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])

    real = gb.get_backend
    monkeypatch.setattr(gb, "get_backend", lambda name: types.SimpleNamespace(wgrad=wgrad) if name == "tlx"
                        else real(name))


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("early_h", [True, False])
@pytest.mark.parametrize("rows", ["gather", "auto"])
def test_every_launch_binds_to_its_kernel(arch, early_h, rows, monkeypatch):
    """``rows``: the config's x_rows / dout_rows; ``auto`` at this F (128) copies dout's rows on
    Hopper (dSwiGLU reads them by TMA, dW2 is the plain grouped dW) and gathers x's; Blackwell
    gathers both. ``early_h``: the gathered dSwiGLU's default (EARLY_H on), or a pinned config
    without it (Hopper)."""
    import dataclasses

    from tlx_dist.fused import FusedConfig
    from tlx_dist.fused import tlx_backend as tb
    from tlx_dist.fused.backends import compose_backward, compose_forward
    from tlx_dist.fused.config import FORMS

    if not early_h and (arch != "sm_90" or rows != "gather"):
        pytest.skip("EARLY_H is an option of Hopper's gathered dSwiGLU form")
    config = FusedConfig(x_rows=rows, dout_rows=rows,
                         dswiglu=None if early_h else dataclasses.replace(FORMS["dswiglu"], EARLY_H=0))
    calls = []
    p = _prims(arch, monkeypatch, calls)(config)
    _grouped_wgrad_recorder(monkeypatch, calls)
    x, tok, gate, w13, w2, offsets = _operands()
    T, D = x.shape
    out, h = compose_forward(p, x, tok, tok, gate, w13, w2, offsets, T)
    assert out.shape == (T, D) and h.shape == (tok.shape[0], w13.shape[2])
    dout = torch.randn(T, D).to(torch.bfloat16)
    dx, dgate, dw13, dw2 = compose_backward(p, dout, x, tok, tok, gate, w13, w2, offsets, h)
    assert dx.shape == x.shape and dgate.shape == gate.shape and dw13.shape == w13.shape and dw2.shape == w2.shape
    mm = [c for n, c in calls if "wgrad" not in n]
    wg = [c for n, c in calls if "wgrad" in n and n != "grouped_wgrad"]
    assert len(mm) == 4, [n for n, _ in calls]
    assert [c["EPILOGUE"] for c in mm] == [tb.SWIGLU, tb.SCATTER, tb.DSWIGLU, tb.SCATTER]
    copied = rows == "auto" and arch == "sm_90"  # auto copies on Hopper only (where it was measured)
    assert [c["A_GATHER"] for c in mm] == [True, False, not copied, False]
    # dW2 first (its dout copy is freed before dW13's x copy is made), then dW13
    assert [(c["A_GATHER"], c["B_GATHER"]) for c in wg] == ([] if copied else [(False, True)]) + [(True, False)]
    grouped = [c for n, c in calls if n == "grouped_wgrad"]
    assert len(grouped) == copied and all(c["b"].shape == (tok.shape[0], D) for c in grouped)
    # the routing's int32 offsets and longest-first order are handed on (no clamp or order launch)
    assert all(c["trusted"] is True and c["order"] is not None and c["config"] is None for c in grouped)
    if copied:  # the copy form's own config: one epilogue warp group per consumer
        assert mm[2]["EPI_WG"] == FORMS["dswiglu_copy"].EPI_WG == 2 and mm[2]["PINGPONG"] is False
    if arch == "sm_90":
        # the consumers' early h loads: the dSwiGLU default, off when the pinned config says so
        assert [c["EARLY_H"] for c in mm] == [False, False, early_h, False]
        assert "PREFETCH_H" not in mm[2] and "h_desc" not in mm[2]


def test_pinned_tile_configs_reach_their_launches(monkeypatch):
    """A config's tile fields are what the launches get: the form's pinned config as it is (no
    GROUP_M width rule on top), the others the default; the grouped dW of the row copies gets
    ``wgrad_copy``."""
    import dataclasses

    from tlx_dist.fused import FusedConfig
    from tlx_dist.fused.backends import compose_backward, compose_forward
    from tlx_dist.fused.config import FORMS
    from tlx_dist.grouped_gemm import GroupedGemmConfig

    swiglu = dataclasses.replace(FORMS["swiglu"], STAGES=3, LAG=1)
    wgrad_b = dataclasses.replace(FORMS["wgrad_b"], STAGES=4, LAG=2)
    copy_dw = GroupedGemmConfig(128, 128, 64, 4)
    calls = []
    p = _prims("sm_90", monkeypatch, calls)(FusedConfig(swiglu=swiglu, wgrad_b=wgrad_b, dout_rows="gather",
                                                        x_rows="copy", wgrad_copy=copy_dw))
    _grouped_wgrad_recorder(monkeypatch, calls)
    x, tok, gate, w13, w2, offsets = _operands()
    out, h = compose_forward(p, x, tok, tok, gate, w13, w2, offsets, x.shape[0])
    compose_backward(p, torch.randn_like(out), x, tok, tok, gate, w13, w2, offsets, h)
    mm = [c for n, c in calls if "wgrad" not in n]
    assert (mm[0]["NUM_STAGES"], mm[0]["LAG"], mm[0]["CONSUMER_REGS"]) == (3, 1, swiglu.REGS)
    assert mm[1]["NUM_STAGES"] == FORMS["scatter"].STAGES  # not pinned: the default
    wg = [c for n, c in calls if "wgrad" in n and n != "grouped_wgrad"]
    assert [(c["B_GATHER"], c["NUM_STAGES"], c["LAG"]) for c in wg] == [(True, 4, 2)]  # dW2; dW13 from the x copy
    grouped = [c for n, c in calls if n == "grouped_wgrad"]
    assert len(grouped) == 1 and grouped[0]["config"] == copy_dw
