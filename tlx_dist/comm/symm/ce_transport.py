"""The copy-engine row form's transport (``policy._ce_mode``): the dispatch's token rows and the
combine's partial rows cross by the GPU's copy engines (``tlx_dist/comm/copy_engine.py``) in the
dense layout, ordered with the op protocol by the one-program kernels of ``tlx/comm/copy_engine.py``."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import copy_engine
from . import tuning
from .buffers import SymmBuffers
from .handle import SymmHandle
from .launch import _clock, _kernels, _rcnt_off
from .tuning import _next_pow2


# The combine's copies: chunks of CE_CHUNK_ROWS rows, the last one cut in halves down to CE_TAIL_ROWS
# (H = 16384: 4096 x 3, 2048, 1024, 512, 512; H = 4096: 2048, 1024, 512, 512). The sum starts on a chunk
# as soon as its signal lands; each copy costs a gap of ~2.3 us on the copy engine and a slower start, so
# few large copies, and small ones last, so that the sum left after the last copy is a short one. Two
# H200s, D=7168, graph-replayed, ranks aligned (x2_s48), T=16384 / 4096 combined in: 2048-row chunks
# (the earlier default) 672.2-672.8 / 192.4-193.4 us; 4096 uncut 689.6-690.5 / 233.3-234.1; 3072
# 661.0-662.3 / 197.2-198.9; 4096 cut to 1024 648.0-648.8 / 189.1-190.1; 4096 cut to 512 645.5-647.2
# (362-363 GB/s) / 187.4-188.2.
CE_CHUNK_ROWS, CE_TAIL_ROWS = 4096, 512


def _ce_ready(bufs: SymmBuffers) -> None:
    """On the op's stream, before its copies fork off it: waits for every peer's readiness."""
    L = bufs.layout
    _kernels(bufs.device)._ce_ready_kernel[(1,)](bufs.peers, bufs.rank, W=L.world_size, WP=_next_pow2(L.world_size),
                                                 OFF_STATE=L.off_state, OFF_FLAGS=L.off_flags,
                                                 TIMEOUT_NS=bufs.timeout_ns, CLOCK=_clock(), num_warps=1)


def _ce_send_rows(bufs: SymmBuffers, x_TD: torch.Tensor, region: int) -> None:
    """The copy-engine dispatch's rows (on the stream it is called on): this rank's T token rows,
    one copy per peer d, to rows ``[RANK*T_max, RANK*T_max + T)`` of d's region ``region``; then one
    program adds T to d's region counter RCNT[region, RANK] (``_rows_wait`` waits for it)."""
    L, r = bufs.layout, bufs.rank
    T, D, es = x_TD.shape[0], L.hidden, L.dtype.itemsize
    row0 = L.off_rows + region * L.rows_region_bytes + r * L.max_tokens * D * es
    for d in range(L.world_size):
        if d != r:
            copy_engine.copy_bytes(bufs.device, bufs.peer_ptrs[d] + row0, x_TD.data_ptr(), T * D * es)
    _kernels(bufs.device)._ce_signal_kernel[(1,)](bufs.peers, bufs.peers, r, 0, T, _rcnt_off(L, region),
                                                  W=L.world_size, MODE=0, num_warps=1)


def _ce_chunks(H: int, CB: int, rows: Optional[int] = None, tail: Optional[int] = None) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of the combine's copies over H rows: chunks of ``rows`` (default
    ``CE_CHUNK_ROWS``; ``LAUNCH_OVERRIDES["ce"]["chunk_rows"]``), the last one cut in halves, each
    half's second half again, down to ``tail`` rows (default ``CE_TAIL_ROWS``;
    ``LAUNCH_OVERRIDES["ce"]["tail_rows"]``, 0: not cut), so the sum that trails the last copy is a
    short one. Every bound but H is a multiple of CB (a chunk's signal counts whole token blocks but
    its first and last)."""
    if H <= 0:
        return []
    c = max(CB, (CE_CHUNK_ROWS if rows is None else rows) // CB * CB)
    tail = CE_TAIL_ROWS if tail is None else tail
    out = [(lo, min(H, lo + c)) for lo in range(0, H, c)]
    if tail:
        lo, hi = out.pop()
        while hi - lo > max(tail, CB) and (hi - lo) // 2 // CB > 0:
            mid = lo + (hi - lo) // 2 // CB * CB
            out.append((lo, mid))
            lo = mid
        out.append((lo, hi))
    return out


def _ce_send_partials(bufs: SymmBuffers, part_RD: torch.Tensor, h: SymmHandle) -> Optional[torch.cuda.Event]:
    """The copy-engine combine's transfer, after what the current stream enqueued: for every source
    s != RANK, the partial rows ``part_RD[s*T_max + t]`` of t < H (H = this rank's own token count:
    the host's estimate of s's, which it does not know without a sync) go to s's COMB[RANK, t] in
    chunks (``_ce_chunks``) on the side stream; each chunk's signal (``_ce_signal_kernel`` MODE 1) runs
    on a second stream as soon as its copy is done, so the copies never wait for a launch. A source
    with more than H tokens gets the rest by ``_ce_fixup_kernel`` (SM stores); rows past a source's
    count are copied and never read. Returns the event to join (None where it ran in line: the
    emulated world and the interpreter, whose ranks run one after another)."""
    L, r, dev = bufs.layout, bufs.rank, bufs.device
    W, T_max, D, es, CB = L.world_size, L.max_tokens, L.hidden, L.dtype.itemsize, L.comb_block
    k = _kernels(dev)
    H = min(h.num_tokens, T_max)
    o = tuning.LAUNCH_OVERRIDES.get("ce") or {}
    chunks = _ce_chunks(H, CB, o.get("chunk_rows"), o.get("tail_rows"))
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
