"""The single-rank combine (tlx_dist/comm/local_combine.py, LocalDispatcher.combine_weighted /
dispatch_backward) on CPU: the default CPU run keeps the torch composition bit for bit, the ops'
torch references against the composition and float64 (tests/local_combine_cases.py), custom-op
checks, torch.compile(fullgraph=True), bad inputs; the Triton kernels under the interpreter in a
child process (tests/local_combine_interpreted_cases.py)."""

from __future__ import annotations

import pytest
import torch

from _interp import run_interpreted_suite
from local_combine_cases import CASE_IDS, CASES, check_combine, check_dispatch_backward, make_case
from tlx_dist.comm import LocalDispatcher
from tlx_dist.comm import local_combine as LC
from tlx_dist.comm.dispatcher import Dispatcher


def test_cpu_default_keeps_the_torch_composition():
    # no interpreter: no kernels, and every output (gradients included) is the base class's
    disp, h, y, gate, g = make_case(37, 4, 8, 300, "random", "signed", torch.bfloat16, seed=1)
    assert not LC.use_combine_kernels(y, gate)
    outs = []
    for fn in (disp.combine_weighted, lambda *a: Dispatcher.combine_weighted(disp, *a)):
        y_ = y.clone().requires_grad_(True)
        w_ = gate.clone().requires_grad_(True)
        out = fn(y_, h, w_)
        outs.append((out, *torch.autograd.grad(out, [y_, w_], g)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(disp.dispatch_backward(y, h), Dispatcher.dispatch_backward(disp, y, h))


def _ref_combine(y, h, w):
    return LC.combine_weighted_local(y, w, h.order_S, h.inverse_S)  # CPU: the ops' torch references


@pytest.mark.parametrize("T,K,E,D,routing,values,why", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_references(T, K, E, D, routing, values, why, dtype):
    disp, h, y, gate, g = make_case(T, K, E, D, routing, values, dtype, seed=T + K + D)
    check_combine(_ref_combine, disp, h, y, gate, g, what=why)
    g_N = (y.double() / K).to(dtype) if values == "huge" else y  # the ungated k-sum stays finite
    check_dispatch_backward(lambda g_, h_: LC.dispatch_backward_local(g_, h_.inverse_S, T, K), disp, h, g_N)
    # the forward reference is the composition's own arithmetic: bit for bit at any K
    assert torch.equal(LC.combine_weighted_ref(y, gate, h.inverse_S), Dispatcher.combine_weighted(disp, y, h, gate))


def test_opcheck_and_compile():
    disp, h, y, gate, g = make_case(13, 3, 4, 40, "random", "signed", torch.bfloat16, seed=2)
    ops = torch.ops.tlx_dist
    torch.library.opcheck(ops.local_combine_weighted, (y.clone().requires_grad_(True),
                                                       gate.clone().requires_grad_(True), h.order_S, h.inverse_S))
    torch.library.opcheck(ops.local_combine_weighted_backward, (g, y, gate, h.order_S))
    torch.library.opcheck(ops.local_gather_ksum, (y, h.inverse_S, 13, 3))

    def f(y_, w_):
        return LC.combine_weighted_local(y_, w_, h.order_S, h.inverse_S)

    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        y_ = y.clone().requires_grad_(True)
        w_ = gate.clone().requires_grad_(True)
        out = fn(y_, w_)
        res.append((out, *torch.autograd.grad(out, [y_, w_], g)))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_bad_inputs():
    disp, h, y, gate, g = make_case(8, 2, 4, 16, "random", "normal", torch.bfloat16)
    with pytest.raises(ValueError, match=r"gate_TK must be a \[T=8, K=2\] tensor"):
        disp.combine_weighted(y, h, gate[:, :1])  # would broadcast over k in the composition
    with pytest.raises(ValueError, match="y_ND has 15 rows but the dispatch received N=16"):
        disp.combine_weighted(y[:15], h, gate)
    with pytest.raises(ValueError, match="g_ND has 15 rows but the dispatch received N=16"):
        disp.dispatch_backward(y[:15], h)
    with pytest.raises(ValueError, match="y_ND has 15 rows, expected N = T\\*K = 8\\*2"):
        LC.combine_weighted_local(y[:15], gate, h.order_S, h.inverse_S)
    with pytest.raises(ValueError, match="inverse_S must be"):
        LC.combine_weighted_local(y, gate, h.order_S, h.inverse_S.float())
    with pytest.raises(ValueError, match="gate_TK must be a 2-D tensor"):
        LC.combine_weighted_local(y, gate.flatten(), h.order_S, h.inverse_S)
    with pytest.raises(ValueError, match="order_S .* does not match inverse_S"):
        LC.combine_weighted_local(y, gate, h.order_S[:3], h.inverse_S)
    with pytest.raises(ValueError, match="g_ND must be a 2-D tensor"):
        LC.dispatch_backward_local(y.flatten(), h.inverse_S, 8, 2)


def test_kernels_interpreted():
    """The Triton kernels against the composition and float64 (local_combine_interpreted_cases.py)."""
    pytest.importorskip("triton")
    run_interpreted_suite("local_combine_interpreted_cases.py")
