"""Device helpers for one-sided communication: peer addressing, arrival signals, NVSHMEM calls.

Every rank's symmetric memory is one byte region with the same layout on every rank (offsets are
constexprs chosen by the host). A *peer table* ``peers[W]`` (int64) holds each rank's base address
as this rank sees it: a peer pointer from torch symmetric memory inside a node, a slice of one
allocation in the emulated world, or 0 for a rank only NVSHMEM reaches (another node). A peer
address is ``peers[d] + offset``; a row of a receive buffer is ``offset + row * ROW_BYTES``.

Signals are int64 counters in the destination's region. Producers publish with a release add at
system scope after a CTA barrier (so every thread's stores precede the signal); consumers poll with
an acquire read-modify-write, then barrier. These are plain Triton atomics so the kernels also run
under ``TRITON_INTERPRET=1``.

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


@triton.jit
def as_ptr(addr, DTYPE: tl.constexpr):
    """int64 address (scalar or tensor) -> pointer to DTYPE."""
    return addr.to(tl.pointer_type(DTYPE))


@triton.jit
def signal_add(addr, n):
    """``*addr += n`` on a (possibly peer) int64 counter, releasing this CTA's earlier stores.
    Callers put ``tl.debug_barrier()`` before it."""
    tl.atomic_add(as_ptr(addr, tl.int64), n.to(tl.int64), sem="release", scope="sys")


@triton.jit
def signal_max(addr, v):
    tl.atomic_max(as_ptr(addr, tl.int64), v.to(tl.int64), sem="release", scope="sys")


@triton.jit
def wait_ge(addr, target):
    """Spin until the local int64 counter at ``addr`` reaches ``target`` (acquire, system scope)."""
    p = as_ptr(addr, tl.int64)
    while tl.atomic_add(p, 0, sem="acquire", scope="sys") < target:
        pass


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
