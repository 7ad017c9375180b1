"""The copy-engine row form's transport (``ExchangeConfig.copy_engine``, ``policy.ce_mode``): the
dispatch's token rows and the combine's partial rows cross by the GPU's copy engines
(``tlx_dist/comm/copy_engine.py``: ``cuMemcpyAsync`` into the peer's symmetric region) in the dense
layout -- token t of source s at receive row ``s*T_max + t`` on every rank, so a rank's rows are
one run per peer -- ordered with the op protocol by the one-program kernels of
``tlx/comm/copy_engine.py``. The copy engines leave every SM to the kernels; a copy on a capturing
stream becomes a memcpy node of the CUDA graph.

The combine's copies (:func:`ce_chunks`) are chunks of ``ce_chunk_rows`` rows, the last one cut in
halves down to ``ce_tail_rows``: the sum of a chunk starts as soon as its signal lands, and each copy
costs a gap on the copy engine and a slower start, so few large copies, and small ones last, so
that the sum left after the last copy is a short one.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import copy_engine
from .buffers import SymmBuffers
from .handle import SymmHandle
from .launch import clock, kernels, rcnt_off
from .tuning import _next_pow2

__all__ = ["ce_ready", "ce_send_rows", "ce_chunks", "ce_send_partials"]


def ce_ready(bufs: SymmBuffers) -> None:
    """On the op's stream, before its copies fork off it: waits for every peer's readiness."""
    L = bufs.layout
    kernels(bufs.device)._ce_ready_kernel[(1,)](bufs.peers, bufs.rank, W=L.world_size, WP=_next_pow2(L.world_size),
                                                OFF_STATE=L.off_state, OFF_FLAGS=L.off_flags,
                                                TIMEOUT_NS=bufs.timeout_ns, CLOCK=clock(), num_warps=1)


def ce_send_rows(bufs: SymmBuffers, x_TD: torch.Tensor, region: int) -> None:
    """The copy-engine dispatch's rows (on the stream it is called on): this rank's T token rows,
    one copy per peer d, to rows ``[RANK*T_max, RANK*T_max + T)`` of d's region ``region``; then one
    program adds T to d's region counter RCNT[region, RANK] (``launch.rows_wait`` waits for it)."""
    L, r = bufs.layout, bufs.rank
    T, D, es = x_TD.shape[0], L.hidden, L.dtype.itemsize
    row0 = L.off_rows + region * L.rows_region_bytes + r * L.max_tokens * D * es
    for d in range(L.world_size):
        if d != r:
            copy_engine.copy_bytes(bufs.device, bufs.peer_ptrs[d] + row0, x_TD.data_ptr(), T * D * es)
    kernels(bufs.device)._ce_signal_kernel[(1,)](bufs.peers, bufs.peers, r, 0, T, rcnt_off(L, region),
                                                 W=L.world_size, MODE=0, num_warps=1)


def ce_chunks(H: int, CB: int, rows: int, tail: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of the combine's copies over H rows: chunks of ``rows``
    (``ExchangeConfig.ce_chunk_rows``), the last one cut in halves, each half's second half again,
    down to ``tail`` rows (``ce_tail_rows``; 0: not cut), so the sum that trails the last copy is a
    short one. Every bound but H is a multiple of CB (a chunk's signal counts whole token blocks but
    its first and last)."""
    if H <= 0:
        return []
    c = max(CB, rows // CB * CB)
    out = [(lo, min(H, lo + c)) for lo in range(0, H, c)]
    if tail:
        lo, hi = out.pop()
        while hi - lo > max(tail, CB) and (hi - lo) // 2 // CB > 0:
            mid = lo + (hi - lo) // 2 // CB * CB
            out.append((lo, mid))
            lo = mid
        out.append((lo, hi))
    return out


def ce_send_partials(bufs: SymmBuffers, part_RD: torch.Tensor, h: SymmHandle) -> Optional[torch.cuda.Event]:
    """The copy-engine combine's transfer, after what the current stream enqueued: for every source
    s != RANK, the partial rows ``part_RD[s*T_max + t]`` of t < H (H = this rank's own token count:
    the host's estimate of s's, which it does not know without a sync) go to s's COMB[RANK, t] in
    chunks (``ce_chunks``) on the side stream; each chunk's signal (``_ce_signal_kernel`` MODE 1) runs
    on a second stream as soon as its copy is done, so the copies never wait for a launch. A source
    with more than H tokens gets the rest by ``_ce_fixup_kernel`` (SM stores); rows past a source's
    count are copied and never read. Returns the event to join (None where it ran in line: the
    emulated world and the interpreter, whose ranks run one after another)."""
    L, r, dev = bufs.layout, bufs.rank, bufs.device
    W, T_max, D, es, CB = L.world_size, L.max_tokens, L.hidden, L.dtype.itemsize, L.comb_block
    k = kernels(dev)
    H = min(h.num_tokens, T_max)
    chunks = ce_chunks(H, CB, bufs.config.ce_chunk_rows, bufs.config.ce_tail_rows)
    nbp = _next_pow2(max([hi - lo for lo, hi in chunks] + [1]) // CB + 2)
    inline = dev.type != "cuda" or bufs.backend in ("emulated", "local")
    side = sig = None
    if not inline:
        if bufs._side_stream is None:
            bufs._side_stream = torch.cuda.Stream(device=dev)
        if bufs._ce_sig_stream is None:
            bufs._ce_sig_stream = torch.cuda.Stream(device=dev)
        cur = torch.cuda.current_stream(dev)
        side, sig = bufs._side_stream, bufs._ce_sig_stream
        side.wait_stream(cur)
        sig.wait_stream(cur)
    on = (lambda stream: contextlib.nullcontext()) if inline else torch.cuda.stream
    part = part_RD.data_ptr()
    comb = L.off_comb + r * T_max * D * es

    for lo, hi in chunks:
        with on(side):
            for s in range(W):
                if s != r:
                    copy_engine.copy_bytes(dev, bufs.peer_ptrs[s] + comb + lo * D * es,
                                           part + (s * T_max + lo) * D * es, (hi - lo) * D * es)
        if not inline:
            ev = torch.cuda.Event()
            ev.record(side)
            sig.wait_event(ev)
        with on(sig):
            k._ce_signal_kernel[(1,)](h.rows_from_W, bufs.peers, r, lo, hi, 0, W=W, MODE=1, OFF_CBLK=L.off_cblk,
                                      CB=CB, NCB=L.comb_blocks, NBP=nbp, num_warps=1)
    if H < T_max:
        with on(sig):
            k._ce_fixup_kernel[(L.comb_blocks - H // CB,)](part_RD, h.rows_from_W, bufs.peers, r, H, W=W,
                                                             T_MAX=T_max, D=D, OFF_COMB=L.off_comb,
                                                             OFF_CBLK=L.off_cblk, CB=CB, NCB=L.comb_blocks,
                                                             BLOCK_D=min(256, _next_pow2(D)), CBP=_next_pow2(CB))
    if inline:
        return None
    sig.wait_stream(side)
    done = torch.cuda.Event()
    done.record(sig)
    for t in (part_RD, h.rows_from_W):
        t.record_stream(side)
        t.record_stream(sig)
    return done
