"""Launch shapes of the exchange's kernels, from the buffers' :class:`ExchangeConfig` and the sizes of
each launch: tiles and grids of the row-moving kernels (:func:`launch_shape`), the route kernel's
token blocks, the receiving programs of the overlapped receive copy, the one-launch combine's and
the copy-engine combine's summing programs."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .buffers import SymmBuffers
from .config import Tile

__all__ = ["launch_shape", "route_block", "recv_role_grid", "recv_tile", "comb_recv_shape", "reduce_recv_shape"]


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
    """(BLOCK rows, BLOCK_D columns) of a sized-per-launch :class:`Tile`: ~4K-element tiles of up to
    ``cols`` columns. Given the ``rows`` a launch walks, tiles get wider and shorter (up to 2 x 2048)
    while that leaves fewer than ``_WIDE_BELOW_BLOCKS`` row blocks: each program walks a row's
    column chunks one after another (load, then store to a peer), so at T = 128 rows and D = 7168 a
    8 x 512 tile gives 16 programs with 28 dependent copies each, and 2 x 2048 gives 64 with 8."""
    bd = min(cols, _next_pow2(D))
    br = max(1, 4096 // bd)
    if rows is not None:
        while br > 2 and bd < min(_WIDEST, _next_pow2(D)) and -(-rows // br) < _WIDE_BELOW_BLOCKS:
            bd, br = 2 * bd, br // 2
    return br, bd


def _grid(n_blocks: int, dev: torch.device, per_sm: int = 4) -> tuple[int]:
    return (max(1, min(n_blocks, _num_programs(str(dev), per_sm))),)


def launch_shape(tile: Tile, D: int, rows: int, dev: torch.device) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK rows, BLOCK_D, num_warps, grid) of one launch of a row-moving kernel over ``rows``
    rows of D elements (see :class:`Tile`)."""
    br, bd = _tiles(D, rows, tile.cols) if tile.rows is None else (tile.rows, tile.cols)
    return br, bd, tile.warps, _grid(-(-rows // br), dev, tile.per_sm)


ROUTE_SMALL_T = 1024  # tokens up to which the route kernel takes 32-token blocks


def route_block(bufs: SymmBuffers, T: int, KP: int) -> int:
    """Tokens per block of the route kernel (``ExchangeConfig.route_block``, else): ~1024 slots a
    block (sorted in the kernel), whatever E, no more tokens than the buffers take; ops of up to
    ``ROUTE_SMALL_T`` tokens take 32-token blocks, so a small op runs on several programs."""
    L = bufs.layout
    return bufs.config.route_block or (min(32, _next_pow2(L.max_tokens)) if T <= ROUTE_SMALL_T
                                       else max(1, min(1024 // KP, _next_pow2(L.max_tokens))))


def recv_role_grid(bufs: SymmBuffers, T: int, bt: int) -> tuple[int, int]:
    """(sending, receiving programs) of a send launch whose last programs copy the other sources'
    rows as they land (``recv_mode`` "overlap"): one receiving program per SM (a quarter of the
    launch's programs; they wait only for peers' senders, who never wait for them), no more than
    there are RECV blocks -- fewer, narrower ones copied slower than the rows arrived."""
    L = bufs.layout
    n_recv = max(1, min(_num_programs(str(bufs.device)) // 4, (L.world_size - 1) * L.recv_blocks))
    return max(1, min(-(-T // bt), _num_programs(str(bufs.device)) - n_recv)), n_recv


def recv_tile(bufs: SymmBuffers) -> dict:
    """The receiving programs' copy tile: a whole RECV block of rows (RB, as a power of two) by
    columns up to 16K elements a tile (32 KB of bf16 in flight per program)."""
    L = bufs.layout
    r = _next_pow2(L.recv_block)
    return dict(RCV_R=r, RCV_D=max(16, min(_next_pow2(L.hidden), 16384 // r)))


def comb_recv_shape(bufs: SymmBuffers, T: int) -> tuple[int, int, int, int]:
    """(sending programs at most, summing programs, summing tile rows, columns) of a one-launch
    combine (``comb_mode`` "overlap"). Its programs should all be resident at once, so the sum runs
    beside the transfer instead of after the senders retire. A summing tile holds ~4096 / W
    elements per rank (W partial chunks in flight at ~64 registers a thread); its work units are
    (COMB_BLOCK tokens, one column tile)."""
    L, cfg = bufs.layout, bufs.config
    sms = _num_programs(str(bufs.device), 1)
    rr_d = min(512, _next_pow2(L.hidden))
    rr_t = max(1, (4096 // max(2, L.world_size)) // rr_d)
    rr_t = 1 << (rr_t.bit_length() - 1)  # a power of two (W = 3, 6, ... would not give one)
    units = -(-max(T, 1) // L.comb_block) * -(-L.hidden // rr_d)
    # at most half the CTAs an SM holds: with the row form's reduce-send at <= 64 registers a thread
    # (tests/test_symm_compile.py) 32 / warps CTAs fit an SM (8 at 4 warps), so senders always find
    # room beside the summing programs, which wait for them
    cap = max(1, min(4, 16 // cfg.reduce_send.warps))
    n_recv = max(1, min(units, min(cap, cfg.comb_sum_per_sm) * sms))
    return cfg.comb_send_per_sm * sms, n_recv, rr_t, rr_d


def reduce_recv_shape(bufs: SymmBuffers, T: int, blk: bool = False,
                      dense: bool = False) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK_T, BLOCK_D, num_warps, grid) of the reduce-receive kernel over T tokens. ``blk``: a work
    unit is one counter's tokens by one column tile, so no taller tile than that. ``dense`` (the
    copy-engine combine): its summing programs wait for one-program signal kernels on another stream,
    so they leave room for them on every SM -- ``ce_sum_per_sm`` programs an SM (16, the tile's
    usual count, filled every SM and starved the signals), tiles of at most 1024 elements a warp
    (a larger one took every register and left none for the signals: a ValueError names it)."""
    cfg = bufs.config
    br, bd, warps, grid = launch_shape(cfg.reduce_recv, bufs.layout.hidden, T, bufs.device)
    if blk:
        br = min(br, _next_pow2(bufs.layout.comb_block))
    if dense:
        if br * bd > 1024 * warps:
            raise ValueError(f"ExchangeConfig.reduce_recv: a {br} x {bd} tile at {warps} warps is too large for the "
                             "copy-engine combine, whose summing programs must leave room on every SM for the signal "
                             "kernels they wait for (at most 1024 elements a warp)")
        grid = (max(1, min(grid[0], _num_programs(str(bufs.device), cfg.ce_sum_per_sm))),)
    return br, bd, warps, grid
