"""Device-side conventions for one-sided communication, and the NVSHMEM calls.

Every rank's symmetric memory is one byte region with the same layout on every rank (offsets are
constexprs chosen by the host). A *peer table* ``peers[W]`` (int64) holds each rank's base address
as this rank sees it: a peer pointer from torch symmetric memory inside a node, a slice of one
allocation in the emulated world, or 0 for a rank only NVSHMEM reaches (another node). A peer
address is ``peers[d] + offset``; a row of a receive buffer is ``offset + row * ROW_BYTES``.

Signals are int64 counters in the destination's region. Producers publish with a release add at
system scope after a CTA barrier (so every thread's stores precede the signal); consumers poll with
an acquire read-modify-write, then barrier. These are plain Triton atomics, written inline in the
kernels (the interpreter re-patches the language on every nested ``@triton.jit`` call, which
made small helpers cost more than the kernels), so the kernels also run under
``TRITON_INTERPRET=1``.

NVSHMEM (peers on other nodes): extern declarations of libnvshmem_device functions. The host links
``libnvshmem_device.bc`` and initialises the module (``tlx_dist.comm.symm_buffers``); kernels only
reach these through a ``USE_NVSHMEM`` constexpr branch, so the peer-pointer build never needs them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language import core

NVSHMEM_SIGNAL_SET = tl.constexpr(0)
NVSHMEM_SIGNAL_ADD = tl.constexpr(5)


# ---- NVSHMEM device API (declared here; linked from libnvshmem_device.bc by the host) ----

@core.extern
def nvshmem_putmem_block(dest, source, nbytes, pe, _semantic=None):
    """Block-collective put of ``nbytes`` from local ``source`` to symmetric ``dest`` on ``pe``."""
    return core.extern_elementwise(
        "", "", [dest, source, nbytes, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int32")):
         ("nvshmemx_putmem_block", core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@core.extern
def nvshmem_int64_p(dest, value, pe, _semantic=None):
    """Single-element put of an int64 to symmetric ``dest`` on ``pe``."""
    return core.extern_elementwise(
        "", "", [dest, value, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int32")): ("nvshmem_int64_p", core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@core.extern
def nvshmem_signal_op(sig_addr, value, op, pe, _semantic=None):
    """Atomic ``op`` (SET=0, ADD=5) of ``value`` on the symmetric uint64 signal at ``sig_addr`` of ``pe``."""
    return core.extern_elementwise(
        "", "", [sig_addr, value, op, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int32"), core.dtype("int32")):
         ("nvshmemx_signal_op", core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@core.extern
def nvshmem_fence(_semantic=None):
    """Orders this PE's earlier puts before its later puts/signals to the same PE."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", core.dtype("int32"))},
                                   is_pure=False, _semantic=_semantic)
