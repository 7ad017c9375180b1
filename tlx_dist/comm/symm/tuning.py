"""Launch shapes of the exchange's kernels: tiles and grids of the row-moving kernels (``_shape``),
the one-launch combine's programs, the receiving programs of the overlapped receive copy."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .buffers import SymmBuffers


@functools.lru_cache(maxsize=None)
def _num_programs(device_str: str, per_sm: int = 4) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM on CUDA."""
    if device_str.startswith("cuda"):
        return per_sm * torch.cuda.get_device_properties(torch.device(device_str)).multi_processor_count
    return 2  # Triton interpreter: a couple of programs still exercises the persistent loops


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_WIDE_BELOW_BLOCKS = 256  # fewer row blocks than this (about 2 per H200 SM): wider, shorter tiles
_WIDEST = 2048


def _tiles(D: int, rows: Optional[int] = None, cols: int = 512) -> tuple[int, int]:
    """(BLOCK rows, BLOCK_D columns) of the row-moving kernels: ~4K-element tiles, 8 x 512 at the
    usual widths. Given the ``rows`` a launch walks, tiles get wider and shorter (up to 2 x 2048)
    while that leaves fewer than ``_WIDE_BELOW_BLOCKS`` row blocks: each program walks a row's
    column chunks one after another (load, then store to a peer), so at T = 128 rows and D = 7168 a
    8 x 512 tile gave 16 programs with 28 dependent copies each, and 2 x 2048 gives 64 with 8.
    ``cols``: the starting width (the send kernel starts at 1024, see ``_DEFAULT_SHAPES``)."""
    bd = min(cols, _next_pow2(D))
    br = max(1, 4096 // bd)
    if rows is not None:
        while br > 2 and bd < min(_WIDEST, _next_pow2(D)) and -(-rows // br) < _WIDE_BELOW_BLOCKS:
            bd, br = 2 * bd, br // 2
    return br, bd


def _grid(n_blocks: int, dev: torch.device, per_sm: int = 4) -> tuple[int]:
    return (max(1, min(n_blocks, _num_programs(str(dev), per_sm))),)


# Launch shapes of the row-moving kernels, for tuning sweeps (``bench/exchange_tiles.py``): kernel
# name ("send", "expand", "reduce_send", "reduce_recv") -> dict with any of BLOCK_ROWS, BLOCK_D
# (powers of two), num_warps, per_sm (programs per SM); "route" -> {"BLOCK_ROWS": tokens per route
# block}. Empty: the defaults
# (``_DEFAULT_SHAPES``, 4 warps). Every rank must set the same; set it between ops, not inside one.
LAUNCH_OVERRIDES: dict = {}


# Defaults per kernel (starting tile width, programs per SM), from the session-11 sweep on two H200s
# (bench/exchange_tiles.py, D=7168, graph-replayed, ranks aligned; bench/RESULTS.md): the send
# with 4 x 1024 tiles took 228.5 / 730.4 us at T=4096 / 16384 against 244.5 / 747.5 with 8 x 512;
# the reductions with 16 programs (64 warps) per SM combined in 230.1 / 876.9 against 247.3 / 931.7
# with 4. Small ops still widen their tiles (``_tiles``), so T=128 launches are unchanged.
_DEFAULT_SHAPES = {"send": (1024, 4), "reduce_send": (512, 16), "reduce_recv": (512, 16), "expand": (512, 4)}


def _shape(kind: str, D: int, rows: int, dev: torch.device) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK rows, BLOCK_D, num_warps, grid) of one launch of a row-moving kernel over ``rows``:
    ``_DEFAULT_SHAPES`` unless ``LAUNCH_OVERRIDES`` names the kernel."""
    cols, per_sm = _DEFAULT_SHAPES[kind]
    br, bd = _tiles(D, rows, cols)
    o = LAUNCH_OVERRIDES.get(kind) or {}
    br, bd = o.get("BLOCK_ROWS", br), o.get("BLOCK_D", bd)
    return br, bd, o.get("num_warps", 4), _grid(-(-rows // br), dev, o.get("per_sm", per_sm))


ROUTE_SMALL_T = 1024  # tokens up to which the route kernel takes 32-token blocks


def _recv_programs(bufs: SymmBuffers) -> int:
    """Receiving programs of an ``"overlap"`` send launch: one per SM (a quarter of the launch's
    programs; they are its last ones and wait only for peers' senders, who never wait for them),
    no more than there are RECV blocks. Session 9's first try used 33 with 8 x 512 tiles: ~8 GB/s
    each, the copy took longer than the transfer."""
    L = bufs.layout
    return max(1, min(_num_programs(str(bufs.device)) // 4, (L.world_size - 1) * L.recv_blocks))


def _recv_tile(bufs: SymmBuffers) -> dict:
    """The receiving programs' copy tile: a whole RECV block of rows (RB, as a power of two) by
    columns up to 16K elements a tile (32 KB of bf16 in flight per program)."""
    L = bufs.layout
    r = _next_pow2(L.recv_block)
    return dict(RCV_R=r, RCV_D=max(16, min(_next_pow2(L.hidden), 16384 // r)))


# The one-launch combine (``_comb_mode`` "overlap"): summing programs per SM and sending programs
# per SM (LAUNCH_OVERRIDES["comb_recv"] = dict(per_sm=..., send_per_sm=...) for sweeps). The
# launch's programs should all be resident at once (<= 64 registers a thread: 8 CTAs of 4 warps
# an SM), so the sum runs beside the transfer instead of after the senders retire. Two H200s,
# W=2, D=7168, E=64, K=8, graph-replayed (bench/exchange_tiles.py, session 16): 4 x 2 combined in
# 207.9 / 744.5 us at T=4096 / 16384 against 230.9 / 891.7 with two launches; 4 x 4 219.0 / 789.1,
# 2 x 4 284.4 / 915.4, 1 x 4 352.2 / 1164.0 (too few summing programs: the sum trails the transfer).
COMB_RECV_PER_SM = 4


COMB_SEND_PER_SM = 2


def _comb_recv_shape(bufs: SymmBuffers, T: int) -> tuple[int, int, int, int]:
    """(sending programs at most, summing programs, summing tile rows, columns) of a one-launch
    combine. A summing tile holds ~4096 / W elements per rank (W partial chunks in flight at ~64
    registers a thread); its work units are (COMB_BLOCK tokens, one column tile)."""
    L = bufs.layout
    o = LAUNCH_OVERRIDES.get("comb_recv") or {}
    sms = _num_programs(str(bufs.device), 1)
    rr_d = min(512, _next_pow2(L.hidden))
    rr_t = max(1, (4096 // max(2, L.world_size)) // rr_d)
    rr_t = 1 << (rr_t.bit_length() - 1)  # a power of two (W = 3, 6, ... would not give one)
    units = -(-max(T, 1) // L.comb_block) * -(-L.hidden // rr_d)
    # at most half the CTAs an SM holds: with the row form's reduce-send at <= 64 registers a thread
    # (tests/test_symm_compile.py) 32 / warps CTAs fit an SM (8 at 4 warps), so senders always find
    # room beside the summing programs, which wait for them
    warps = (LAUNCH_OVERRIDES.get("reduce_send") or {}).get("num_warps", 4)
    cap = max(1, min(4, 16 // warps))
    n_recv = max(1, min(units, min(cap, o.get("per_sm", COMB_RECV_PER_SM)) * sms))
    return o.get("send_per_sm", COMB_SEND_PER_SM) * sms, n_recv, rr_t, rr_d


# summing programs of the copy-engine combine per SM (at most 8: half of what an SM holds at 4 warps, so
# the chunks' signal kernels, which the summing programs wait for, always find room)
CE_SUM_PER_SM = 4
