"""``torch.library.opcheck`` on the grouped-GEMM custom ops (STYLE.md 3).

opcheck runs each op through its schema check, fake-tensor check (the registered fake impl must
give the real output's shape/dtype/strides), the autograd-registration check and AOT dispatch
(forward and, with inputs that require grad, the registered backward). It checks that the
registrations agree with each other (eager vs traced), not the gradients' values: those are tested
against fp64 references in test_grouped_gemm_ref.py / _gpu.py, and by gradcheck below. CPU backends run in CI
(tier T0); the portable Triton kernel runs interpreted in tests/test_grouped_gemm_triton_cpu.py;
the GPU backends (tlx, triton, torch) run here with ``-m gpu`` (tier T3).
"""

from __future__ import annotations

import pytest
import torch

import tlx_dist.grouped_gemm  # noqa: F401  (registers torch.ops.tlx_dist.*)

# (counts per expert, N rows, D, F, why)
CASES = [
    ([3, 0, 5], 10, 16, 8, "a zero-row expert and 2 padding rows"),
    ([7], 7, 16, 16, "E=1, no padding"),
    ([0, 0], 4, 8, 8, "every expert empty: all rows are padding"),
]


def opcheck_case(counts, N, D, F, backend, device="cpu", dtype=torch.float32, offsets_dtype=torch.int32):
    """Runs opcheck on both ops; ``x`` and ``w`` require grad, so the backward is checked too."""
    torch.manual_seed(0)
    off = torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0).to(offsets_dtype)
    x = torch.randn(N, D, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), D, F, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(N, F, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.tlx_dist.grouped_mm, (x, w, off, backend))
    # The weight gradient has no backward of its own (it is one): its inputs do not require grad.
    torch.library.opcheck(torch.ops.tlx_dist.grouped_mm_wgrad, (x.detach(), dy, off, backend))


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("counts,N,D,F,why", CASES, ids=[c[-1][:30] for c in CASES])
def test_opcheck_cpu(backend, counts, N, D, F, why):
    opcheck_case(counts, N, D, F, backend)


def test_opcheck_cpu_int64_offsets():
    # int64 offsets take the same guarded path (compared in int64, converted on the device).
    opcheck_case([3, 0, 5], 10, 16, 8, "reference", offsets_dtype=torch.int64)


def test_gradcheck_fp64_with_padding_and_empty_expert():
    # Finite differences through the registered backward (dx via grouped_mm with w^T, dw via
    # grouped_mm_wgrad), with a zero-row expert and padding rows whose gradient must be zero.
    torch.manual_seed(1)
    off = torch.tensor([2, 2, 5], dtype=torch.int32)
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    # torch._grouped_mm on CPU takes bf16/fp32 only: fp64 finite differences are the reference's.
    f = lambda a, b: tlx_dist.grouped_gemm.grouped_mm(a, b, off, backend="reference")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["tlx", "triton", "torch"])
@pytest.mark.parametrize("counts", [[300, 0, 517, 129], [1000]], ids=["zero-row expert, 54 padding rows", "E=1"])
def test_opcheck_gpu(backend, counts):
    from tlx_dist.grouped_gemm.backends import available_backends

    if backend not in available_backends():
        pytest.skip(f"backend {backend!r} is not available here")
    opcheck_case(counts, 1000, 128, 256, backend, device="cuda", dtype=torch.bfloat16)


def test_tma_operand_check_is_traceable_without_dynamo():
    """AOT tracing (opcheck's aot_dispatch, the backward of a compiled graph) hands the backend check
    FakeTensors while torch.compiler.is_compiling() is False: the base-address check must defer to
    the custom op (which checks the real pointer) instead of raising "Cannot access data pointer"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tlx_dist.grouped_gemm.host import tma_2d_reason as _tma_2d_reason

    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    with FakeTensorMode():
        x = torch.empty(64, 32, dtype=torch.bfloat16)
        assert _tma_2d_reason("x_ND", x) is None
        assert "16-byte" in _tma_2d_reason("x_ND", torch.empty(64, 33, dtype=torch.bfloat16)[:, :32])
        with FunctionalTensorMode():  # what AOT dispatch hands the check
            assert _tma_2d_reason("x_ND", FunctionalTensor.to_functional(x)) is None
    real = torch.empty(65, dtype=torch.bfloat16)[1:].view(8, 8)  # a 2-byte-misaligned base
    assert "16-byte" in _tma_2d_reason("x_ND", real)
