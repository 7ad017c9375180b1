"""Bulk-copy row moves of the exchange's send (TLX, Hopper and later): a launch option, ``BULK``.

The send kernel's default moves a token row to a peer through registers: each thread loads its
columns from ``x`` and stores them to the peer's receive row (``exchange._send_tokens_kernel``).
With ``BULK = n`` the row instead goes through shared memory by the copy engine of the SM:

    one thread:  cp.async.bulk  x[t] -> smem slot s                 (completes on mbarrier s)
                 cp.async.bulk  smem slot s -> row of destination d  (one bulk group per store,
                                                                      for every d the token goes to)

A token is loaded once however many destinations it goes to, and no register file is involved.
Every store is its own bulk group (TLX commits one per ``async_store``). Slot s is reloaded only
after the stores that read it have read it (``cp.async.bulk.wait_group.read n-1``): every token that
took a slot since token ``cnt - n`` (the slot's previous user) issued at least one store, so at least
``n - 1`` groups were committed after that token's last one, and waiting until at most ``n - 1`` are
pending retires it. With one destination per token that keeps ``n - 1`` rows' stores in flight; a
token bound for k destinations spends k of the ``n - 1``, so at W = 8 the wait admits fewer tokens
in flight than slots (still correct; deeper pipelining would want one commit per token). Before the send publishes its row counts (the release add the receiver waits for), every
bulk store is complete (``cp.async.bulk.wait_group 0``, then a proxy fence and a system-scope fence
on the issuing thread; the publish itself begins with a CTA barrier).

Rows must be 16-byte aligned and a multiple of 16 bytes (the host checks: ``symm._bulk``). The
slots are ``next_pow2(D)`` elements (shared-memory buffers are powers of two); ``bulk_size`` copies
the D elements. Not with the NVSHMEM route, the per-block receive signals or the receiving programs
(the host never sets BULK there). TLX does not run under the interpreter: the CPU tests run the
default path, the GPU tests both.
"""

from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx


@triton.jit
def bulk_alloc(DT: tl.constexpr, DP: tl.constexpr, NBUF: tl.constexpr):
    """(slots [NBUF][DP] of DT in shared memory, one mbarrier per slot)."""
    buf = tlx.local_alloc((DP,), DT, NBUF)
    bars = tlx.alloc_barriers(num_barriers=NBUF, arrive_count=1)
    return buf, bars


@triton.jit
def _goes_to(send_row_ptr, t, d, RANK, W: tl.constexpr, LOCAL_X: tl.constexpr, SPLIT: tl.constexpr):
    """Whether token t's row is copied to rank d by this launch (as the register path's ``mr``)."""
    ok = tl.load(send_row_ptr + t * W + d) >= 0
    if SPLIT == 1:  # (as the register path: SPLIT decides over LOCAL_X)
        ok = ok & (d == RANK)
    elif SPLIT == 2:
        ok = ok & (d != RANK)
    elif LOCAL_X:
        ok = ok & (d != RANK)
    return ok


@triton.jit
def bulk_rows(buf, bars, cnt, x_ptr, stride_x, b, T, send_row_ptr, peers_ptr, RANK, OWN_ADDR, ROWS_OFF,
              W: tl.constexpr, D: tl.constexpr, T_MAX: tl.constexpr, OFF_RECV: tl.constexpr,
              BLOCK_T: tl.constexpr, ROWS_REGION: tl.constexpr, LOCAL_ROWS: tl.constexpr,
              LOCAL_X: tl.constexpr, SPLIT: tl.constexpr, NBUF: tl.constexpr):
    """Token block ``b``'s rows to every destination (the register path's row copy, by bulk copies);
    ``cnt``: the slots this program has filled so far (returned updated)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    NBYTES: tl.constexpr = D * (DT.primitive_bitwidth // 8)
    for i in range(0, BLOCK_T):
        t = b * BLOCK_T + i
        if t < T:
            n_dst = 0
            for d in tl.static_range(W):
                n_dst += _goes_to(send_row_ptr, t, d, RANK, W, LOCAL_X, SPLIT).to(tl.int32)
            if n_dst > 0:
                s = cnt % NBUF
                tlx.async_descriptor_store_wait(NBUF - 1)  # slot s's last stores have read it
                tlx.barrier_expect_bytes(bars[s], NBYTES)
                tlx.async_load(x_ptr + t.to(tl.int64) * stride_x, buf[s], bulk=True, bulk_size=NBYTES,
                               barrier=bars[s])
                tlx.barrier_wait(bars[s], (cnt // NBUF) & 1)
                for d in tl.static_range(W):
                    if _goes_to(send_row_ptr, t, d, RANK, W, LOCAL_X, SPLIT):
                        row = tl.load(send_row_ptr + t * W + d)
                        base = tl.load(peers_ptr + d)
                        if ROWS_REGION:
                            rbase = base + ROWS_OFF
                        else:
                            rbase = base + OFF_RECV
                        if LOCAL_ROWS:
                            rbase = tl.where(d == RANK, OWN_ADDR, rbase)
                        dst = tl.multiple_of(rbase.to(tl.pointer_type(DT)), 16) + (RANK * T_MAX + row).to(tl.int64) * D
                        tlx.async_store(dst, buf[s], NBYTES)
                cnt += 1
    return cnt


@triton.jit
def bulk_drain():
    """Every bulk store of this thread complete (not only read), then visible system-wide: before the
    CTA barrier and release add of ``protocol._publish``."""
    tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tfence.acq_rel.sys;\n\t"
                              "mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
