"""Capability detection and a GPU-free import."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tlx


def test_detected_arch_matches_the_machine(monkeypatch):
    import torch

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
