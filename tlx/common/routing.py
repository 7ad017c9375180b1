"""One rank's expert-major layout of the router's (token, k) slots in one launch (Triton, every GPU).

Legend: T tokens, K top-k, S = T * K slots (slot s = t * K + k), E experts, N = S expert-major rows.
The fused experts read token rows by index in expert order (``tlx_dist.fused.fused_experts``); the
layout they need is a stable sort of the slots by expert plus the scheduler's tables. Done with
torch ops it is a radix sort (eight passes over int64 keys), a search, an ``arange``, a division, a
cast and the scheduler's prep kernel: about a dozen launches whose host work leaves the GPU idle
between the router and the first GEMM (``bench/_profile.gap_profile`` shows the gap).

``_expert_slots_kernel``, grid ``(E,)``, program ``e``:
  pass 1: histogram of every slot's expert (all E bins, so every program knows every count);
  pass 2: the slots of expert ``e`` in slot order (stable), written from row
          ``start_e = #{slots of experts < e}``: ``tok[row] = s // K``, ``order[row] = s``.
  From the counts, program ``e`` also writes ``offsets[e]`` (inclusive end row), the scheduler's
  ``tile_cum[e]`` (inclusive sum of ``cdiv(rows, BM)`` over experts ``<= e``; program 0 writes entry
  ``E``, which adds the padding pseudo-expert's tiles as the prep kernel does) and, from
  ``sched[ORDER_OFF]`` on (a multiple of 4 entries: 16-byte aligned), ``order[rank_e] = e``, the dW
  kernels' longest-first expert order (rank by count descending, ties by lower index, as
  ``tlx.common.scheduler._lpt_order_kernel``). Expert ids outside ``[0, E)`` (never from the router)
  are counted in no bin; program 0 places their slots after all experts' rows as padding rows that
  no kernel computes, so ``tok`` / ``order`` stay a permutation of the slots.
Cost: each program reads the S expert ids twice (L2-resident after the first program): at S = 131072
and E = 64 about 16 M loads, fewer bytes than the radix sort's eight passes over int64 keys move.
"""

import triton
import triton.language as tl
from tlx import c_launch as _c_launch


@triton.jit
def _expert_slots_kernel(idx_ptr, tok_ptr, order_ptr, offsets_ptr, sched_ptr, S, K, E, ORDER_OFF,
                         BM: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    bins = tl.arange(0, EP)
    counts = tl.zeros((EP,), dtype=tl.int32)
    for s0 in range(0, S, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        v = tl.load(idx_ptr + s, mask=s < S, other=E)
        v = tl.where((v >= 0) & (v < E), v, E).to(tl.int32)  # range check before the cast: bin E, never read
        counts += tl.histogram(v, EP)
    counts = tl.where(bins < E, counts, 0)
    start = tl.sum(tl.where(bins < e, counts, 0), axis=0)
    cnt = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    tl.store(offsets_ptr + e, start + cnt)
    tiles = (counts + BM - 1) // BM
    tl.store(sched_ptr + e, tl.sum(tl.where(bins <= e, tiles, 0), axis=0))
    total = tl.sum(counts, axis=0)
    if e == 0:  # tile_cum[E] adds the padding pseudo-expert's tiles (the slots of out-of-range ids)
        tl.store(sched_ptr + E, tl.sum(tiles, axis=0) + (S - total + BM - 1) // BM)
    before = ((counts > cnt) | ((counts == cnt) & (bins < e))) & (bins < E)
    rank = tl.sum(before.to(tl.int32), axis=0)
    tl.store(sched_ptr + ORDER_OFF + rank, e)
    row = start
    n2 = tl.where(cnt > 0, S, 0)
    for s0 in range(0, n2, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        v = tl.load(idx_ptr + s, mask=s < S, other=-1)
        hit = (v == e) & (s < S)
        pos = row + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(tok_ptr + pos, (s // K).to(tl.int32), mask=hit)
        tl.store(order_ptr + pos, s.to(tl.int64), mask=hit)
        row += tl.sum(hit.to(tl.int32), axis=0)
    # Ids outside [0, E) (never from the router): program 0 puts their slots after every expert's
    # rows, in slot order, as padding rows (never computed), so tok / order stay a full permutation.
    n3 = tl.where((e == 0) & (total < S), S, 0)
    row = total
    for s0 in range(0, n3, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        v = tl.load(idx_ptr + s, mask=s < S, other=0)
        hit = ((v < 0) | (v >= E)) & (s < S)
        pos = row + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(tok_ptr + pos, (s // K).to(tl.int32), mask=hit)
        tl.store(order_ptr + pos, s.to(tl.int64), mask=hit)
        row += tl.sum(hit.to(tl.int32), axis=0)


_c_launch(_expert_slots_kernel)
