"""Grouped-GEMM tile scheduler, shared by the portable, Hopper and Blackwell kernels.

Legend: N rows (expert-major), E experts, BM rows per tile, ``offsets_E`` cumulative end row per
expert (int32, on the device). Expert ``e`` owns rows ``[offsets[e-1], offsets[e])``; rows at or past
``offsets[E-1]`` are padding and form a pseudo-expert ``E`` whose output is zero.

Forward / dX (ragged M). A tiny prep kernel turns the device offsets into ``tile_cum_E1[e]``, the
inclusive cumulative count of BM-row tiles of experts ``0..e`` (entry ``E`` counts the padding tiles).
A tile id ``t`` of the persistent loop maps to ``m_glob = t // tiles_n`` and ``n = t % tiles_n``;
``m_glob`` is found in ``tile_cum_E1`` by a fixed-step binary search (scalar loads that stay in L1).
The number of tiles is ``tile_cum_E1[E] * tiles_n``, read on the device: the host only bounds it
(``N // BM + E + 1`` m-tiles), so nothing syncs and a CUDA graph can capture the launch.

Weight gradient (ragged K). Every expert has the same ``tiles_m * tiles_n`` output tiles, so
``e = t // (tiles_m * tiles_n)`` needs no search; the K loop runs over the expert's rows.
Under imbalanced routing the tiles of a heavy expert are far longer than the rest; a static
round-robin over tiles then leaves the SMs holding them busy long after the others are done. So the
Hopper kernel walks the dW tiles longest-first (LPT): ``_lpt_order_kernel`` ranks the experts by row
count on the device (ties by index, so the order is deterministic) into ``order_E``, tile ``t``
belongs to expert ``order_E[t // (tiles_m * tiles_n)]``, and each CTA claims its next tile from an
atomic counter when its producer is done issuing the current one (greedy list scheduling). Every
tile is still computed whole by one CTA in a fixed K order: results are bitwise deterministic.

Ragged TMA. One descriptor over a packed ``[N, C]`` tensor can be bounded to the rows of one expert:
the descriptor is 4-D with dims ``[2^31-ish, 2^31-ish, 2^30, C]`` and strides ``[2^34 - s, s, s, 1]``
(``s`` the row stride in elements); the coordinates ``(2^30, lo + cnt, 2^30 - cnt + row, col)`` land on
row ``lo + row`` (the leading term wraps to zero modulo 2^64) and the third coordinate runs out of
bounds exactly at ``row >= cnt``, so TMA zero-fills loads and drops stores past the expert's end.
The host side builds it (``tlx_dist.grouped_gemm.host.ragged_descriptor``).

Memory safety. Offsets come from the caller and are never read on the host (that would sync), so
the device guards them, in two layers. (1) The prep kernel (one program, run before every launch)
writes ``safe_E = min(N, running max(max(0, offsets)))`` -- clamped to the operand's rows and made
non-decreasing, so experts own disjoint row ranges inside ``[0, N]`` and the tile count stays under
the host's bound -- and ORs into a device flag what was wrong with the raw offsets (negative, past
``N``, decreasing); the kernels then run on ``safe_E``. Valid offsets pass through unchanged.
(2) ``expert_rows`` clamps every row range into ``[0, N]`` itself, so even a kernel handed raw
offsets cannot address a row outside its operand: pointer loads are masked to the range, TMA loads
through 2-D/3-D descriptors are bounded by the tensor's extent, and ragged-descriptor loads and
stores by the (clamped) range.
"""

import triton
import triton.language as tl
from tlx import c_launch as _c_launch

RAGGED_BILLION = tl.constexpr(1 << 30)
# Bits of the offsets flag (tlx_dist.grouped_gemm.guard reads it): what a caller's offsets did.
OFFSETS_NEGATIVE = tl.constexpr(1)
OFFSETS_PAST_END = tl.constexpr(2)
OFFSETS_DECREASING = tl.constexpr(4)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _grouped_tile_prep_kernel(offsets_ptr, safe_ptr, tile_cum_ptr, flag_ptr, E, N_ROWS, BM: tl.constexpr,
                              E1_P2: tl.constexpr, TILES: tl.constexpr, PHASE: tl.constexpr,
                              VIRT: tl.constexpr):
    """Offsets guard (+ tile counts), one program. ``offsets_ptr`` int32 or int64, ``E >= 1``.

    safe[e] = min(N, max(0, offsets[0..e]))  (int32; clamped to the rows, made non-decreasing)
    flag   |= OFFSETS_NEGATIVE | OFFSETS_PAST_END | OFFSETS_DECREASING for what the raw offsets did
    tile_cum[e] = sum_{j<=e} cdiv(rows_j, BM) for e in [0, E] over the safe rows (TILES only);
    rows_E = N - safe[E-1] is the padding pseudo-expert.
    PHASE = -1: every expert (VIRT unused). PHASE >= 0 (the EP overlap's phased launches; E = VIRT * experts "virtual experts", each
    expert's rows cut in VIRT consecutive runs, run 1 of each being this rank's own rows): only the
    runs of that phase get tiles -- phase 0 the runs ``e % VIRT == 1``, phase 1 the others and the
    padding -- so one launch per phase walks exactly its runs' tiles."""
    idx = tl.arange(0, E1_P2)
    in_e = idx < E
    # Compared in int64: an int64 offset past 2**31 must not wrap into range before it is checked.
    raw = tl.load(offsets_ptr + idx, mask=in_e, other=0).to(tl.int64)
    raw_prev = tl.load(offsets_ptr + idx - 1, mask=(idx >= 1) & (idx <= E), other=0).to(tl.int64)
    neg = tl.max((in_e & (raw < 0)).to(tl.int32), axis=0)
    past = tl.max((in_e & (raw > N_ROWS)).to(tl.int32), axis=0)
    dec = tl.max((in_e & (idx >= 1) & (raw < raw_prev)).to(tl.int32), axis=0)
    bits = neg * OFFSETS_NEGATIVE + past * OFFSETS_PAST_END + dec * OFFSETS_DECREASING
    tl.atomic_or(flag_ptr, bits, mask=bits != 0)
    # Clamping commutes with the running max, so this is the running max of the clamped offsets.
    safe = tl.associative_scan(tl.minimum(tl.maximum(raw, 0), N_ROWS), 0, _max_combine)
    tl.store(safe_ptr + idx, safe.to(tl.int32), mask=in_e)
    if TILES:
        safe_prev = tl.associative_scan(tl.minimum(tl.maximum(raw_prev, 0), N_ROWS), 0, _max_combine)
        cnt = tl.where(in_e, safe - safe_prev, tl.where(idx == E, N_ROWS - safe_prev, 0))
        if PHASE == 0:
            cnt = tl.where(in_e & (idx % VIRT == 1), cnt, 0)
        elif PHASE == 1:
            cnt = tl.where(in_e & (idx % VIRT == 1), 0, cnt)
        m_tiles = ((cnt + BM - 1) // BM).to(tl.int32)
        cum = tl.cumsum(m_tiles, axis=0)
        tl.store(tile_cum_ptr + idx, cum, mask=idx <= E)


@triton.jit
def _expert_counts(offsets_ptr, e, E):
    ends = tl.load(offsets_ptr + e, mask=e < E, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=(e >= 1) & (e < E), other=0)
    return tl.maximum(ends - starts, 0)


@triton.jit
def _lpt_order_kernel(offsets_ptr, order_ptr, E, BLOCK: tl.constexpr):
    """order[r] = the expert with the r-th most rows (ties: lower index first), r in [0, E).
    grid = cdiv(E, BLOCK); rank of e = #{j : cnt_j > cnt_e or (cnt_j == cnt_e and j < e)}."""
    ei = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cnt_i = _expert_counts(offsets_ptr, ei, E)
    rank = tl.zeros((BLOCK,), dtype=tl.int32)
    for j0 in range(0, E, BLOCK):
        ej = j0 + tl.arange(0, BLOCK)
        cnt_j = _expert_counts(offsets_ptr, ej, E)
        before = (cnt_j[None, :] > cnt_i[:, None]) | ((cnt_j[None, :] == cnt_i[:, None]) & (ej[None, :] < ei[:, None]))
        before = before & (ej[None, :] < E)
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, ei, mask=ei < E)


@triton.jit
def _search_expert(tile_cum_ptr, E, m_glob, SEARCH_STEPS: tl.constexpr):
    # Smallest e in [0, E] with tile_cum[e] > m_glob. Branch-free, fixed trip count
    # (SEARCH_STEPS >= ceil(log2(E + 1)) + 1); once lo == hi the answer is stable.
    lo = m_glob * 0
    hi = lo + E
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(tile_cum_ptr + mid) <= m_glob
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def expert_rows(offsets_ptr, e, E, N_ROWS):
    """(first row, row count) of expert ``e``; ``e == E`` is the padding pseudo-expert. The range is
    clamped into ``[0, N_ROWS]`` here, on the device, whatever the offsets hold: no tile of any kernel
    can then load or store a row outside its operand (the prep kernel's safe offsets are already in
    range; this also covers a kernel handed a caller's offsets directly)."""
    lo = tl.load(offsets_ptr + tl.maximum(e - 1, 0))
    lo = tl.where(e > 0, lo, 0)
    hi = tl.load(offsets_ptr + tl.minimum(e, E - 1))
    hi = tl.where(e < E, hi, N_ROWS)
    lo = tl.minimum(tl.maximum(lo, 0), N_ROWS)
    hi = tl.minimum(tl.maximum(hi, lo), N_ROWS)
    return lo, hi - lo


@triton.jit
def mm_num_tiles(tile_cum_ptr, E, tiles_n):
    return tl.load(tile_cum_ptr + E) * tiles_n


@triton.jit
def mm_tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS: tl.constexpr):
    """Tile ``t`` of the ragged-M forms -> (expert, first row, rows, m-tile within expert, n-tile)."""
    m_glob = t // tiles_n
    n_idx = t % tiles_n
    e = _search_expert(tile_cum_ptr, E, m_glob, SEARCH_STEPS)
    before = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
    before = tl.where(e > 0, before, 0)
    lo, cnt = expert_rows(offsets_ptr, e, E, N_ROWS)
    return e, lo, cnt, m_glob - before, n_idx


@triton.jit
def wgrad_tile(t, offsets_ptr, E, N_ROWS, tiles_m, tiles_n):
    """Tile ``t`` of the weight gradient -> (expert, first row, rows, m-tile, n-tile)."""
    per_e = tiles_m * tiles_n
    e = t // per_e
    r = t % per_e
    lo, cnt = expert_rows(offsets_ptr, e, E, N_ROWS)
    return e, lo, cnt, r // tiles_n, r % tiles_n


@triton.jit
def group_raster(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile ``t`` of a ``tiles_m x tiles_n`` grid -> (m, n), walking GROUP_M rows of tiles column by
    column, so the tiles in flight at once share GROUP_M A row-blocks and a few B column-blocks in L2
    instead of all of B. GROUP_M == 1 is the plain row-major walk."""
    if GROUP_M == 1:
        m = t // tiles_n
        n = t % tiles_n
    else:
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        rows = tl.minimum(tiles_m - first_m, GROUP_M)
        r = t % per_group
        m = first_m + r % rows
        n = r // rows
    return m, n


@triton.jit
def mm_tile_grouped(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """``mm_tile`` with the GROUP_M raster over the global m-tiles (groups may straddle experts)."""
    m_glob, n_idx = group_raster(t, tl.load(tile_cum_ptr + E), tiles_n, GROUP_M)
    e = _search_expert(tile_cum_ptr, E, m_glob, SEARCH_STEPS)
    before = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
    before = tl.where(e > 0, before, 0)
    lo, cnt = expert_rows(offsets_ptr, e, E, N_ROWS)
    return e, lo, cnt, m_glob - before, n_idx


@triton.jit
def wgrad_tile_lpt(t, order_ptr, offsets_ptr, E, N_ROWS, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Like ``wgrad_tile`` but tile ``t`` walks the experts longest-first (``order_E``) and the
    tiles of one expert in the GROUP_M raster."""
    per_e = tiles_m * tiles_n
    e = tl.load(order_ptr + t // per_e)
    mt, nt = group_raster(t % per_e, tiles_m, tiles_n, GROUP_M)
    lo, cnt = expert_rows(offsets_ptr, e, E, N_ROWS)
    return e, lo, cnt, mt, nt


@triton.jit
def ragged_coords(lo, cnt, row):
    """The three leading coordinates of a ragged 4-D descriptor for row ``row`` of the slice
    ``[lo, lo + cnt)`` (see the module docstring)."""
    return RAGGED_BILLION, lo + cnt, RAGGED_BILLION - cnt + row


# ---------------------------------------------------------------- one kernel for fwd / dX / dW
# The tile walk every persistent grouped-GEMM kernel shares (Hopper, Blackwell, AMD), per form:
# WGRAD (dW: E x M-tiles x N-tiles, K = the expert's rows) or mm (fwd / dX: tile_cum binary search).

@triton.jit
def _tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM: tl.constexpr,
          WGRAD: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    if WGRAD:
        e, lo, cnt, mt, nt = wgrad_tile(t, offsets_ptr, E, N_ROWS, tl.cdiv(M_DIM, BM), tiles_n)
    else:
        e, lo, cnt, mt, nt = mm_tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS)
    return e, lo, cnt, mt, nt


@triton.jit
def _num_tiles(tile_cum_ptr, E, M_DIM, tiles_n, BM: tl.constexpr, WGRAD: tl.constexpr):
    if WGRAD:
        n = E * tl.cdiv(M_DIM, BM) * tiles_n
    else:
        n = mm_num_tiles(tile_cum_ptr, E, tiles_n)
    return n


@triton.jit
def _k_steps(e, cnt, E, K_DIM, BK: tl.constexpr, WGRAD: tl.constexpr):
    # mm: the padding pseudo-expert loads nothing; wgrad: the K range is the expert's rows.
    if WGRAD:
        n = tl.cdiv(cnt, BK)
    else:
        n = tl.where(e < E, tl.cdiv(K_DIM, BK), 0)
    return n


@triton.jit
def _tile_any(t, tile_cum_ptr, offsets_ptr, order_ptr, E, N_ROWS, M_DIM, tiles_n, BM: tl.constexpr,
              WGRAD: tl.constexpr, DYNAMIC: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP_M: tl.constexpr):
    if WGRAD and DYNAMIC:
        e, lo, cnt, mt, nt = wgrad_tile_lpt(t, order_ptr, offsets_ptr, E, N_ROWS, tl.cdiv(M_DIM, BM), tiles_n,
                                            GROUP_M)
    elif WGRAD or GROUP_M == 1:
        e, lo, cnt, mt, nt = _tile(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, M_DIM, tiles_n, BM, WGRAD, SEARCH_STEPS)
    else:
        e, lo, cnt, mt, nt = mm_tile_grouped(t, tile_cum_ptr, offsets_ptr, E, N_ROWS, tiles_n, SEARCH_STEPS, GROUP_M)
    return e, lo, cnt, mt, nt


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_grouped_tile_prep_kernel)
_c_launch(_lpt_order_kernel)
