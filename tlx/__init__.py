"""Device code for tlx_dist: TLX kernels per GPU generation, portable Triton kernels, device helpers.

This package holds only ``@triton.jit`` code and the capability detection below. It never allocates
and never imports ``torch.distributed``; host wrappers live in ``tlx_dist``.

Capability detection answers two questions without touching a GPU unless one is there:

* ``tlx_available()`` -- can the real TLX compiler (``fbtriton``) be imported? Stock Triton has no
  ``triton.language.extra.tlx``; fbtriton installs the ``triton`` module with it.
* ``gpu_arch()`` -- which generation is present: ``"sm_90"`` (Hopper), ``"sm_100"`` (Blackwell),
  ``"gfx94x"`` (AMD CDNA3/CDNA4: gfx940-942 MI300, gfx950 MI350), ``"other"`` (a GPU none of our
  kernels target) or ``"none"``.

Both can be forced for tests and debugging with environment variables:
``TLX_DIST_FORCE_ARCH=sm_90|sm_100|gfx94x|other|none`` and ``TLX_DIST_FORCE_TLX=0|1``, or in-process
with :func:`override`. Backend choice reads them at every call (tlx_dist/grouped_gemm/backends.py),
so a forced generation selects that generation's kernels; tests/test_capability.py checks the choice
of every grouped-GEMM op on each generation this way, on a CPU.

The probes run once per process; they are memoized in a plain dict (not ``functools.lru_cache``) so
that torch.compile, which traces backend choice, reads the memo instead of re-tracing the probe.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from typing import Iterator

__all__ = ["ARCHS", "tlx_available", "triton_available", "gpu_arch", "override", "describe", "c_launch",
           "ENV_C_LAUNCH", "ENV_C_DISPATCH", "c_dispatch_knob"]

ARCHS = ("sm_90", "sm_100", "gfx94x", "other", "none")

_overrides: dict[str, object] = {}
_probed: dict[str, object] = {}


def _memo(fn):
    def probe():
        if fn.__name__ not in _probed:
            _probed[fn.__name__] = fn()
        return _probed[fn.__name__]

    return probe


@_memo
def _probe_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@_memo
def _probe_tlx() -> bool:
    if not _probe_triton():
        return False
    try:
        import triton.language.extra.tlx  # noqa: F401  (present only in fbtriton)
    except Exception:
        return False
    return True


def _env_flag(name: str) -> bool | None:
    val = os.environ.get(name)
    if val is None or val == "":
        return None
    if val not in ("0", "1"):
        raise ValueError(f"{name}={val!r}: expected 0 or 1")
    return val == "1"


def triton_available() -> bool:
    """True if some ``triton`` (stock or fbtriton) is importable."""
    return _probe_triton()


def tlx_available() -> bool:
    """True if the TLX extensions (fbtriton) are importable; honours overrides."""
    if "tlx" in _overrides:
        return bool(_overrides["tlx"])
    forced = _env_flag("TLX_DIST_FORCE_TLX")
    if forced is not None:
        return forced
    return _probe_tlx()


@_memo
def _probe_arch() -> str:
    # Importing torch is cheap here (tlx_dist needs it anyway); torch.cuda.is_available() does not
    # create a context when no driver is present.
    import torch

    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        arch = getattr(props, "gcnArchName", "")
        return "gfx94x" if arch.startswith("gfx94") or arch.startswith("gfx95") else "other"
    major = props.major
    if major == 9:
        return "sm_90"
    if major == 10:
        return "sm_100"
    return "other"


def gpu_arch() -> str:
    """The GPU generation of the current device: one of :data:`ARCHS`."""
    if "arch" in _overrides:
        return str(_overrides["arch"])
    forced = os.environ.get("TLX_DIST_FORCE_ARCH")
    if forced:
        if forced not in ARCHS:
            raise ValueError(f"TLX_DIST_FORCE_ARCH={forced!r}: expected one of {ARCHS}")
        return forced
    return _probe_arch()


@contextlib.contextmanager
def override(*, arch: str | None = None, tlx: bool | None = None) -> Iterator[None]:
    """Force the detected capability inside a ``with`` block (tests, debugging)."""
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: expected one of {ARCHS}")
    saved = dict(_overrides)
    try:
        if arch is not None:
            _overrides["arch"] = arch
        if tlx is not None:
            _overrides["tlx"] = bool(tlx)
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def describe() -> str:
    """One line for logs: ``arch=sm_90 tlx=yes triton=yes``."""
    yn = {True: "yes", False: "no"}
    return f"arch={gpu_arch()} tlx={yn[tlx_available()]} triton={yn[triton_available()]}"


ENV_C_LAUNCH = "TLX_DIST_C_LAUNCH"


def c_launch(kernel):
    """Marks a ``@triton.jit`` kernel for fbtriton's C launch path (``JITFunction.c_cache``): once a
    specialisation is compiled, later launches look it up and launch it in C (argument
    specialisation, TensorDescriptor arguments included) instead of Triton's Python binder, which
    is most of a launch's host time, and host time is what bounds the layer at small token counts.
    Must run before the kernel's first launch in the process (fbtriton fills its C cache only when
    it compiles), so kernel modules call it at import. No-op under the interpreter, on a Triton
    without the C path, or with ``TLX_DIST_C_LAUNCH=0`` (a debugging switch: Triton's own launcher).
    Returns ``kernel``. Only for kernels whose parameters have no Python defaults: the C key pads
    omitted trailing arguments with None, so an omitted non-None default and an explicit None
    would share a compiled kernel (the exchange kernels, with defaults, are not marked)."""
    if os.environ.get(ENV_C_LAUNCH, "1") == "0" or not hasattr(kernel, "c_cache") or not hasattr(kernel, "params"):
        return kernel
    try:
        from triton.runtime.jit import _ensure_torch_bridge
    except ImportError:  # a Triton without the C launch path
        return kernel
    _ensure_torch_bridge()
    kernel.c_cache = True
    if os.environ.get(ENV_C_DISPATCH, "1") != "0":
        _dispatch_in_c(kernel)
    return kernel


ENV_C_DISPATCH = "TLX_DIST_C_DISPATCH"
_BOUND = threading.local()  # the device whose primary context this thread made current (_bind_context)


def _current_device() -> int:
    global _current_device_fn
    if _current_device_fn is None:  # (torch imported once, not at every launch)
        import torch
        _current_device_fn = torch.cuda.current_device
    return _current_device_fn()


_current_device_fn = None


def _make_current(device: int) -> None:
    import torch
    if torch.version.hip is not None:  # (the NVIDIA C dispatcher's gap; HIP's utils have no such call)
        return
    from triton.runtime import driver
    set_current = getattr(driver.active.utils, "set_current_device", None)
    if set_current is not None:
        set_current(device)  # cuDevicePrimaryCtxRetain + cuCtxSetCurrent


def _bind_context() -> None:
    """Before a marked kernel's launch: the current device's primary context is current on this
    thread. fbtriton's C dispatcher calls ``cuLaunchKernelEx`` without making one current (Triton's
    Python launcher does, ``ensureCudaContext``), and a thread whose first CUDA work is a marked
    kernel has none -- autograd's device thread, when a backward starts with one of ours (torch
    binds it lazily, at its first runtime call): "invalid device context (201)" (seen with
    tests/test_fused_ep_gpu.py run on its own). Once per thread and device."""
    dev = _current_device()
    if getattr(_BOUND, "device", None) != dev:
        _make_current(dev)
        _BOUND.device = dev
_KNOB = "use_triton_dispatcher"  # fbtriton's knobs.nvidia.use_triton_dispatcher (TRITON_USE_C_DISPATCHER)
_UNSET = object()


def _dispatch_in_c(kernel) -> None:
    """Unless ``TLX_DIST_C_DISPATCH=0`` (with the C launch path on): this kernel's launches run with fbtriton's
    C dispatcher knob on, for this kernel only. A specialisation compiled then carries a C dispatcher
    (``CompiledKernel._dispatcher``, built from the kernel's launch-metadata schema, TensorDescriptor
    arguments included), which the C cache stores with it, so a later launch is key + lookup +
    ``cuLaunchKernelEx`` in one C call instead of the Python launcher (``driver.py``'s ``__call__``
    and its ``launch_metadata``). The knob is set on ``knobs.nvidia`` directly (not through its
    setter, which would also export ``TRITON_USE_C_DISPATCHER`` to the environment) for the duration
    of the launch and restored after it, so no other Triton kernel in the process changes path, and
    ``kernel[grid]`` stays Python's ``run`` (the knob's C proxy takes positional arguments only).
    The fused layer's launches take a good part less host time with it, and the GPU tiers pass
    with it on (docs/decisions.md)."""
    try:
        from triton import knobs
    except ImportError:
        return
    d = knobs.nvidia.__dict__
    run = kernel.run

    def run_dispatching(*args, **kwargs):
        _bind_context()
        prev = _knob_on(d)
        try:
            return run(*args, **kwargs)
        finally:
            _knob_restore(d, prev)

    kernel.run = run_dispatching
    kernel.c_dispatch = True


def _knob_on(d: dict):
    """Sets fbtriton's C-dispatcher knob in ``d`` (``knobs.nvidia.__dict__``: directly, not through
    its setter, which would export it to the environment); returns what :func:`_knob_restore`
    puts back."""
    prev = d.get(_KNOB, _UNSET)
    d[_KNOB] = True
    return prev


def _knob_restore(d: dict, prev) -> None:
    if prev is _UNSET:
        d.pop(_KNOB, None)
    else:
        d[_KNOB] = prev


@contextlib.contextmanager
def c_dispatch_knob():
    """fbtriton's C-dispatcher knob on for the block, restored after it. A marked kernel's
    launches run under it (:func:`_dispatch_in_c`), and so must anything that compiles one of its
    specialisations ahead of a launch (``JITFunction.preload``, ``bench/_precompile.py``), or the
    launch finds no compiled kernel under its key and compiles it again."""
    from triton import knobs

    d = knobs.nvidia.__dict__
    prev = _knob_on(d)
    try:
        yield
    finally:
        _knob_restore(d, prev)
