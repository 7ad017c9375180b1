"""Compiles, in worker processes, the Triton kernels that some calls would compile, so that a bench
timing many launch configs pays their compile time once, spread over the host's cores.

    pre = Precompiler(workers=16)
    specs = pre.record(lambda: [call(cfg) for cfg in configs])  # runs the calls, but each kernel
                                                                 # not compiled yet is only noted
    pre.compile(specs)      # each noted kernel compiled by a worker into Triton's cache directory
    ...                     # the calls again: each kernel loads from the cache
    pre.close()

While ``record`` runs, a launch of a kernel that is not compiled yet is skipped (no compile, no
launch), so its outputs stay unwritten; kernels that are compiled run. Run once beforehand any
kernel whose output a later one reads as indices (e.g. the offsets prep of the tile kernels), so
that a compiled kernel never reads unwritten indices. Mechanism: Triton's
``knobs.runtime.jit_cache_hook`` (called before each compile, with the kernel's serialized
specialization; True skips it) and ``JITFunction.preload`` (compiles from that specialization).
A kernel a worker fails to compile is compiled (and its error raised) by the call itself later.
"""

from __future__ import annotations

import importlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable


def _preload(module: str, name: str, spec: str) -> None:
    fn = getattr(importlib.import_module(module), name)
    if getattr(fn, "c_dispatch", False):  # (tlx.c_launch) its launches compile under the C-dispatcher knob
        import tlx

        with tlx.c_dispatch_knob():
            fn.preload(spec)
    else:
        fn.preload(spec)


class Precompiler:
    """``workers`` processes (spawned on the first :meth:`compile`; 0: nothing is precompiled)."""

    def __init__(self, workers: int):
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers={workers!r} must be an int >= 0")
        self.workers, self._pool = workers, None
        self.errors: list = []  # (module.name, the worker's exception) of each kernel that failed there

    def record(self, calls: Callable[[], object]) -> dict:
        """Runs ``calls()`` with every not-yet-compiled kernel launch skipped; returns those kernels,
        ``{specialization (JSON str): (module, name)}`` (each once). Without workers ``calls()``
        just runs (compiling as it goes)."""
        from triton import knobs

        specs: dict = {}

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            specs.setdefault(compile["specialization_data"], (fn.module, fn.name))
            return True  # skip this compile and its launch

        if not self.workers:
            calls()
            return specs
        old, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
        try:
            calls()
        finally:
            knobs.runtime.jit_cache_hook = old
        return specs

    def compile(self, specs: dict) -> int:
        """Compiles ``specs`` (from :meth:`record`) in the workers; returns how many failed (their
        errors appended to :attr:`errors`)."""
        if not specs or not self.workers:
            return 0
        if self._pool is None:  # spawn: a fresh interpreter, no CUDA state inherited
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = {self._pool.submit(_preload, m, n, s): f"{m}.{n}" for s, (m, n) in specs.items()}
            failed = [(name, f.exception()) for f, name in futures.items() if f.exception() is not None]
        except BrokenProcessPool as e:  # a worker died earlier: none of these were compiled
            failed = [(f"{m}.{n}", e) for m, n in specs.values()]
        if any(isinstance(e, BrokenProcessPool) for _, e in failed):  # a worker died: the next call starts anew
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.errors += failed
        return len(failed)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
