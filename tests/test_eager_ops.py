"""Eager calls of the FP8 and single-rank combine custom ops run their bodies directly
(tlx_dist/grouped_gemm/eager.py); anything that traces gets the registered ops. CPU: the ops'
reference paths (their kernels, interpreted: tests/local_combine_interpreted_cases.py and
tests/fp8_both_interpreted_cases.py).

What is checked: (1) which path runs -- each op's direct call runs its body and not the op, in the
FP8 experts and the FP8 MoE layer too; FakeTensorMode, a dispatch mode, a function mode, make_fx,
jit.trace, vmap, a tensor subclass, torch.compile and an op without a formula called under autograd
take the op; (2) that the two paths agree bit for bit -- every op's outputs (and that none aliases
an input, as the op forbids), the experts', grouped_mm_fp8's, the combine's and the layer's
outputs, gradients and saved tensors, for each subset of inputs that requires grad;
torch.compile's result equals eager.
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from _util import make_cfg
from local_combine_cases import make_case
from tlx_dist import MoELayer, fp8
from tlx_dist.comm import local_combine as LC
from tlx_dist.fp8 import api as A
from tlx_dist.fp8 import swiglu as S
from tlx_dist.grouped_gemm import eager
from tlx_dist.grouped_gemm.eager import EagerCustomOp

NAMES = {"fp8_quantize_rows", "fp8_quantize_cols", "fp8_quantize_cols_from_rows", "fp8_quantize_both", "fp8_mm",
         "fp8_wgrad", "grouped_mm_fp8", "fp8_swiglu_quant", "fp8_swiglu_bwd_quant", "fp8_swiglu_quant_both",
         "fp8_swiglu_bwd_quant_both", "local_combine_weighted", "local_combine_weighted_backward", "local_gather_ksum"}


def _eager_ops() -> dict:
    return {v.name.split("::")[1]: v for m in (A, S, LC) for v in vars(m).values() if isinstance(v, EagerCustomOp)}


def _counting(counts, key, fn):
    def wrapped(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return wrapped


@pytest.fixture
def calls(monkeypatch):
    """Counts ``("op" | "body", name)``: the registered op's calls and the body's direct calls."""
    counts = collections.Counter()
    for name, e in _eager_ops().items():
        monkeypatch.setattr(e, "op", _counting(counts, ("op", name), e.op))
        monkeypatch.setattr(e, "body", _counting(counts, ("body", name), e.body))
    return counts


def _ran(counts, kind):
    return {name for (k, name), n in counts.items() if k == kind and n}


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    assert torch.equal(_bits(a), _bits(b)), what


# --- the ops one by one ------------------------------------------------------------------------------


def _data(counts=(20, 0, 12), N=40, D=128, F=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    x[:, 3] = 1e4  # an outlier per row: its group's scale is set by it
    w = torch.randn(len(counts), D, F, generator=g) / D ** 0.5
    dy = torch.randn(N, F, generator=g)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x.bfloat16(), w.bfloat16(), dy.bfloat16(), off


def _samples() -> dict:
    """Arguments of one call of every op (CPU, reference paths; 8 padding rows after the experts)."""
    x, w, dy, off = _data()
    a, wq = fp8.quantize_rows(x), fp8.quantize_weight(w)
    xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    h = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    dA = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    _, hd, y, gate, g = make_case(13, 3, 4, 40, "random", "signed", torch.bfloat16, seed=2)
    return {
        "fp8_quantize_rows": (x, "reference"),
        "fp8_quantize_cols": (x, off, "reference"),
        "fp8_quantize_cols_from_rows": (a.q_MC, a.s_MCb.t(), off, torch.bfloat16, "reference"),
        "fp8_quantize_both": (x, off, "reference"),
        "fp8_mm": (a.q_MC, a.s_MCb.t().contiguous(), wq.q_EFD, wq.s_EFbDb, off, torch.bfloat16, "reference"),
        "fp8_wgrad": (xc.q_CP, xc.s_TC, dyc.q_CP, dyc.s_TC, xc.tile_cum_E1, xc.offsets_E, 40, torch.float32,
                      "reference"),
        "grouped_mm_fp8": (x, w, wq.q_EFD, wq.s_EFbDb, wq.q_EDF, wq.s_EDbFb, off, "reference", "", a.q_MC,
                           a.s_MCb.t()),
        "fp8_swiglu_quant": (h, "reference"),
        "fp8_swiglu_bwd_quant": (h, dA, "reference"),
        "fp8_swiglu_quant_both": (h, off, "reference"),
        "fp8_swiglu_bwd_quant_both": (h, dA, off, "reference"),
        "local_combine_weighted": (y, gate, hd.order_S, hd.inverse_S),
        "local_combine_weighted_backward": (g, y, gate, hd.order_S),
        "local_gather_ksum": (y, hd.inverse_S, 13, 3),
    }


def _tensors(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def test_every_fp8_and_combine_op_is_eager():
    assert set(_eager_ops()) == NAMES
    for name, e in _eager_ops().items():
        assert getattr(torch.ops.tlx_dist, name).default._schema.name == f"tlx_dist::{name}"
        assert e.op._opoverload is getattr(torch.ops.tlx_dist, name).default  # the registered op, unchanged


@pytest.mark.parametrize("name", sorted(NAMES))
def test_direct_call_runs_the_body_and_equals_the_op(name, calls):
    args = _samples()[name]
    e = _eager_ops()[name]
    out = e(*args)
    assert calls[("body", name)] == 1 and calls[("op", name)] == 0
    want = e.op(*args)  # the registered op (counted as such)
    assert calls[("op", name)] == 1
    got, exp = _tensors(out), _tensors(want)
    assert len(got) == len(exp) > 0
    for i, (o, r) in enumerate(zip(got, exp)):
        _same(o, r, f"{name} output {i}")
    # mutates_args=(): the op rejects an output aliasing an input; the direct call must not return one
    inputs = {t.untyped_storage().data_ptr() for t in _tensors(args) if t.numel()}
    for i, o in enumerate(got):
        assert not o.numel() or o.untyped_storage().data_ptr() not in inputs, f"{name} output {i} aliases an input"


# --- which path runs ---------------------------------------------------------------------------------


def test_tracing_and_subclasses_take_the_op(calls):
    x, w, dy, off = _data()
    rows = A._quant_rows_op
    with FakeTensorMode() as mode:  # fake tensors: the fake implementation, through the op
        q, s = rows(mode.from_tensor(x), "reference")
    assert isinstance(q, FakeTensor) and q.shape == x.shape and s.shape == (1, 40)
    assert calls[("op", "fp8_quantize_rows")] == 1 and not _ran(calls, "body")

    class Recording(TorchDispatchMode):  # plain tensors under a dispatch mode: it must see the op
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recording() as rec:
        rows(x, "reference")
    assert "tlx_dist.fp8_quantize_rows.default" in rec.seen and not _ran(calls, "body")

    class Seeing(TorchFunctionMode):  # a function mode sees the op as one call, as before
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seeing() as fmode:
        rows(x, "reference")
    assert fmode.seen == ["tlx_dist.fp8_quantize_rows.default"] and not _ran(calls, "body")
    with torch.device("cpu"):  # a device context is a function mode too
        rows(x, "reference")
    assert not _ran(calls, "body")

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda t: rows(t, "reference"))(x)  # real tensors, the proxy mode on top
    assert "tlx_dist.fp8_quantize_rows.default" in [str(n.target) for n in gm.graph.nodes]
    assert not _ran(calls, "body")

    with warnings.catch_warnings():  # torch.jit.trace is deprecated, still a tracer
        warnings.simplefilter("ignore", DeprecationWarning)
        traced_fn = torch.jit.trace(lambda t: rows(t, "reference")[1], (x,), check_trace=False)
    assert "tlx_dist::fp8_quantize_rows" in str(traced_fn.graph) and not _ran(calls, "body")

    class Sub(torch.Tensor):
        pass

    q_sub, _ = rows(x.as_subclass(Sub), "reference")
    assert type(q_sub) is Sub and not _ran(calls, "body")
    ops_before = calls[("op", "fp8_quantize_rows")]
    batched = torch.vmap(lambda t: rows(t, "reference")[0])(x.view(2, 20, 128))  # wrapped tensors look plain
    assert calls[("op", "fp8_quantize_rows")] == ops_before + 1 and not _ran(calls, "body")
    assert torch.equal(_bits(batched[1]), _bits(fp8.quantize_rows(x[20:], backend="reference").q_MC))

    # an op without an autograd formula, called where autograd would record it: the op decides
    rows(x.clone().requires_grad_(True), "reference")
    assert calls[("op", "fp8_quantize_rows")] == ops_before + 2 and not _ran(calls, "body")
    with torch.no_grad():
        rows(x.clone().requires_grad_(True), "reference")
    assert _ran(calls, "body") == {"fp8_quantize_rows"}


def test_parameters_and_keyword_arguments_run_directly(calls):
    x, w, dy, off = _data()
    wq = fp8.quantize_weight(w)
    p = torch.nn.Parameter(w.clone())
    args = (x, p, wq.q_EFD, wq.s_EFbDb, wq.q_EDF, wq.s_EDbFb, off)
    y = A._grouped_mm_fp8_op(*args, backend="reference")  # the defaults after it filled in
    (dw,) = torch.autograd.grad(y.float().sum(), [p])
    assert not _ran(calls, "op")
    assert {"grouped_mm_fp8", "fp8_quantize_rows", "fp8_mm", "fp8_quantize_cols", "fp8_wgrad"} <= _ran(calls, "body")
    y_op = A._grouped_mm_fp8_op.op(*args, "reference")
    (dw_op,) = torch.autograd.grad(y_op.float().sum(), [p])
    _same(y, y_op, "y")
    _same(dw, dw_op, "dw")


def test_profiler_keeps_the_op_name(calls):
    x, *_ = _data()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        A._quant_rows_op(x, "reference")
    assert calls[("body", "fp8_quantize_rows")] == 1 and not _ran(calls, "op")
    assert "tlx_dist::fp8_quantize_rows" in {ev.key for ev in prof.key_averages()}


# --- the two paths agree ------------------------------------------------------------------------------


def _fwd_bwd(fn, inputs, dy, need, hooks=True, fresh=None):
    """``fn(*inputs)`` and the gradients of the inputs flagged in ``need``, with every tensor autograd
    saved on the way (``hooks``). Each input is a fresh leaf copy, except where ``fresh[i]`` is
    False (a layer's parameter: used as it is)."""
    leaves = [t.detach().clone().requires_grad_(n) if fresh is None or fresh[i] else t
              for i, (t, n) in enumerate(zip(inputs, need))]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t) if hooks \
            else contextlib.nullcontext():
        out = fn(*leaves)
    wrt = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(out, wrt, dy) if wrt else ()
    return out, grads, saved


def _compare(runs, what):
    (o1, g1, s1), (o2, g2, s2) = runs
    _same(o1.detach(), o2.detach(), f"{what}: out")
    assert len(g1) == len(g2), what
    for i, (a, b) in enumerate(zip(g1, g2)):
        _same(a, b, f"{what}: grad {i}")
    assert len(s1) == len(s2), f"{what}: {len(s1)} vs {len(s2)} saved tensors"
    for i, (a, b) in enumerate(zip(s1, s2)):
        _same(a, b, f"{what}: saved {i}")


NEEDS_2 = [(True, True), (True, False), (False, True), (False, False)]


def _both_paths(monkeypatch, run):
    """``run()`` on the direct path, then on the op path (every call treated as traced)."""
    direct = run()
    with monkeypatch.context() as m:
        m.setattr(eager, "traced", lambda args, kwargs: True)
        via_op = run()
    return direct, via_op


@pytest.mark.parametrize("need", NEEDS_2, ids=["x_w", "x", "w", "none"])
def test_grouped_mm_fp8_paths_agree(need, monkeypatch):
    x, w, dy, off = _data([30, 0, 2, 8], 48, 256, 96)
    wq = fp8.quantize_weight(w)

    def run():
        return _fwd_bwd(lambda x_, w_: fp8.grouped_mm_fp8(x_, w_, off, w_fp8=wq, backend="reference"), (x, w),
                        dy, need)

    _compare(_both_paths(monkeypatch, run), f"grouped_mm_fp8 need={need}")


@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, True, False),
                                  (False, False, True)], ids=["all", "x", "w13", "w2"])
@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16_rows", "fp8_rows"])
def test_experts_paths_agree(need, fp8_rows, monkeypatch):
    g = torch.Generator().manual_seed(3)
    counts, N, D, Fi = [40, 0, 50, 7], 110, 128, 64  # a zero-token expert, 13 padding rows
    x = torch.randn(N, D, generator=g).bfloat16()
    w13 = (torch.randn(4, D, 2 * Fi, generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(4, Fi, D, generator=g) / Fi ** 0.5).bfloat16()
    dy = torch.randn(N, D, generator=g).bfloat16()
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = fp8.quantize_rows(x) if fp8_rows else None

    def run():
        return _fwd_bwd(lambda *t: fp8.swiglu_experts_fp8(*t, off, backend="reference", x_fp8=rows), (x, w13, w2),
                        dy, need)

    _compare(_both_paths(monkeypatch, run), f"experts need={need}")


@pytest.mark.parametrize("need", NEEDS_2[:3], ids=["y_gate", "y", "gate"])
def test_combine_paths_agree(need, monkeypatch):
    _, h, y, gate, g = make_case(37, 4, 8, 300, "random", "signed", torch.bfloat16, seed=1)

    def run():
        return _fwd_bwd(lambda y_, w_: LC.combine_weighted_local(y_, w_, h.order_S, h.inverse_S), (y, gate), g, need)

    _compare(_both_paths(monkeypatch, run), f"combine need={need}")


def _layer():
    cfg = make_cfg(dim=256, moe_inter_dim=64, num_experts=4, top_k=2, init_std=0.05, dtype="bfloat16")
    torch.manual_seed(0)
    return MoELayer(cfg, precision="fp8")


def test_fp8_layer_eager_step_runs_no_op_and_the_paths_agree(calls, monkeypatch):
    cfg = make_cfg(dim=256, moe_inter_dim=64, num_experts=4, top_k=2, init_std=0.05, dtype="bfloat16")
    torch.manual_seed(0)
    layer = MoELayer(cfg, precision="fp8")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 256, generator=g).bfloat16()
    dy = torch.randn(48, 256, generator=g).bfloat16()
    params = list(layer.parameters())
    ran = []

    def run():
        calls.clear()
        out, grads, saved = _fwd_bwd(lambda x_, *p: layer(x_), [x] + params, dy, [True] * (1 + len(params)),
                                     fresh=[True] + [False] * len(params))
        ran.append((_ran(calls, "body"), _ran(calls, "op")))
        return out, grads, saved

    _compare(_both_paths(monkeypatch, run), "fp8 layer")
    (direct_bodies, direct_ops), (op_bodies, op_ops) = ran
    assert not direct_ops and {"fp8_mm", "fp8_swiglu_quant_both", "fp8_quantize_cols", "fp8_quantize_both",
                               "fp8_wgrad", "fp8_swiglu_bwd_quant_both"} <= direct_bodies
    assert not op_bodies and op_ops == direct_bodies


# --- torch.compile ------------------------------------------------------------------------------------


def _recording_backend(graphs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _targets(graphs):
    return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


def test_compile_traces_the_ops_and_equals_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 128, generator=g).bfloat16()
    w13 = (torch.randn(3, 128, 128, generator=g) / 128 ** 0.5).bfloat16()
    w2 = (torch.randn(3, 64, 128, generator=g) / 8).bfloat16()
    dy = torch.randn(48, 128, generator=g).bfloat16()
    off = torch.tensor([20, 20, 40], dtype=torch.int32)
    q13, q2 = fp8.quantize_weight(w13), fp8.quantize_weight(w2)
    _, h, y, gate, gc = make_case(16, 3, 4, 128, "random", "signed", torch.bfloat16, seed=6)

    def experts(x_, w13_, w2_):
        return fp8.swiglu_experts_fp8(x_, w13_, w2_, off, w13_fp8=q13, w2_fp8=q2, backend="reference")

    def grouped(x_, w_):
        return fp8.grouped_mm_fp8(x_, w_, off, w_fp8=q13, backend="reference")

    def combine(y_, w_):
        return LC.combine_weighted_local(y_, w_, h.order_S, h.inverse_S)

    for fn, inputs, d, ops in [
        (experts, (x, w13, w2), dy, {"fp8_quantize_both", "fp8_mm", "fp8_swiglu_quant_both", "fp8_wgrad",
                                     "fp8_swiglu_bwd_quant_both"}),
        (grouped, (x, w13), dy, {"grouped_mm_fp8", "fp8_quantize_both", "fp8_mm", "fp8_quantize_cols", "fp8_wgrad"}),
        (combine, (y, gate), gc, {"local_combine_weighted", "local_combine_weighted_backward"}),
    ]:
        graphs = []
        compiled = torch.compile(fn, fullgraph=True, backend=_recording_backend(graphs))
        need = (True,) * len(inputs)
        _compare((_fwd_bwd(compiled, inputs, d, need, hooks=False), _fwd_bwd(fn, inputs, d, need, hooks=False)),
                 fn.__name__)
        assert {f"tlx_dist.{o}.default" for o in ops} <= _targets(graphs), sorted(_targets(graphs))
