"""Capability detection and a GPU-free import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tlx


def test_detected_arch_matches_the_machine(monkeypatch):
    monkeypatch.delenv("TLX_DIST_FORCE_ARCH", raising=False)
    if not torch.cuda.is_available():
        assert tlx.gpu_arch() == "none"  # CI: no GPU
    elif torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9:
        assert tlx.gpu_arch() == "sm_90"
    else:
        assert tlx.gpu_arch() in tlx.ARCHS


def test_override_context_and_env(monkeypatch):
    with tlx.override(arch="sm_100", tlx=True):
        assert tlx.gpu_arch() == "sm_100" and tlx.tlx_available()
        with tlx.override(arch="gfx94x"):
            assert tlx.gpu_arch() == "gfx94x"
        assert tlx.gpu_arch() == "sm_100"
    monkeypatch.setenv("TLX_DIST_FORCE_ARCH", "sm_90")
    monkeypatch.setenv("TLX_DIST_FORCE_TLX", "0")
    assert tlx.gpu_arch() == "sm_90" and not tlx.tlx_available()
    assert tlx.describe() .startswith("arch=sm_90 tlx=no")
    monkeypatch.setenv("TLX_DIST_FORCE_ARCH", "sm_42")
    with pytest.raises(ValueError, match="TLX_DIST_FORCE_ARCH='sm_42'"):
        tlx.gpu_arch()
    with pytest.raises(ValueError, match="arch='x'"):
        with tlx.override(arch="x"):
            pass


def test_import_does_no_gpu_or_distributed_work():
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "import tlx_dist\n"
        "assert not dist.is_initialized()\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'triton' not in sys.modules, 'triton imported at import time'\n"
        "print(sorted(tlx_dist.__all__)[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# --- which grouped-GEMM backend each op picks, per GPU generation, on a CPU ----------------------
# TLX_DIST_FORCE_ARCH fakes the generation; FakeTensorMode fakes the device operands (shape,
# strides, dtype and a CUDA device, no memory), so the real choice code runs: the same _pick /
# _pick_wgrad that grouped_mm, grouped_mm_wgrad and the autograd backward call (dX is grouped_mm of
# dy with the transposed weight view).

N_ROWS, N_EXPERTS = 64, 4
# operand kind -> (dtype, D, F); D = 12, F = 20 give 24- and 40-byte rows: not 16-byte aligned.
KINDS = {"bf16": (torch.bfloat16, 64, 32), "fp16": (torch.float16, 64, 32), "fp32": (torch.float32, 64, 32),
         "odd": (torch.bfloat16, 12, 20)}
# arch -> kind -> backend of every op (fwd, dX, dW); "no_tlx": bf16 with fbtriton forced missing.
# sm_100 has no measured preference over torch yet but runs the same TLX-first order as sm_90.
EXPECTED = {
    "sm_90": {"bf16": "tlx", "fp16": "tlx", "fp32": "triton", "odd": "triton", "no_tlx": "torch"},
    "sm_100": {"bf16": "tlx", "fp16": "tlx", "fp32": "triton", "odd": "triton", "no_tlx": "torch"},
    # ROCm: torch._grouped_mm is never chosen; the portable kernel is the fallback.
    "gfx94x": {"bf16": "tlx", "fp16": "tlx", "fp32": "triton", "odd": "triton", "no_tlx": "triton"},
    # A GPU no kernel targets: torch._grouped_mm where it runs (sm_90+ bf16), else the portable kernel.
    "other@8.0": {"bf16": "triton", "fp16": "triton", "fp32": "triton", "odd": "triton", "no_tlx": "triton"},
    "other@12.0": {"bf16": "torch", "fp16": "triton", "fp32": "triton", "odd": "triton", "no_tlx": "torch"},
}
# arch -> (host module of its "tlx" implementation, kernel it launches)
TLX_IMPL = {"sm_90": ("tlx_backend", "_grouped_gemm_hopper_kernel"),
            "sm_100": ("tlx_backend", "_grouped_gemm_blackwell_kernel"),
            "gfx94x": ("amd_backend", "_grouped_gemm_amd_kernel")}


def _picks(kind: str) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tlx_dist.grouped_gemm.api import _pick, _pick_wgrad

    dtype, D, F = KINDS["bf16" if kind == "no_tlx" else kind]
    with FakeTensorMode():
        x = torch.empty(N_ROWS, D, dtype=dtype, device="cuda")
        w = torch.empty(N_EXPERTS, D, F, dtype=dtype, device="cuda")
        dy = torch.empty(N_ROWS, F, dtype=dtype, device="cuda")
        return {"fwd": _pick(x, w, None), "dX": _pick(dy, w.transpose(1, 2), None), "dW": _pick_wgrad(x, dy, None)}


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("arch", list(EXPECTED))
def test_backend_choice_per_arch(arch, monkeypatch):
    if not tlx.tlx_available():
        pytest.skip("TLX (fbtriton) is not importable: the tlx backends are not registered")
    name, _, cap = arch.partition("@")
    monkeypatch.setenv("TLX_DIST_FORCE_ARCH", name)
    if cap:  # only "other" asks the device for its compute capability
        major, minor = map(int, cap.split("."))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    got = {}
    for kind in EXPECTED[arch]:
        monkeypatch.setenv("TLX_DIST_FORCE_TLX", "0" if kind == "no_tlx" else "1")
        got[kind] = _picks(kind)
    want = {kind: dict.fromkeys(("fwd", "dX", "dW"), b) for kind, b in EXPECTED[arch].items()}
    assert got == want


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "gfx94x", "other", "none"])
def test_tlx_implementation_per_arch(arch, monkeypatch):
    from tlx_dist.grouped_gemm import tlx_backend
    from tlx_dist.grouped_gemm.backends import available_backends, get_backend

    if not tlx.tlx_available():
        pytest.skip("TLX (fbtriton) is not importable: the tlx backends are not registered")
    monkeypatch.setenv("TLX_DIST_FORCE_ARCH", arch)
    if arch not in TLX_IMPL:
        assert "tlx" not in available_backends()
        with pytest.raises(ValueError, match=f"backend='tlx' cannot run on this machine: it has no implementation for gpu_arch\\(\\)='{arch}'"):
            get_backend("tlx")
        return
    module, kernel = TLX_IMPL[arch]
    b = get_backend("tlx")
    assert available_backends()[0] == "tlx" and arch in b.archs
    assert b.mm.__module__.endswith(module) and b.wgrad.__module__.endswith(module)
    if module == "tlx_backend":
        assert tlx_backend._kernel(tlx_backend._arch_cc()).fn.__name__ == kernel
    else:
        from tlx.amd.grouped_gemm import _grouped_gemm_amd_kernel

        assert _grouped_gemm_amd_kernel.fn.__name__ == kernel
