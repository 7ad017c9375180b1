"""The exchange's settings: one frozen :class:`ExchangeConfig`, its launch shapes :class:`Tile` objects.

Every setting of the symmetric exchange lives here -- launch shapes of the row-moving kernels, the
copy-engine row form, the arrival-driven overlap, the receive and combine modes, the wait timeout --
validated on construction with errors that name the field. The defaults (``ExchangeConfig()``) are
what the library runs: ``"auto"`` modes decide by the buffers' sizes and route at their first op
(``policy.py``). :meth:`ExchangeConfig.auto` spells those decisions out for given sizes (as DeepEP's
``Buffer.get_dispatch_config()`` hands back a config); override any field with
``dataclasses.replace``::

    cfg = dataclasses.replace(ExchangeConfig.auto(max_tokens=4096, world_size=2, num_experts=64, top_k=8),
                              copy_engine="off")
    SymmDispatcher(num_experts, group, config=cfg)

A config belongs to the buffer set it runs on (:class:`SymmBuffers` ``.config``): every rank of the
EP group, and every dispatcher that shares the set, must use the same one.

Environment (debug only; nothing here chooses an algorithm):
    ``TLX_DIST_EXCHANGE_TIMEOUT_S``  seconds a wait spins before it records an error, where
                                     ``timeout_s`` is left None (default 30).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..topology import TOPOLOGIES

__all__ = ["Tile", "ExchangeConfig", "MODES", "TILE_KERNELS", "CE_MIN_TOKENS", "CE_MIN_DENSITY",
           "RECV_OVERLAP_MIN_TOKENS", "ce_density", "ce_auto", "recv_overlap_auto"]

MODES = ("auto", "on", "off")

# ---- the size rules behind the "auto" modes (ExchangeConfig.auto and policy.py apply them) ----

# The copy-engine row form from this many tokens per rank (the buffers' T_max): below it, the copies'
# launch and signal latency costs more than the SM stores they replace.
CE_MIN_TOKENS = 4096
# ... where a token reaches each peer with at least this probability under uniform routing
# (``ce_density``): the dense layout sends every token's row to every peer, so the copy engines' extra
# bandwidth pays only when nearly every row had to cross anyway (W=2, E=64, K=8: 0.998; W=4: 0.915).
CE_MIN_DENSITY = 0.95
# The send kernel's receiving programs (recv overlap) from this many tokens per rank up: at smaller
# sizes they slow the senders more than the copy they hide.
RECV_OVERLAP_MIN_TOKENS = 8192


def ce_density(world_size: int, num_experts: int, top_k: int) -> float:
    """Probability that a token with K distinct uniform experts has one on a given peer:
    ``1 - C(E - E/W, K) / C(E, K)``."""
    e = num_experts // world_size
    return 1.0 - math.comb(num_experts - e, top_k) / math.comb(num_experts, top_k)


def ce_auto(max_tokens: int, world_size: int, num_experts: int, top_k: int) -> bool:
    """``copy_engine="auto"`` on real ranks over peer pointers: on from ``CE_MIN_TOKENS`` tokens per
    rank where ``ce_density >= CE_MIN_DENSITY``."""
    return max_tokens >= CE_MIN_TOKENS and ce_density(world_size, num_experts, top_k) >= CE_MIN_DENSITY


def recv_overlap_auto(max_tokens: int) -> bool:
    """``recv_overlap="auto"`` on real ranks over peer pointers: on from ``RECV_OVERLAP_MIN_TOKENS``."""
    return max_tokens >= RECV_OVERLAP_MIN_TOKENS


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2(v) -> bool:
    return _is_int(v) and v >= 1 and not v & (v - 1)


@dataclass(frozen=True)
class Tile:
    """Launch shape of one row-moving kernel: a program moves ``rows x cols`` elements a step, with
    ``warps`` warps, ``per_sm`` programs per SM (the grid: at most that many times the SMs, no more
    than there are row blocks).

    ``rows=None`` (default): sized per launch -- ~4096-element tiles of ``cols`` columns (at most D
    rounded up to a power of two), made wider and shorter (down to 2 rows, up to 2048 columns) while
    a launch has few row blocks, so a small op still spreads over many programs. ``rows`` given: the
    tile is exactly ``rows x cols``. Powers of two."""

    cols: int = 512
    rows: Optional[int] = None
    warps: int = 4
    per_sm: int = 4

    def __post_init__(self) -> None:
        self.validate("Tile")

    def validate(self, prefix: str) -> "Tile":
        if not _pow2(self.cols):
            raise ValueError(f"{prefix}.cols={self.cols!r} must be a power of two")
        if self.rows is not None and not _pow2(self.rows):
            raise ValueError(f"{prefix}.rows={self.rows!r} must be None (sized per launch) or a power of two")
        if not _pow2(self.warps) or self.warps > 32:
            raise ValueError(f"{prefix}.warps={self.warps!r} must be a power of two from 1 to 32")
        if not _is_int(self.per_sm) or not 1 <= self.per_sm <= 64:
            raise ValueError(f"{prefix}.per_sm={self.per_sm!r} must be an integer from 1 to 64 (programs per SM)")
        return self


# Per kernel: the send starts at 1024 columns and 4 programs an SM; the reductions at 512 columns and 16
# programs an SM (more warps in flight per SM sum faster); the expand copy at 512 and 4.
_TILES = {"send": Tile(cols=1024, per_sm=4), "expand": Tile(cols=512, per_sm=4),
          "reduce_send": Tile(cols=512, per_sm=16), "reduce_recv": Tile(cols=512, per_sm=16)}


TILE_KERNELS = tuple(_TILES)


@dataclass(frozen=True)
class ExchangeConfig:
    """Settings of the symmetric exchange (``SymmDispatcher(config=...)``; TOML ``[parallel.exchange]``).

    Launch shapes:
        send, expand, reduce_send, reduce_recv: :class:`Tile` of the dispatch's send, its expand copy,
            the combine's reduce-send and reduce-receive kernels.
        route_block: tokens per block of the dispatch's route kernel (a power of two); 0 (default):
            32 for ops of up to 1024 tokens (several programs for a small op), else ~1024 slots a block.
        comb_sum_per_sm, comb_send_per_sm: summing / sending programs per SM of the one-launch
            combine (``comb_overlap``); the summing ones are capped at half the CTAs an SM holds at
            ``reduce_send.warps``, so the senders they wait for always find room.
    Copy engines (the row form into a receive region, static capacity, W > 1):
        copy_engine: ``"auto"`` (default: real ranks over peer pointers with at least
            ``CE_MIN_TOKENS`` tokens per rank where nearly every token reaches every peer,
            ``ce_auto``), ``"on"`` (wherever copies can be issued, also the emulated world), ``"off"``.
            Never on the NVSHMEM route or ROCm.
        ce_chunk_rows, ce_tail_rows: the combine's copies are chunks of ``ce_chunk_rows`` rows, the
            last cut in halves down to ``ce_tail_rows`` (0: not cut): few large copies (each costs a
            gap on the copy engine), small ones last (the sum left after the last copy is short).
            Chunks are whole token blocks of the combine (32 rows; rounded down, at least one).
        ce_sum_per_sm: summing programs per SM of the copy-engine combine (1 to 8: they wait for one-
            program signal kernels, which must always find room on an SM).
    Overlap:
        overlap: the arrival-driven overlap of the fused EP pipeline (the row form, a static
            capacity; elsewhere nothing). Flat exchange (a layer with a receive region, peer
            pointers): a row-form dispatch ends once every peer's metadata landed, the peers' rows
            follow on a side stream while the gate/up GEMM computes this rank's own rows
            (``RowsOverlap``). Hierarchical exchange over more than one node (no region needed):
            the dispatch ends once this node's rows and every source's metadata are in, the
            inter-node leg's token rows follow on the side stream while the GEMMs compute this
            node's rows (``HierRowsOverlap``). Off by default (slower over NVLink).
        overlap_sms: SMs (programs) the overlapped send keeps on its side stream.
        recv_overlap: the row form's receive copy on real ranks over peer pointers: ``"on"`` --
            extra programs of the send kernel copy rows out as they land; ``"off"`` -- the expand
            kernel copies after every row arrived; ``"auto"``: on from ``RECV_OVERLAP_MIN_TOKENS``.
        comb_overlap: the combine of 16-bit rows in the row form on real ranks over peer pointers
            (CUDA): ``"auto"`` / ``"on"`` -- one launch whose first programs sum each token block as
            its partial rows land; ``"off"`` -- two launches (send, then sum).
    Topology:
        topology: how the exchange crosses nodes: ``"auto"`` (default) -- hierarchical when the EP
            group spans nodes with more than one rank on each (``LOCAL_WORLD_SIZE``), else flat;
            ``"flat"`` -- one row per (token, destination rank) wherever it is; ``"hierarchical"``
            -- one row per (token, destination node) to the rank of that node with the source's
            local index, which forwards it over NVLink (docs/exchange.md; the group's ranks must
            fill equal nodes in rank order, as torchrun numbers them; on one node it is the flat
            exchange).
    Reliability:
        timeout_s: how long a wait spins before it records an error (:meth:`SymmBuffers.check`
            raises it); None: ``TLX_DIST_EXCHANGE_TIMEOUT_S`` or 30 s.
    Testing:
        route_agg_only: the route kernel's look-back walks every aggregate (what concurrent blocks
            do on a GPU; the in-order interpreter never would).
    """

    send: Tile = _TILES["send"]
    expand: Tile = _TILES["expand"]
    reduce_send: Tile = _TILES["reduce_send"]
    reduce_recv: Tile = _TILES["reduce_recv"]
    route_block: int = 0
    comb_sum_per_sm: int = 4
    comb_send_per_sm: int = 2
    copy_engine: str = "auto"
    ce_chunk_rows: int = 4096
    ce_tail_rows: int = 512
    ce_sum_per_sm: int = 4
    overlap: bool = False
    overlap_sms: int = 32
    recv_overlap: str = "auto"
    comb_overlap: str = "auto"
    topology: str = "auto"
    timeout_s: Optional[float] = None
    route_agg_only: bool = False

    def __post_init__(self) -> None:
        self.validate("ExchangeConfig")

    def validate(self, prefix: str) -> "ExchangeConfig":
        for name in TILE_KERNELS:
            t = getattr(self, name)
            if not isinstance(t, Tile):
                raise TypeError(f"{prefix}.{name}={t!r} must be a Tile")
            t.validate(f"{prefix}.{name}")
        if not _is_int(self.route_block) or (self.route_block and not _pow2(self.route_block)):
            raise ValueError(f"{prefix}.route_block={self.route_block!r} must be 0 (automatic) or a power of two")
        for name in ("comb_sum_per_sm", "comb_send_per_sm", "overlap_sms"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{prefix}.{name}={v!r} must be a positive integer")
        if not _is_int(self.ce_sum_per_sm) or not 1 <= self.ce_sum_per_sm <= 8:
            raise ValueError(f"{prefix}.ce_sum_per_sm={self.ce_sum_per_sm!r} must be an integer from 1 to 8 "
                             "(summing programs per SM)")
        if not _is_int(self.ce_chunk_rows) or self.ce_chunk_rows < 1:
            raise ValueError(f"{prefix}.ce_chunk_rows={self.ce_chunk_rows!r} must be a positive integer")
        if not _is_int(self.ce_tail_rows) or self.ce_tail_rows < 0:
            raise ValueError(f"{prefix}.ce_tail_rows={self.ce_tail_rows!r} must be 0 (not cut) or a positive integer")
        for name in ("copy_engine", "recv_overlap", "comb_overlap"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"{prefix}.{name}={getattr(self, name)!r} must be 'auto', 'on' or 'off'")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"{prefix}.topology={self.topology!r} must be one of {TOPOLOGIES}")
        for name in ("overlap", "route_agg_only"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{prefix}.{name}={getattr(self, name)!r} must be a bool (true/false)")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6):
            raise ValueError(f"{prefix}.timeout_s={t!r} must be None or a number of seconds in (0, 1e6)")
        return self

    # ---- the factory ----
    @classmethod
    def auto(cls, max_tokens: int, world_size: int, num_experts: int, top_k: int, **overrides: Any) -> "ExchangeConfig":
        """The config the ``"auto"`` modes resolve to on real ranks over peer pointers for buffers of
        ``max_tokens`` tokens per rank, W = ``world_size``, E, K: ``copy_engine`` and
        ``recv_overlap`` as ``"on"`` / ``"off"`` by their size rules (``ce_auto``,
        ``recv_overlap_auto``), ``comb_overlap="on"``; the rest the defaults. ``overrides``: fields
        to set on top. (The emulated world runs the copy-engine form only when a config says
        ``"on"``; the NVSHMEM route and ROCm keep SM stores whatever it says.)"""
        for name, v in (("max_tokens", max_tokens), ("world_size", world_size), ("num_experts", num_experts),
                        ("top_k", top_k)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if num_experts % world_size or top_k > num_experts:
            raise ValueError(f"num_experts={num_experts} must be divisible by world_size={world_size} and at least "
                             f"top_k={top_k}")
        on = lambda b: "on" if b else "off"  # noqa: E731
        rules = dict(copy_engine=on(ce_auto(max_tokens, world_size, num_experts, top_k)),
                     recv_overlap=on(recv_overlap_auto(max_tokens)), comb_overlap="on")
        return cls(**{**rules, **overrides})

    # ---- tables (TOML) ----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], prefix: str = "exchange") -> "ExchangeConfig":
        """From a TOML table (``[parallel.exchange]``; a kernel's tile as a sub-table, e.g.
        ``[parallel.exchange.send]``). Unknown keys and wrong types raise ValueError naming
        ``<prefix>.<field>``."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{prefix} must be a table, got {d!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"{prefix}: unknown field(s) {unknown}; known: {sorted(names)}")
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name in TILE_KERNELS:
                base = getattr(cls, f.name)
                v = _tile_from_dict(v, f"{prefix}.{f.name}", base)
            elif f.name == "timeout_s" and _is_int(v):
                v = float(v)
            kw[f.name] = v
        try:
            return cls(**kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            named = prefix + msg[len("ExchangeConfig"):] if msg.startswith("ExchangeConfig.") else msg
            raise ValueError(named) from None

    def to_dict(self) -> dict:
        """The fields as a TOML-ready table (tiles as sub-tables; a None field left out)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tile):
                v = {k: x for k, x in dataclasses.asdict(v).items() if x is not None}
            if v is not None:
                out[f.name] = v
        return out

    def differences(self, other: "ExchangeConfig") -> list[str]:
        """``["copy_engine: 'on' vs 'off'", ...]``: the fields where ``other`` differs."""
        return [f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def _tile_from_dict(v, prefix: str, base: Tile) -> Tile:
    if isinstance(v, Tile):
        return v
    if not isinstance(v, Mapping):
        raise ValueError(f"{prefix} must be a table with fields cols, rows, warps, per_sm; got {v!r}")
    names = {f.name for f in dataclasses.fields(Tile)}
    unknown = sorted(set(v) - names)
    if unknown:
        raise ValueError(f"{prefix}: unknown field(s) {unknown}; known: {sorted(names)}")
    try:
        return dataclasses.replace(base, **v)
    except ValueError as e:
        msg = str(e)
        raise ValueError(prefix + msg[len("Tile"):] if msg.startswith("Tile.") else msg) from None

