"""The exchange's mode policy: which form each op of a buffer set takes, resolved at its first use
and kept for its life -- the row form's receive copy (``_recv_mode``), the combine's sum
(``_comb_mode``), the copy-engine row form (``_ce_mode``) -- and the overlapped send's SM budget."""

from __future__ import annotations

import math
import os

import torch

from .. import copy_engine
from .buffers import SymmBuffers


ENV_OVERLAP_SMS = "TLX_DIST_EP_OVERLAP_SMS"
# SMs the overlapped dispatch's row send keeps while the gate/up GEMM computes this rank's own rows
# on the others (the send's programs; the GEMM's first launch takes the rest).
OVERLAP_SMS = 32


def overlap_sms() -> int:
    """The SM budget of the overlapped send (``TLX_DIST_EP_OVERLAP_SMS``, default ``OVERLAP_SMS``)."""
    v = os.environ.get(ENV_OVERLAP_SMS)
    if v is None:
        return OVERLAP_SMS
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_OVERLAP_SMS}={v!r} must be a positive integer (SMs of the overlapped send)")
    return n


ENV_RECV_OVERLAP = "TLX_DIST_RECV_OVERLAP"
# The overlapped receive copy pays off from this many tokens per rank (the buffers' T_max) up.
# Two H200s, D=7168, E=64, K=8, graph-replayed dispatch (bench/RESULTS.md, session 10): T=4096
# 274 -> 310 us (the receiving programs slow the senders more than the copy they hide), T=16384
# 862 -> 758 us (272 -> 309 GB/s).
RECV_OVERLAP_MIN_TOKENS = 8192


def _recv_mode(bufs: SymmBuffers) -> str:
    """Where the row form copies the other sources' rows out of RECV (``tlx/comm/exchange.py``):
    ``"overlap"`` (real ranks over peer pointers with T_max >= ``RECV_OVERLAP_MIN_TOKENS``: extra
    programs of the send kernel, block by block as rows land), ``"blocks"`` (the emulated world,
    whose ranks launch one after another, and one rank: the same block-by-block copy, in the expand
    kernel) or ``"after"`` (the NVSHMEM route, and smaller real-rank buffers: the expand kernel,
    after the op's rows all arrived). ``TLX_DIST_RECV_OVERLAP=1`` / ``0`` forces overlap on / off
    for real ranks over peer pointers (default ``auto``: by T_max); like every ``TLX_DIST_*``
    setting it must be the same on every rank (senders and receivers must agree on the mode: a
    mismatch ends in a wait timeout or stale arrival counters). Resolved at a buffer set's first
    dispatch (checked before any signal) and kept for its life."""
    mode = getattr(bufs, "_recv_mode", None)
    if mode is not None:
        return mode
    if bufs.use_nvshmem:
        mode = "after"
    elif bufs.backend in ("emulated", "local") or bufs.world_size == 1:
        mode = "blocks"
    else:
        force = os.environ.get(ENV_RECV_OVERLAP, "auto")
        if force not in ("auto", "0", "1"):
            raise ValueError(f"{ENV_RECV_OVERLAP}={force!r}: expected auto, 0 or 1")
        if force == "auto":
            mode = "overlap" if bufs.layout.max_tokens >= RECV_OVERLAP_MIN_TOKENS else "after"
        else:
            mode = "overlap" if force == "1" else "after"
    bufs._recv_mode = mode
    return mode


ENV_COMB_OVERLAP = "TLX_DIST_COMB_OVERLAP"


def _comb_mode(bufs: SymmBuffers) -> str:
    """How a combine's source side sums the partial rows (``tlx/comm/exchange.py``, CBLK):
    ``"overlap"`` (real ranks over peer pointers on CUDA: for the row form of 16-bit rows -- the
    fused EP pipeline's combine -- the reduce-send launch's first programs sum each block of
    ``comb_block`` tokens as its partial rows land, overlapping the transfer, and the combine is one
    launch; the expanded form and 32/64-bit rows, whose reduce-send holds too many registers for
    programs to wait beside it, run as "after"), ``"blocks"`` (the emulated world, whose ranks
    launch one after another, and one rank: the same per-block counters, summed by the
    reduce-receive kernel after the sends) or ``"after"`` (the NVSHMEM route and ROCm: one ARRIVE
    count per rank, then the reduce-receive kernel).
    ``TLX_DIST_COMB_OVERLAP=0`` keeps real ranks over peer pointers on ``"after"`` (default ``auto``
    / ``1``: overlap); like every ``TLX_DIST_*`` setting it must be the same on every rank.
    Resolved at a buffer set's first combine and kept for its life."""
    mode = getattr(bufs, "_comb_mode", None)
    if mode is not None:
        return mode
    if bufs.use_nvshmem:
        mode = "after"
    elif bufs.backend in ("emulated", "local") or bufs.world_size == 1:
        mode = "blocks"
    elif torch.version.hip is not None:  # (waves per CU differ: the co-residency above is unchecked there)
        mode = "after"
    else:
        force = os.environ.get(ENV_COMB_OVERLAP, "auto")
        if force not in ("auto", "0", "1"):
            raise ValueError(f"{ENV_COMB_OVERLAP}={force!r}: expected auto, 0 or 1")
        mode = "after" if force == "0" else "overlap"
    bufs._comb_mode = mode
    return mode


ENV_COPY_ENGINE = "TLX_DIST_COPY_ENGINE"
# "auto" turns the copy-engine row form on from this many tokens per rank (the buffers' T_max) ...
CE_MIN_TOKENS = 4096  # (two H200s, x2_s40: T=128 combined in 38-52 us by copy engines, 25 by SM stores)


# ... where a token reaches each peer with at least this probability under uniform routing
# (1 - C(E - E/W, K) / C(E, K): every token's row crosses to every peer in the dense layout, so the
# copy engines' ~7% more bandwidth pays only when nearly every row had to cross anyway; W=2, E=64,
# K=8: 0.995; W=4: 0.915; W=8: 0.68)
CE_MIN_DENSITY = 0.95


def _ce_density(L) -> float:
    e = L.num_experts // L.world_size
    return 1.0 - math.comb(L.num_experts - e, L.top_k) / math.comb(L.num_experts, L.top_k)


def _ce_mode(bufs: SymmBuffers) -> bool:
    """Whether the row form into a per-layer region (with a static capacity, W > 1) moves rows by copy
    engines (``tlx_dist/comm/copy_engine.py``, ``tlx/comm/copy_engine.py``) in the dense layout.
    The setting: ``SymmDispatcher(copy_engine=...)`` on the buffers, else ``TLX_DIST_COPY_ENGINE``
    (``auto`` / ``1`` / ``0``; like every ``TLX_DIST_*`` setting it must be the same on every rank).
    ``auto``: real ranks over peer pointers on CUDA with T_max >= ``CE_MIN_TOKENS`` and a uniform
    routing density >= ``CE_MIN_DENSITY``. On (``True`` / ``1``): wherever copies can be issued --
    real ranks over peer pointers on CUDA, and the emulated world (CPU: ``memmove``; one GPU:
    same-device copies), which runs the whole protocol; never on the NVSHMEM route or ROCm, which
    keep SM stores. Resolved at a buffer set's first use and kept for its life."""
    mode = getattr(bufs, "_ce_mode_v", None)
    if mode is None:
        mode = bufs._ce_mode_v = _ce_resolve(bufs, getattr(bufs, "copy_engine", None))
    return mode


def _ce_resolve(bufs: SymmBuffers, setting) -> bool:
    if setting is None:
        env = os.environ.get(ENV_COPY_ENGINE, "auto")
        if env not in ("auto", "0", "1"):
            raise ValueError(f"{ENV_COPY_ENGINE}={env!r}: expected auto, 0 or 1")
        setting = "auto" if env == "auto" else env == "1"
    L = bufs.layout
    emulated = bufs.backend in ("emulated", "local")
    if bufs.use_nvshmem or L.world_size == 1 or L.row_regions == 0 or torch.version.hip is not None:
        mode = False
    elif emulated:
        mode = setting is True and (bufs.device.type == "cpu" or copy_engine.available(bufs.device))
    elif not copy_engine.available(bufs.device):
        mode = False
    elif setting == "auto":
        mode = L.max_tokens >= CE_MIN_TOKENS and _ce_density(L) >= CE_MIN_DENSITY
    else:
        mode = bool(setting)
    return mode


def _set_copy_engine(bufs: SymmBuffers, setting: bool) -> None:
    """A dispatcher's ``copy_engine=True / False`` onto its buffer set (shared by every layer of the
    group, ``ep_buffers``). A set whose mode, fixed at its first op, differs from what this setting
    gives raises instead of ignoring the request."""
    prev = getattr(bufs, "copy_engine", None)
    if prev == setting:  # (every dispatch passes here: nothing to do)
        return
    if prev is not None:
        raise ValueError(f"copy_engine={setting}: another SymmDispatcher of this buffer set asked for "
                         f"copy_engine={prev}; every dispatcher that shares a buffer set must ask the same")
    mode = getattr(bufs, "_ce_mode_v", None)
    if mode is not None and _ce_resolve(bufs, setting) != mode:
        raise ValueError(f"copy_engine={setting}: this buffer set already runs with the copy-engine row form "
                         f"{'on' if mode else 'off'} (fixed at its first op): give every SymmDispatcher that shares "
                         "it the same copy_engine, or build it anew")
    bufs.copy_engine = setting
