"""The overlapped row form's kernels (``tlx_dist.comm.symm.RowsOverlap``, ``HierRowsOverlap``): the
arrival wait on a region's counters, the copy of the landed rows out of RECV (the hierarchical
plan), and the gate/up GEMM's virtual-expert offsets (``exchange.py`` describes the op, the region
and the legend)."""

from __future__ import annotations

import triton
import triton.language as tl

from .protocol import OP_TOKENS, _wait_geq


@triton.jit
def _rows_wait_kernel(want_ptr, peers_ptr, RANK, RCNT_OFF, W: tl.constexpr, OFF_STATE: tl.constexpr,
                      TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr):
    """The overlapped row form's arrival wait (one program, on the stream of the GEMMs that read
    the rows): for every source s != RANK, waits (bounded, OP_TOKENS) until this rank's region
    counter RCNT[s] at ``RCNT_OFF`` holds ``want[s]`` rows (``rows_from``: every row of s landed),
    then takes them off the counter, so it reads 0 again before the next dispatch into the region
    (whose senders start adding only after this rank ended a later op)."""
    my = tl.load(peers_ptr + RANK)
    ctr = (my + RCNT_OFF).to(tl.pointer_type(tl.int64))
    err_ptr = (my + OFF_STATE + 16).to(tl.pointer_type(tl.int64))
    for s in range(W):
        if s != RANK:
            want = tl.load(want_ptr + s)
            _wait_geq(ctr + s, want, err_ptr, OP_TOKENS, s, TIMEOUT_NS, CLOCK)
            got = tl.atomic_add(ctr + s, 0, sem="acquire", scope="sys")
            if got >= want:
                tl.atomic_add(ctr + s, -want, sem="relaxed", scope="sys")


@triton.jit
def _landed_rows_copy_kernel(src_ptr, dst_ptr, rows_from_ptr, LO, HI, R, T_MAX, D, stride_s, stride_d,
                             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (cdiv(R, BLOCK_R), cdiv(D, BLOCK_D)): receive rows outside ``[LO, HI)`` (the sources not
    present when the dispatch returned), ``dst[n] = src[n]`` for the rows their source sent --
    row ``n`` of source ``n // T_MAX`` while ``n % T_MAX < rows_from[source]`` -- and nothing past
    them (no other row is ever read), so only the bytes that crossed are copied."""
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inr = (n < R) & ((n < LO) | (n >= HI))
    ok = inr & ((n % T_MAX) < tl.load(rows_from_ptr + n // T_MAX, mask=inr, other=0))
    if tl.sum(ok.to(tl.int32)) > 0:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (cols < D)[None, :]
        n64 = n.to(tl.int64)[:, None]
        v = tl.load(src_ptr + n64 * stride_s + cols[None, :], mask=m)
        tl.store(dst_ptr + n64 * stride_d + cols[None, :], v, mask=m)


@triton.jit
def _phase_offsets_kernel(starts_ptr, counts_ptr, offs_ptr, out_ptr, LO, HI, CAP, W: tl.constexpr,
                          E_LOCAL: tl.constexpr, EP: tl.constexpr):
    """The overlapped gate/up GEMM's virtual experts (one program): for local expert j, three runs
    of its expert-major rows -- sources before LO, the present sources ``[LO, HI)`` (the flat
    overlap: this rank alone; the hierarchical one: its node's ranks), sources from HI on -- as
    cumulative ends ``out[3j] = start(LO, j)``, ``out[3j + 1] = start(HI, j)``, ``out[3j + 2] =
    offs[j]``, each capped at CAP (the capacity; ``offs`` is capped already), int32. ``starts``:
    ``[W, E_LOCAL]`` first expanded row of (source, expert) (``_await`` STARTS), ``counts``:
    ``[E_LOCAL]`` rows per expert; ``start(W, j)`` is the expert's first row + its rows."""
    j = tl.arange(0, EP)
    jm = j < E_LOCAL
    lo = tl.load(starts_ptr + LO * E_LOCAL + j, mask=jm, other=0).to(tl.int64)
    if HI < W:
        hi = tl.load(starts_ptr + HI * E_LOCAL + j, mask=jm, other=0).to(tl.int64)
    else:
        hi = tl.load(starts_ptr + j, mask=jm, other=0).to(tl.int64) + tl.load(counts_ptr + j, mask=jm,
                                                                                other=0).to(tl.int64)
    end = tl.load(offs_ptr + j, mask=jm, other=0).to(tl.int64)
    if CAP >= 0:
        lo = tl.minimum(lo, CAP)
        hi = tl.minimum(hi, CAP)
    tl.store(out_ptr + 3 * j, lo.to(tl.int32), mask=jm)
    tl.store(out_ptr + 3 * j + 1, hi.to(tl.int32), mask=jm)
    tl.store(out_ptr + 3 * j + 2, end.to(tl.int32), mask=jm)
