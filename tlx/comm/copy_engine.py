"""The copy-engine row form's device side (``tlx_dist/comm/copy_engine.py`` issues the copies).

In this mode a rank's token rows (dispatch) and partial rows (combine) cross NVLink by copy-engine
copies issued from the host (``cuMemcpyAsync`` into the peer's symmetric region), not by SM stores.
That needs the *dense* layout: token t's receive row on every rank is ``s*T_MAX + t`` and its
partial row comes back to ``COMB[d, t]``, so a rank's rows are one contiguous run per peer. The
kernels here order the copies with the op protocol (``exchange.py``):

``_ce_ready_kernel``  (one program, on the op's stream, before the copies are forked off it) waits
    until every peer has finished its previous op (FLAGS[s] >= this rank's epoch), so a copy never
    lands in a region a peer still reads. It runs before anything of the op can end it, so the
    epoch it reads is the op's own.
``_ce_signal_kernel`` (one program, after a copy on the copy's stream): MODE 0 (dispatch): adds the
    rows to every peer's region counter RCNT[region, RANK] (``rows_wait`` waits for them); MODE 1
    (combine): adds the rows of chunk [LO, HI) that the source s has (``rows_from[s]`` tokens) to
    its CBLK[RANK, j] per COMB_BLOCK j, which its summing programs wait for.
``_ce_fixup_kernel``  (combine, only when the host's copy extent H is below T_MAX): a source with
    more than H tokens gets rows [H, rows_from[s]) by SM stores, counted the same way.
Stream order makes a copy complete before the kernel after it starts; the signals are release
adds at system scope, as every other arrival count."""

from __future__ import annotations

import triton
import triton.language as tl

from .protocol import _await


@triton.jit
def _ce_ready_kernel(peers_ptr, RANK, W: tl.constexpr, WP: tl.constexpr, OFF_STATE: tl.constexpr,
                     OFF_FLAGS: tl.constexpr, TIMEOUT_NS: tl.constexpr, CLOCK: tl.constexpr):
    """Waits (bounded, OP_BARRIER) for FLAGS[s] >= epoch for every peer s (``_await`` without counts)."""
    _await(peers_ptr, peers_ptr, peers_ptr, RANK, W, WP, 1, 1, 1, 1, OFF_STATE, OFF_FLAGS, 0, False,
           TIMEOUT_NS, CLOCK)


@triton.jit
def _ce_signal_kernel(rows_from_ptr, peers_ptr, RANK, LO, HI, CNT_OFF, W: tl.constexpr, MODE: tl.constexpr,
                      OFF_CBLK: tl.constexpr = 0, CB: tl.constexpr = 32, NCB: tl.constexpr = 1,
                      NBP: tl.constexpr = 1):
    """MODE 0: ``HI - LO`` rows added to RCNT (int64 at byte offset CNT_OFF + 8*RANK) of every peer.
    MODE 1: for every source s != RANK and block j of CB tokens meeting [LO, HI): the block's rows
    below ``rows_from[s]`` within [LO, HI) added to s's CBLK[RANK, j] (NBP: blocks a chunk spans,
    a power of two)."""
    for d in range(W):
        if d != RANK:
            base = tl.load(peers_ptr + d)
            if MODE == 0:
                p = (base + CNT_OFF + RANK * 8).to(tl.pointer_type(tl.int64))
                tl.atomic_add(p, tl.zeros([], tl.int64) + HI - LO, sem="release", scope="sys")  # (HI may be a constexpr)
            else:
                n_s = tl.load(rows_from_ptr + d)
                j = LO // CB + tl.arange(0, NBP)
                lo = tl.maximum(j * CB, LO)
                hi = tl.minimum(tl.minimum((j + 1) * CB, HI), n_s)
                cnt = (hi - lo).to(tl.int64)
                ctr = (base + OFF_CBLK + (RANK * NCB + j) * 8).to(tl.pointer_type(tl.int64))
                tl.atomic_add(ctr, cnt, mask=(j < NCB) & (cnt > 0), sem="release", scope="sys")


@triton.jit
def _ce_fixup_kernel(part_ptr, rows_from_ptr, peers_ptr, RANK, H, W: tl.constexpr, T_MAX: tl.constexpr,
                     D: tl.constexpr, OFF_COMB: tl.constexpr, OFF_CBLK: tl.constexpr, CB: tl.constexpr,
                     NCB: tl.constexpr, BLOCK_D: tl.constexpr, CBP: tl.constexpr):
    """Program p: block j = H // CB + p of every source s != RANK: its rows [max(H, j*CB),
    min(rows_from[s], (j+1)*CB)) of ``part`` (``[W*T_MAX, D]``, row ``s*T_MAX + t``) stored into
    s's COMB[RANK, t] and added to s's CBLK[RANK, j] (CBP: CB as a power of two)."""
    DT: tl.constexpr = part_ptr.dtype.element_ty
    j = H // CB + tl.program_id(0)
    for s in range(W):
        if s != RANK:
            n_s = tl.load(rows_from_ptr + s)
            lo = tl.maximum(j * CB, H)
            hi = tl.minimum((j + 1) * CB, n_s)
            if hi > lo:
                base = tl.load(peers_ptr + s)
                t = lo + tl.arange(0, CBP)
                tm = t < hi
                src = part_ptr + (s * T_MAX + t).to(tl.int64) * D
                dst = tl.multiple_of((base + OFF_COMB).to(tl.pointer_type(DT)), 16) + (RANK * T_MAX + t).to(tl.int64) * D
                for c0 in range(0, D, BLOCK_D):
                    cols = c0 + tl.arange(0, BLOCK_D)
                    cm = tm[:, None] & (cols < D)[None, :]
                    tl.store(dst[:, None] + cols[None, :], tl.load(src[:, None] + cols[None, :], mask=cm), mask=cm)
                tl.debug_barrier()
                ctr = (base + OFF_CBLK + (RANK * NCB + j) * 8).to(tl.pointer_type(tl.int64))
                tl.atomic_add(ctr, (hi - lo).to(tl.int64), sem="release", scope="sys")
