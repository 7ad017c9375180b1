"""Tile configs of the TLX grouped GEMM: one frozen dataclass, each compile target's candidates and
shared-memory budget, and the factory that owns the default choice.

Legend: N rows, E experts, K reduction depth, NN output columns. ``form``: ``"fwd"`` (y = x @ w),
``"dX"`` (dx = dy @ w^T, the weight read K-major) or ``"dW"`` (dw[e] = x[rows e]^T @ dy[rows e]).
Targets: ``sm_90`` (Hopper), ``sm_100`` (Blackwell), ``gfx942`` (MI300), ``gfx950`` (MI350).

    cfg = grouped_mm_config("fwd", N, E, K, NN, "sm_90")           # what a call runs by default
    y = grouped_mm(x_ND, w_EDF, offsets_E, config=dataclasses.replace(cfg, STAGES=4))   # pinned

A pinned config runs every form of the call (forward, dX and dW of its backward), as given: the
default rules below (the 128x128 tile for narrow outputs, the GROUP_M raster for wide ones) are not
applied on top of it. :func:`tile_spec` holds what the autotuner (``tune_grouped_mm``) times.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["GroupedGemmConfig", "TileSpec", "grouped_mm_config", "tile_spec", "check_config", "TARGETS",
           "PRECISIONS", "DW_ORDERS", "CANDIDATES", "LDS_BYTES", "lds_bytes"]

TARGETS = ("sm_90", "sm_100", "gfx942", "gfx950")
# Operand precisions a tile config can be for. "bf16": 16-bit operands (bfloat16 or float16) with
# fp32 accumulation -- every kernel here; a lower-precision variant adds its own value and fields.
PRECISIONS = ("bf16",)
# The dW tile walk (Hopper and AMD kernels; Blackwell's dW has the static walk only): "lpt" claims
# tiles longest expert first from an atomic counter, so the heavy experts of imbalanced routing start
# first and the other SMs fill in around them; "static" walks them round-robin, which is faster on
# balanced routing with short tiles (docs/decisions.md).
# Both are deterministic: each tile is summed whole by one CTA in K order.
DW_ORDERS = ("lpt", "static")


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One tile config of the TLX grouped-GEMM kernels.

    BM x BN output tile (Hopper: two consumer warp groups of BM/2 rows), BK reduction step, STAGES
    operand ring slots (AMD: LDS ring slots), GROUP_M rows of tiles walked together (L2 reuse; 1 =
    row-major; not read by Blackwell), ``dw_order`` the dW tile walk (:data:`DW_ORDERS`),
    ``precision`` the operands it is for (:data:`PRECISIONS`)."""

    BM: int = 128
    BN: int = 256
    BK: int = 64
    STAGES: int = 3
    GROUP_M: int = 1
    dw_order: str = "lpt"
    precision: str = "bf16"

    def __post_init__(self):
        for f in ("BM", "BN", "BK", "STAGES", "GROUP_M"):
            if not _integer(getattr(self, f)):
                raise TypeError(f"GroupedGemmConfig.{f}={getattr(self, f)!r} must be an int")
        for f in ("BM", "BN", "BK"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GroupedGemmConfig.{f}={v} must be a power of two >= 16")
        if self.BM not in (128, 256):
            raise ValueError(f"GroupedGemmConfig.BM={self.BM} must be 128 or 256 (two consumer groups of BM/2 rows)")
        if not 2 <= self.STAGES <= 8:
            raise ValueError(f"GroupedGemmConfig.STAGES={self.STAGES} must be in [2, 8]")
        if self.GROUP_M not in (1, 2, 4, 8, 16):
            raise ValueError(f"GroupedGemmConfig.GROUP_M={self.GROUP_M} must be one of 1, 2, 4, 8, 16")
        if self.dw_order not in DW_ORDERS:
            raise ValueError(f"GroupedGemmConfig.dw_order={self.dw_order!r} must be one of {DW_ORDERS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"GroupedGemmConfig.precision={self.precision!r} must be one of {PRECISIONS}")
        # the custom op's string argument, made once here: torch.compile then reads a constant
        object.__setattr__(self, "_json", json.dumps(dataclasses.asdict(self), sort_keys=True))

    def smem_bytes(self, cc: int) -> int:
        """Shared memory of one CTA of the NVIDIA kernels (``cc`` 90 or 100): the operand ring and the
        epilogue's store tile (Blackwell stores the accumulator in two slices of <= 128 columns)."""
        ring = self.STAGES * (self.BM * self.BK + self.BK * self.BN) * 2
        epi = self.BM * self.BN * 2 if cc == 90 else 2 * self.BM * min(self.BN, 128) * 2
        return ring + epi

    def to_json(self) -> str:
        """The fields as JSON (how the config travels through the ``tlx_dist::grouped_mm`` custom op)."""
        return self._json

    @staticmethod
    def from_json(text: str) -> "GroupedGemmConfig":
        return _from_json(text)


@functools.lru_cache(maxsize=256)
def _from_json(text: str) -> GroupedGemmConfig:
    return GroupedGemmConfig(**json.loads(text))


def _nv(BM, BN, BK, STAGES, GROUP_M=1) -> GroupedGemmConfig:
    return GroupedGemmConfig(BM, BN, BK, STAGES, GROUP_M)


# The candidates the autotuner times, per target; the first is the wide-output default.
CANDIDATES = {
    "sm_90": (_nv(128, 256, 64, 3), _nv(128, 128, 64, 4), _nv(256, 128, 64, 3), _nv(128, 256, 64, 3, 8),
              _nv(128, 128, 64, 5, 8), _nv(256, 128, 64, 3, 8), _nv(128, 256, 32, 6, 8)),
    "sm_100": (_nv(128, 256, 64, 3), _nv(128, 128, 64, 4)),
    # (BM, BN, BK, STAGES = LDS ring slots, GROUP_M); all compile without spills (tests/test_tlx_compile.py)
    "gfx942": (_nv(256, 128, 32, 2), _nv(128, 128, 32, 3), _nv(128, 256, 32, 2), _nv(256, 128, 32, 2, 8)),
    "gfx950": (_nv(256, 128, 64, 2), _nv(128, 256, 64, 2), _nv(256, 256, 32, 2), _nv(128, 128, 64, 3),
               _nv(256, 128, 64, 2, 8)),
}
_NV_SMEM = 227 * 1024  # opt-in shared memory per block, sm_90 and sm_100
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}


def lds_bytes(cfg: GroupedGemmConfig, target: str) -> int:
    """LDS of the AMD kernel's operand ring. gfx950's inferred padded layout adds 16 elements per 512
    (1/32); the epilogue stores from registers and needs none."""
    ring = cfg.STAGES * (cfg.BM * cfg.BK + cfg.BK * cfg.BN) * 2
    return ring * 33 // 32 if target == "gfx950" else ring


def _nv_default(cc: int, form: str, NN: int) -> GroupedGemmConfig:
    # 128x256 tiles (each consumer group 64x256) have the most arithmetic per byte of shared memory;
    # narrow outputs waste half a 256-wide tile, so take 128x128 there.
    if NN <= 128 or (NN % 256 and NN % 256 <= 128 and NN < 1024):
        return _nv(128, 128, 64, 4)
    # Wide outputs (>= 16 column tiles, e.g. Mixtral's F=14336): a row-major walk has the 132 tiles in
    # flight read all of B (117 MB for one Mixtral expert, twice the L2) per wave; walking 8 rows of
    # tiles together keeps ~45 MB of operands in flight instead.
    return _nv(128, 256, 64, 3, 8 if cc == 90 and -(-NN // 256) >= 16 else 1)


def _amd_default(target: str, form: str, NN: int) -> GroupedGemmConfig:
    # Narrow outputs waste half of a 256-wide tile: 128x128 there, with one more ring slot.
    if NN <= 128:
        return _nv(128, 128, 32 if target == "gfx942" else 64, 3)
    cfg = CANDIDATES[target][0]
    # Wide outputs (>= 16 column tiles): walk 8 rows of tiles together so the tiles in flight on an
    # XCD share operands in its L2 (as the Hopper kernel does).
    if -(-NN // cfg.BN) >= 16:
        cfg = dataclasses.replace(cfg, GROUP_M=8)
    return cfg


@dataclass(frozen=True)
class TileSpec:
    """What the config choice needs to know about one compile target."""

    target: str
    candidates: tuple  # GroupedGemmConfig candidates the autotuner times
    smem_limit: int  # bytes of shared memory (LDS) one CTA may use
    smem_bytes: Callable[[GroupedGemmConfig], int]
    default: Callable[[str, int], GroupedGemmConfig]  # (form, NN) -> config


@functools.lru_cache(maxsize=None)
def tile_spec(target: str) -> TileSpec:
    if target not in TARGETS:
        raise ValueError(f"target={target!r} must be one of {TARGETS}")
    if target.startswith("sm_"):
        cc = int(target[3:])
        return TileSpec(target, CANDIDATES[target], _NV_SMEM, lambda c: c.smem_bytes(cc),
                        functools.partial(_nv_default, cc))
    return TileSpec(target, CANDIDATES[target], LDS_BYTES[target], functools.partial(lds_bytes, target=target),
                    functools.partial(_amd_default, target))


_CACHE: dict[tuple, GroupedGemmConfig] = {}


def grouped_mm_config(form: str, n_rows: int, E: int, K: int, NN: int, target: str,
                      dtype: torch.dtype = torch.bfloat16) -> GroupedGemmConfig:
    """The default tile config of one call on ``target``: 128x256x64 with 3 stages (AMD: the
    target's first candidate), 128x128 for narrow outputs, GROUP_M = 8 once the output has >= 16
    column tiles (sm_90, AMD). Cached per scalar key (rows bucketed to powers of two), so the
    launch path does one dict lookup."""
    if form not in ("fwd", "dX", "dW"):
        raise ValueError(f"form={form!r} must be 'fwd', 'dX' or 'dW'")
    key = (target, form, E, K, NN, 1 << max(0, n_rows - 1).bit_length(), dtype)
    cfg = _CACHE.get(key)
    if cfg is None:
        cfg = _CACHE[key] = tile_spec(target).default(form, NN)
    return cfg


def check_config(cfg: GroupedGemmConfig, target: str) -> GroupedGemmConfig:
    """``cfg`` if it fits ``target`` (its shared memory / LDS budget), else a ValueError naming what
    does not. Cached: a pinned config is checked once per target."""
    if not isinstance(cfg, GroupedGemmConfig):
        raise TypeError(f"config must be a GroupedGemmConfig, got {type(cfg).__name__}")
    return _check_fits(cfg, target)


@functools.lru_cache(maxsize=256)
def _check_fits(cfg: GroupedGemmConfig, target: str) -> GroupedGemmConfig:
    spec = tile_spec(target)
    if spec.smem_bytes(cfg) > spec.smem_limit:
        raise ValueError(f"config={cfg} needs {spec.smem_bytes(cfg)} bytes of shared memory "
                         f"(limit {spec.smem_limit} on {target})")
    return cfg


def fastest(spec: TileSpec, bench: Callable[[GroupedGemmConfig], object],
            candidates: Optional[tuple] = None) -> GroupedGemmConfig:
    """The candidate (those of ``spec`` that fit its budget, or ``candidates``) whose ``bench(cfg)``
    launch is fastest (triton.testing.do_bench)."""
    import triton

    fits = [c for c in (candidates or spec.candidates) if spec.smem_bytes(c) <= spec.smem_limit]
    if not fits:
        raise ValueError(f"no candidate fits the {spec.smem_limit}-byte budget of {spec.target}")
    times = {c: triton.testing.do_bench(lambda c=c: bench(c), warmup=5, rep=20) for c in fits}
    return min(times, key=times.get)
