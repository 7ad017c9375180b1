"""The exchange's mode policy: which form each op of a buffer set takes, from its
:class:`ExchangeConfig` and its route, resolved at first use and kept for the set's life.

    recv_mode    the row form's receive copy: "overlap" | "blocks" | "after"
    comb_mode    the combine's source-side sum:  "overlap" | "blocks" | "after"
    ce_mode      the copy-engine row form:       True | False

Senders and receivers must agree on every mode (a mismatch ends in a wait timeout or stale arrival
counters), so every rank of a group resolves the same from the same config; the resolved modes sit
in ``SymmBuffers.modes`` (tests pin one there, between ops). :func:`adopt` puts a dispatcher's
config on its buffer set and refuses one that contradicts what the set already runs.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import copy_engine
from .buffers import SymmBuffers
from .config import ExchangeConfig, ce_auto, recv_overlap_auto

__all__ = ["recv_mode", "comb_mode", "ce_mode", "adopt"]


def _recv(bufs: SymmBuffers, cfg: ExchangeConfig) -> str:
    """``"overlap"``: real ranks over peer pointers with ``recv_overlap`` on (``"auto"``: from
    ``RECV_OVERLAP_MIN_TOKENS`` tokens per rank) -- extra programs of the send kernel copy rows out
    of RECV block by block as they land; ``"blocks"``: the emulated world, whose ranks launch one
    after another, and one rank -- the same block-by-block copy, in the expand kernel; ``"after"``:
    the NVSHMEM route and the rest -- the expand kernel, after every row arrived."""
    if bufs.use_nvshmem or bufs.hier is not None:  # (the relays' rows land without per-block counts)
        return "after"
    if bufs.backend in ("emulated", "local") or bufs.world_size == 1:
        return "blocks"
    on = recv_overlap_auto(bufs.layout.max_tokens) if cfg.recv_overlap == "auto" else cfg.recv_overlap == "on"
    return "overlap" if on else "after"


def _comb(bufs: SymmBuffers, cfg: ExchangeConfig) -> str:
    """``"overlap"``: real ranks over peer pointers on CUDA with ``comb_overlap`` not off -- for the
    row form of 16-bit rows (the fused EP pipeline's combine) the reduce-send launch's first programs
    sum each token block as its partial rows land, one launch; the expanded form and 32/64-bit rows,
    whose reduce-send holds too many registers for programs to wait beside it, run as "after";
    ``"blocks"``: the emulated world and one rank -- the same per-block counters, summed by the
    reduce-receive kernel after the sends; ``"after"``: the NVSHMEM route and ROCm (waves per CU
    differ: the co-residency the one launch needs is unchecked there) -- one ARRIVE count per rank,
    then the reduce-receive kernel."""
    if bufs.use_nvshmem or bufs.hier is not None:  # (the relays' rows come home without per-block counts)
        return "after"
    if bufs.backend in ("emulated", "local") or bufs.world_size == 1:
        return "blocks"
    if torch.version.hip is not None:
        return "after"
    return "after" if cfg.comb_overlap == "off" else "overlap"


def _ce(bufs: SymmBuffers, cfg: ExchangeConfig) -> bool:
    """The row form into a per-layer region (static capacity, W > 1) by copy engines in the dense
    layout: ``"auto"`` -- real ranks over peer pointers on CUDA where ``ce_auto`` says so; ``"on"``
    -- wherever copies can be issued: real ranks over peer pointers on CUDA, and the emulated world
    (CPU: ``memmove``; one GPU: same-device copies), which runs the whole protocol. Never on the
    NVSHMEM route or ROCm, which keep SM stores."""
    L = bufs.layout
    if bufs.use_nvshmem or bufs.hier is not None or L.world_size == 1 or L.row_regions == 0 \
            or torch.version.hip is not None:
        return False
    if bufs.backend in ("emulated", "local"):
        return cfg.copy_engine == "on" and (bufs.device.type == "cpu" or copy_engine.available(bufs.device))
    if not copy_engine.available(bufs.device):
        return False
    if cfg.copy_engine == "auto":
        return ce_auto(L.max_tokens, L.world_size, L.num_experts, L.top_k)
    return cfg.copy_engine == "on"


_RESOLVE = {"recv": _recv, "comb": _comb, "copy_engine": _ce}


def _mode(bufs: SymmBuffers, name: str):
    mode = bufs.modes.get(name)
    if mode is None:
        mode = bufs.modes[name] = _RESOLVE[name](bufs, bufs.config)
    return mode


def recv_mode(bufs: SymmBuffers) -> str:
    """Where the row form copies the other sources' rows out of RECV (``_recv``)."""
    return _mode(bufs, "recv")


def comb_mode(bufs: SymmBuffers) -> str:
    """How a combine's source side sums the partial rows (``_comb``)."""
    return _mode(bufs, "comb")


def ce_mode(bufs: SymmBuffers) -> bool:
    """Whether the row form into a region moves rows by copy engines (``_ce``)."""
    return _mode(bufs, "copy_engine")


def _settings(cfg: ExchangeConfig) -> ExchangeConfig:
    return dataclasses.replace(cfg, timeout_s=None)  # (the timeout is the buffer set's, compared apart)


def adopt(bufs: SymmBuffers, cfg: ExchangeConfig) -> None:
    """Puts a dispatcher's ``cfg`` on its buffer set (shared by every layer of the group,
    ``ep_buffers``). A set that was built with a config, or given one by another dispatcher, keeps
    it: a different ``cfg`` raises, naming the fields. A set on its default config takes ``cfg``,
    unless a mode it already resolved (at its first ops) would change under it."""
    if not isinstance(cfg, ExchangeConfig):
        raise TypeError(f"config must be an ExchangeConfig, got {type(cfg).__name__}")
    if cfg.timeout_s is not None and float(cfg.timeout_s) != bufs.timeout_s:
        raise ValueError(f"timeout_s={cfg.timeout_s!r}: this buffer set waits {bufs.timeout_s:g} s (fixed when it "
                         "was built): build the dispatcher's buffers with the same timeout")
    if cfg.topology != bufs.config.topology:  # (its regions depend on it: fixed when the set was built)
        bufs.check_topology(cfg)
    if _settings(cfg) == _settings(bufs.config):
        bufs._config_claimed = True
        return
    if bufs._config_claimed:
        diff = "; ".join(_settings(bufs.config).differences(_settings(cfg)))
        raise ValueError(f"this buffer set runs another ExchangeConfig (its {diff} -- set vs asked): every "
                         "SymmDispatcher that shares a buffer set (every layer of an EP group) must use the same")
    for name, mode in bufs.modes.items():
        new = _RESOLVE[name](bufs, cfg)
        if new != mode:
            raise ValueError(f"this buffer set already runs with {name} {mode!r} (fixed at its first op), the "
                             f"config asked for gives {new!r}: give every SymmDispatcher that shares it the same "
                             "config, or build it anew")
    bufs.config = dataclasses.replace(cfg, timeout_s=bufs.timeout_s)
    bufs._config_claimed = True
