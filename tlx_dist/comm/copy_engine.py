"""Copy-engine copies into a peer's symmetric region, issued on the current stream.

The exchange's copy-engine row form (``tlx_dist.comm.symm.ce_transport``) moves a rank's token rows
and partial rows with the GPU's DMA copy engines instead of SM stores: ``cuMemcpyAsync`` (CUDA driver
API, through ctypes) between this rank's memory and the peer address of the destination (unified
addressing: the driver finds the peer GPU from the address). Over NVLink the copy engines move more
per direction than SM stores with both GPUs sending (``bench/p2p_copy.py`` measures both), and they
leave every SM to the kernels. A copy on a capturing stream becomes a memcpy node of the CUDA graph.

On CPU (the Triton interpreter's emulated world) the same call is a ``memmove``: the tests run the
mode's whole protocol there."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

_LOCK = threading.Lock()
_DRIVER: Optional["_Driver"] = None


class _Driver:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, res = ctypes.c_uint64, ctypes.c_int
        self.lib.cuMemcpyAsync.argtypes = [u64, u64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyAsync.restype = res
        self.lib.cuGetErrorName.argtypes = [res, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuGetErrorName.restype = res

    def check(self, r: int, what: str) -> None:
        if r != 0:
            s = ctypes.c_char_p()
            name = s.value.decode() if self.lib.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value else str(r)
            raise RuntimeError(f"{what} failed: {name} ({r})")


def _driver() -> _Driver:
    global _DRIVER
    with _LOCK:
        if _DRIVER is None:
            _DRIVER = _Driver()
        return _DRIVER


def available(device: torch.device) -> bool:
    """Whether copies can be issued here: a CUDA (not ROCm) device whose driver library loads."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    try:
        _driver()
    except OSError:
        return False
    return True


def copy_bytes(device: torch.device, dst: int, src: int, nbytes: int) -> None:
    """``nbytes`` from address ``src`` to ``dst`` (either may be a peer's), on ``device``'s current
    stream (CUDA), or at once (CPU). Nothing for ``nbytes <= 0``."""
    if nbytes <= 0:
        return
    if device.type == "cpu":
        ctypes.memmove(dst, src, nbytes)
        return
    import tlx
    tlx._bind_context()  # the driver call needs a current context (autograd's thread may have none)
    drv = _driver()
    stream = torch.cuda.current_stream(device).cuda_stream
    drv.check(drv.lib.cuMemcpyAsync(dst, src, nbytes, stream), f"cuMemcpyAsync({nbytes} bytes)")
