"""NVSHMEM device calls for the exchange kernels' route to peers on other nodes.

Declarations only (``@core.extern``): the definitions come from ``libnvshmem_device.bc`` of the
NVSHMEM wheel, which the host links into exactly the kernels compiled with ``USE_NVSHMEM=True``
and whose CUDA module it then initialises for NVSHMEM (``tlx_dist.comm.symm.buffers``). A kernel
compiled with ``USE_NVSHMEM=False`` never references these symbols, so it needs neither.

Rules the exchange kernels follow (and ``tests/test_symm_nvshmem_compile.py`` checks in the PTX):
  * ``putmem_block`` is block-collective: every thread of the CTA reaches it, with the same
    arguments (scalars loaded by every thread), never inside a per-thread branch. Its source must
    be symmetric memory: callers stage the bytes in their own symmetric region first.
  * ``fence``/``quiet``/``signal_op`` act for the whole PE: one thread issues them, behind
    :func:`one_thread` (``if one_thread():``), after a CTA barrier that orders every thread's
    puts and stores before them. Triton has no thread id, so :func:`thread_id` reads ``%tid.x``
    with inline PTX (Triton launches one-dimensional CTAs).
  * Signals land in the same int64 counters the peer-pointer path raises with atomics
    (``ARRIVE``/``FLAGS``), so receivers poll their own memory the same way on both routes.

Signal operations are NVSHMEM's ``nvshmemx_signal_op_t`` values (``NVSHMEM_SIGNAL_SET = 9``,
``NVSHMEM_SIGNAL_ADD = 10`` in ``device_host_transport/nvshmem_common_transport.h``).

Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU) these calls are *emulated* over the
symmetric heaps registered with :func:`emulate_heaps` (an emulated world of several "nodes",
``SymmBuffers.emulated(..., ranks_per_node=n)``): a put copies bytes at once, a signal sets or
adds at once, fence/quiet do nothing, and the interpreter's program is the "one thread". The
emulation raises if a put's source or a symmetric address lies outside this PE's heap, so the CPU
tests check the staging rule and every offset the route computes; not NVSHMEM's ordering or
transport, which only a multi-node run can.
"""

from __future__ import annotations

import ctypes
import os

import triton
import triton.language as tl
from triton.language import core

SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)

_I32, _I64, _U64 = core.dtype("int32"), core.dtype("int64"), core.dtype("uint64")


@core.extern
def putmem_block(dest, source, nbytes, pe, _semantic=None):
    """``nvshmemx_putmem_block``: block-collective blocking put of ``nbytes`` from this PE's
    symmetric ``source`` to the symmetric address ``dest`` on PE ``pe`` (both int64 addresses in
    this PE's heap). Returns when ``source`` may be reused, not when the bytes arrived."""
    return core.extern_elementwise(
        "", "", [dest, source, nbytes, pe],
        {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_block", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def signal_op(sig_addr, value, op, pe, _semantic=None):
    """``nvshmemx_signal_op``: atomic SET/ADD of ``value`` on the uint64 at symmetric
    ``sig_addr`` of PE ``pe``. One thread."""
    return core.extern_elementwise(
        "", "", [sig_addr, value, op, pe],
        {(_I64, _U64, _I32, _I32): ("nvshmemx_signal_op", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def quiet(_semantic=None):
    """``nvshmem_quiet``: every put/AMO this PE issued before is complete (visible at its
    target). One thread, after a CTA barrier."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence``: this PE's earlier puts/AMOs to a PE are delivered before its later ones."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic)


@triton.jit
def thread_id():
    """``%tid.x`` of the calling thread (int32 scalar; Triton's CTAs are one-dimensional)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def one_thread():
    """True on thread 0 of the CTA only: the guard of every signal, fence and quiet."""
    return thread_id() == 0


@triton.jit
def fence_sys():
    """``fence.sc.sys``: this thread's earlier stores (and, after a CTA barrier, the CTA's) are
    visible system-wide -- to a NIC's atomics too -- before its next NVSHMEM call."""
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# ---------------------------------------------------------------- interpreter emulation

_HEAPS: list = []  # (base address, bytes) of each emulated PE's symmetric heap, by PE


def emulate_heaps(heaps) -> None:
    """Registers the symmetric heaps ``[(base, nbytes)]`` of an emulated world, indexed by PE
    (replacing the previous world's)."""
    _HEAPS[:] = [(int(b), int(n)) for b, n in heaps]


def _int(v) -> int:
    h = getattr(v, "handle", None)
    if h is not None:  # an interpreter tensor (a scalar)
        return int(h.data.reshape(-1)[0])
    return int(getattr(v, "value", v))  # a constexpr or a Python int


def _heap_offset(addr: int, nbytes: int, what: str) -> tuple[int, int]:
    """(PE whose heap holds [addr, addr + nbytes), offset in it): symmetric memory of the caller."""
    for pe, (base, size) in enumerate(_HEAPS):
        if base <= addr and addr + nbytes <= base + size:
            return pe, addr - base
    raise ValueError(f"emulated NVSHMEM: {what} [{addr:#x}, +{nbytes}) is not in a symmetric heap "
                     f"({len(_HEAPS)} registered): NVSHMEM needs symmetric memory there")


def _emu_putmem_block(dest, source, nbytes, pe, _semantic=None):
    dest, source, n, pe = (_int(v) for v in (dest, source, nbytes, pe))
    me, _ = _heap_offset(source, n, "put source")
    me2, off = _heap_offset(dest, n, "put destination")
    if me2 != me:
        raise ValueError(f"emulated NVSHMEM: put destination lies in PE {me2}'s heap, not the caller's ({me})")
    ctypes.memmove(_HEAPS[pe][0] + off, source, n)


def _emu_signal_op(sig_addr, value, op, pe, _semantic=None):
    sig, v, op, pe = (_int(x) for x in (sig_addr, value, op, pe))
    _, off = _heap_offset(sig, 8, "signal")
    cell = ctypes.c_int64.from_address(_HEAPS[pe][0] + off)
    v = v - 2**64 if v >= 2**63 else v
    if op == 9:
        cell.value = v
    elif op == 10:
        cell.value += v
    else:
        raise ValueError(f"emulated NVSHMEM: signal op {op} is neither NVSHMEM_SIGNAL_SET (9) nor ADD (10)")


def _emu_nothing(*args, _semantic=None):
    return None


if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the kernels are interpreted: emulate the calls
    putmem_block, signal_op = _emu_putmem_block, _emu_signal_op
    quiet = fence = fence_sys = _emu_nothing

    def thread_id():  # noqa: F811 -- an interpreted program is one thread
        return 0

    def one_thread():  # noqa: F811
        return True
