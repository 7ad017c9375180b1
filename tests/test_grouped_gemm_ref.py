"""grouped_mm on CPU (torch and reference backends): forms, autograd, padding, custom op."""

from __future__ import annotations

import pytest
import torch

from tlx_dist.grouped_gemm import (available_backends, grouped_mm, grouped_mm_ref, grouped_mm_wgrad,
                                   select_backend)
from tlx_dist.testing import assert_close_to_ref


def _offsets(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _loop64(x, w, counts):
    out, lo = [], 0
    for e, c in enumerate(counts):
        out.append(x[lo:lo + c].double() @ w[e].double())
        lo += c
    return torch.cat(out)


# counts per expert and why each exists
COUNTS = [
    ([5, 0, 7, 1], "a zero-row expert between non-empty ones"),
    ([0, 0, 13, 0], "one expert holds every row"),
    ([1], "E=1, one row"),
    ([3] * 17, "many small experts"),
]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("counts", [c for c, _ in COUNTS], ids=[w for _, w in COUNTS])
def test_forward_dx_dw_fp32(backend, counts):
    torch.manual_seed(0)
    N, D, F = sum(counts), 16, 24
    x = torch.randn(N, D, requires_grad=True)
    w = torch.randn(len(counts), D, F, requires_grad=True)
    offs = _offsets(counts)
    y = grouped_mm(x, w, offs, backend=backend)
    g = torch.randn(N, F)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = _loop64(x64, w64, counts)
    y64.backward(g.double())
    same = _loop64(x.detach(), w.detach(), counts).float()
    assert_close_to_ref(y, y64, same, name="y")
    assert_close_to_ref(x.grad, x64.grad, name="dx")
    assert_close_to_ref(w.grad, w64.grad, name="dw")
    if 0 in counts:
        assert torch.all(w.grad[torch.tensor(counts) == 0] == 0), "empty expert must get zero dW"


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_padding_rows_are_zero(backend):
    """Receive buffers sized for the worst case carry rows past offsets[-1]: y must be zero there
    (torch._grouped_mm alone would leave them uninitialised), and dW must ignore them."""
    torch.manual_seed(0)
    x = torch.randn(20, 8)
    x[12:] = float("nan")  # poison the padding: it must not leak into y or dW
    w = torch.randn(3, 8, 16)
    offs = _offsets([4, 0, 8])
    y = grouped_mm(x, w, offs, backend=backend)
    assert torch.all(y[12:] == 0)
    assert torch.isfinite(y[:12]).all()
    dw = grouped_mm_wgrad(x, torch.randn(20, 16), offs, backend=backend)
    assert torch.isfinite(dw).all()
    assert torch.all(dw[1] == 0)


def test_transposed_weight_view_matches_contiguous():
    torch.manual_seed(0)
    x = torch.randn(9, 16)
    w = torch.randn(2, 24, 16)
    offs = _offsets([4, 5])
    for b in ("torch", "reference"):
        torch.testing.assert_close(grouped_mm(x, w.transpose(1, 2), offs, backend=b),
                                   grouped_mm(x, w.transpose(1, 2).contiguous(), offs, backend=b))


def test_auto_backend_on_cpu_and_alignment_fallback():
    x, w = torch.randn(4, 16), torch.randn(2, 16, 8)
    assert select_backend(x, w).name == "torch"
    # Odd D: torch._grouped_mm's 16-byte stride rule fails -> the reference loop, same answer.
    x7, w7 = torch.randn(4, 7), torch.randn(2, 7, 5)
    assert select_backend(x7, w7).name == "reference"
    with pytest.raises(ValueError, match="backend='torch' cannot run"):
        grouped_mm(x7, w7, _offsets([1, 3]), backend="torch")
    torch.testing.assert_close(grouped_mm(x7, w7, _offsets([1, 3])), grouped_mm_ref(x7, w7, _offsets([1, 3])))
    order = available_backends()
    assert order[-1] == "reference"
    if "triton" in order:  # the portable kernel only where torch._grouped_mm cannot run
        assert order.index("torch") < order.index("triton")


def test_argument_pins_backend():
    assert select_backend(torch.randn(4, 16), torch.randn(2, 16, 8)).name == "torch"
    assert select_backend(torch.randn(4, 16), torch.randn(2, 16, 8), "reference").name == "reference"
    with pytest.raises(ValueError, match="backend='nope'"):
        select_backend(torch.randn(4, 16), torch.randn(2, 16, 8), "nope")


def test_opcheck_and_compile():
    x, w, offs = torch.randn(10, 16), torch.randn(3, 16, 8), _offsets([2, 5, 3])
    for b in ("torch", "reference"):
        torch.library.opcheck(torch.ops.tlx_dist.grouped_mm, (x, w, offs, b))
        torch.library.opcheck(torch.ops.tlx_dist.grouped_mm_wgrad, (x, torch.randn(10, 8), offs, b))
    f = torch.compile(lambda a, b_, o: grouped_mm(a, b_, o, backend="torch"), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(x, w, offs), grouped_mm_ref(x, w, offs))


@pytest.mark.parametrize("bad,exc,match", [
    (lambda x, w, o: (x[0], w, o), ValueError, "x_ND must be 2-D"),
    (lambda x, w, o: (x, w[0], o), ValueError, "w_EDF must be 3-D"),
    (lambda x, w, o: (x.double(), w, o), TypeError, "w_EDF.dtype"),
    (lambda x, w, o: (x.long(), w.long(), o), TypeError, "x_ND must be a floating"),
    (lambda x, w, o: (x, w, o.float()), TypeError, "offsets_E must be int32 or int64"),
    (lambda x, w, o: (x, w, o[:2]), ValueError, "offsets_E has 2 entries but w_EDF has E=3 experts"),
    (lambda x, w, o: (x[:, :8], w, o), ValueError, "D=8 columns"),
    (lambda x, w, o: (x, w, torch.tensor([5, 2, 10], dtype=torch.int32)), ValueError, "non-decreasing"),
    (lambda x, w, o: (x, w, torch.tensor([2, 5, 11], dtype=torch.int32)), ValueError, r"offsets_E\[-1\]=11 exceeds"),
    (lambda x, w, o: (x, w.to("meta"), o), ValueError, "one device"),
    (lambda x, w, o: (x.numpy(), w, o), TypeError, "x_ND must be a torch.Tensor"),
])
def test_bad_input_errors_name_the_argument(bad, exc, match):
    x, w, offs = torch.randn(10, 16), torch.randn(3, 16, 8), _offsets([2, 5, 3])
    with pytest.raises(exc, match=match):
        grouped_mm(*bad(x, w, offs))


def test_wgrad_bad_input():
    with pytest.raises(ValueError, match="dy_NF has N=3"):
        grouped_mm_wgrad(torch.randn(4, 8), torch.randn(3, 8), _offsets([4]))
