"""Launch choices of the fused expert pipeline, as frozen dataclasses, and the factory that owns
their defaults.

    cfg = FusedConfig()                                            # every default (what runs without one)
    cfg = FusedConfig(dout_rows="gather")                          # no [N, D] dout copy in the backward
    cfg = FusedConfig(dswiglu=dataclasses.replace(fused_tile_config("dswiglu", F), STAGES=5, LAG=3))
    out = fused_experts(x_TD, idx_TK, gate_TK, w13, w2, config=cfg)

Kernel forms, each with a tile config (:class:`FusedTileConfig` on sm_90, :class:`BlackwellFusedTileConfig`
on sm_100): ``swiglu`` (gate/up GEMM with the SwiGLU epilogue), ``scatter`` (down GEMM adding
``gate * row`` into its token's output; also dX of the gate/up GEMM), ``dswiglu`` (dX of the down GEMM
reading dout's rows by index, with the dSwiGLU epilogue), ``dswiglu_copy`` (the same from dout's
expert-major copy), ``wgrad_a`` (dW13, x's rows gathered), ``wgrad_b`` (dW2, dout's rows gathered).
A form's field left None takes :func:`fused_tile_config`'s default for the call's shape; a given one
runs as it is (the width and depth rules below are not applied on top of it). Why each default is
what it is, and the measurements behind it: ``docs/decisions.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ..grouped_gemm.config import GroupedGemmConfig

__all__ = ["FusedConfig", "FusedTileConfig", "BlackwellFusedTileConfig", "fused_tile_config", "FORMS",
           "BLACKWELL_FORMS", "TILE_FORMS", "ROW_MODES", "PRECISIONS", "DSWIGLU_COPY_DEEP",
           "DSWIGLU_PINGPONG_MIN_D", "WGRAD_GROUP_TILES", "DOUT_COPY_MIN_F", "X_COPY_MIN_F"]

SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block, sm_90 and sm_100
TMEM_COLS = 512  # Blackwell tensor memory: 128 lanes x 512 fp32 columns per SM
TILE_FORMS = ("swiglu", "scatter", "dswiglu", "dswiglu_copy", "wgrad_a", "wgrad_b")
ROW_MODES = ("auto", "gather", "copy")
# "bf16": 16-bit operands (bfloat16 or float16), fp32 accumulation -- every kernel here; a
# lower-precision pipeline adds its own value (and the fields it needs).
PRECISIONS = ("bf16",)


def _check_ints(obj) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{type(obj).__name__}.{f.name}={v!r} must be an int")


@dataclass(frozen=True)
class FusedTileConfig:
    """Tile config of one fused form on sm_90 (tlx/hopper/fused_moe.py).

    BM rows (two consumer groups of BM/2), BN columns (SwiGLU: BN gate + BN up columns), BK
    reduction step, STAGES ring depth, LAG stages between issuing a gathered stage and publishing it
    (<= STAGES - 2, see the kernel's header), GROUP_M raster, REGS registers per consumer thread
    (the producer gets the rest).
    EARLY_H (dswiglu forms, BN >= 64): each consumer prefetches its h lines (gate and up halves of
    its 64 rows) into L2 before the tile's main loop, so the epilogue's h loads hit L2 instead of
    waiting on HBM; no shared memory, no registers held across the loop.
    EPI_WG (scatter, dswiglu, dswiglu_copy): 1 = a fourth warp group (EPI_REGS registers) runs both
    consumers' epilogues, 2 = one epilogue warp group per consumer. Each consumer stashes its fp32
    accumulator in shared memory as column chunks of EPI_COLS (0 = BN/2) and goes on to the next
    tile's main loop (REGS then as low as max(96, BN/2 + 32); 2 * REGS + EPI_WG * EPI_REGS <= 456
    leaves the producer 56).
    PINGPONG (dswiglu_copy only: dSwiGLU reading dout's copy in place): each consumer computes every
    other tile whole (two 64-row fp32 accumulators, BN registers a thread) and the two take turns
    issuing their main loops, so one's epilogue (in EPI_COLS-column chunks, 0 = BN/4) runs beside the
    other's MMAs."""

    BM: int = 128
    BN: int = 128
    BK: int = 64
    STAGES: int = 4
    LAG: int = 2
    GROUP_M: int = 1
    REGS: int = 232
    EARLY_H: int = 0
    EPI_WG: int = 0
    EPI_REGS: int = 152
    EPI_COLS: int = 0  # 0: BN / 2 (PINGPONG: BN / 4)
    PINGPONG: int = 0

    ARCH = "sm_90"

    def __post_init__(self):
        _check_ints(self)
        for f in ("BN", "BK"):
            v = getattr(self, f)
            if v < 32 or v > 256 or v & (v - 1):
                raise ValueError(f"FusedTileConfig.{f}={v} must be a power of two in [32, 256]")
        if self.BM != 128:
            raise ValueError(f"FusedTileConfig.BM={self.BM} must be 128 (two consumer groups of 64 rows)")
        if not 2 <= self.STAGES <= 8:
            raise ValueError(f"FusedTileConfig.STAGES={self.STAGES} must be in [2, 8]")
        if not 0 <= self.LAG <= self.STAGES - 2:
            raise ValueError(f"FusedTileConfig.LAG={self.LAG} must be in [0, STAGES - 2 = {self.STAGES - 2}]")
        if self.GROUP_M not in (1, 2, 4, 8, 16):
            raise ValueError(f"FusedTileConfig.GROUP_M={self.GROUP_M} must be one of 1, 2, 4, 8, 16")
        # consumers that hand the epilogue off hold only the accumulator (BN/2 fp32 registers) and the loop
        lo_regs = max(96, self.BN // 2 + 32) if self.EPI_WG else 152
        if self.REGS % 8 or not lo_regs <= self.REGS <= 240:
            raise ValueError(f"FusedTileConfig.REGS={self.REGS} must be a multiple of 8 in [{lo_regs}, 240]")
        if self.EARLY_H not in (0, 1):
            raise ValueError(f"FusedTileConfig.EARLY_H={self.EARLY_H} must be 0 or 1")
        if self.EARLY_H and self.BN < 64:
            raise ValueError(f"FusedTileConfig.EARLY_H prefetches 128-byte lines: needs BN >= 64, got {self.BN}")
        if self.PINGPONG not in (0, 1):
            raise ValueError(f"FusedTileConfig.PINGPONG={self.PINGPONG} must be 0 or 1")
        if self.PINGPONG and self.EPI_WG:
            raise ValueError("FusedTileConfig.PINGPONG runs the epilogue in the consumers: not with EPI_WG")
        if self.PINGPONG and self.epi_cols not in (self.BN // 2, self.BN // 4):
            raise ValueError(f"FusedTileConfig.PINGPONG: EPI_COLS={self.EPI_COLS} must be BN/2 or BN/4 (0 = BN/4)")
        if self.PINGPONG and (self.BN > 128 or self.REGS < 232):
            # a consumer holds the whole tile (BN fp32 registers a thread) plus one chunk's epilogue:
            # below that, or at BN 256, ptxas spills
            raise ValueError(f"FusedTileConfig.PINGPONG needs BN <= 128 and REGS >= 232 "
                             f"(BN={self.BN}, REGS={self.REGS})")
        if self.EPI_WG not in (0, 1, 2):
            raise ValueError(f"FusedTileConfig.EPI_WG={self.EPI_WG} must be 0, 1 or 2")
        if self.EPI_WG:
            if self.epi_cols not in (self.BN // 2, self.BN // 4, self.BN // 8) or self.epi_cols < 16:
                raise ValueError(f"FusedTileConfig.EPI_COLS={self.EPI_COLS} must be BN/2, BN/4 or BN/8 (>= 16) "
                                 f"(0 = BN/2), BN={self.BN}")
            if self.EPI_REGS % 8 or not 80 <= self.EPI_REGS <= 240:
                raise ValueError(f"FusedTileConfig.EPI_REGS={self.EPI_REGS} must be a multiple of 8 in [80, 240]")
            n_epi = self.EPI_WG  # epilogue warp groups: one for both consumers, or one each
            if 2 * self.REGS + n_epi * self.EPI_REGS > 512 - 56:
                raise ValueError(f"FusedTileConfig: 2 * REGS + {n_epi} * EPI_REGS = "
                                 f"{2 * self.REGS + n_epi * self.EPI_REGS} leaves the producer fewer than 56 of the "
                                 "512 registers per lane of the warp groups")

    @property
    def epi_cols(self) -> int:
        return self.EPI_COLS or (self.BN // 4 if self.PINGPONG else self.BN // 2)

    def smem_bytes(self, form: str) -> int:
        n_b = 2 if form == "swiglu" else 1
        ring = self.STAGES * (self.BM * self.BK + n_b * self.BK * self.BN) * 2
        acc_tiles = self.BM * self.BN * 4 if self.EPI_WG else 0  # both consumers' fp32 accumulators
        return ring + acc_tiles + (self.BM * self.BN * 2 if form.startswith("wgrad") else 0)

    def check_form(self, form: str, where: str) -> None:
        """ValueError (naming ``where``) unless this config can run ``form``."""
        if self.EPI_WG and form not in ("scatter", "dswiglu", "dswiglu_copy"):
            raise ValueError(f"{where}: EPI_WG is an option of the scatter and dswiglu forms, not {form}")
        if self.PINGPONG and form != "dswiglu_copy":
            raise ValueError(f"{where}: PINGPONG is an option of the dswiglu_copy form (dSwiGLU reading dout's "
                             f"expert-major copy), not {form}")
        if self.EARLY_H and not form.startswith("dswiglu"):
            raise ValueError(f"{where}: EARLY_H is an option of the dswiglu forms, not {form}")
        if self.smem_bytes(form) > SMEM_LIMIT:
            raise ValueError(f"{where}: {self} needs {self.smem_bytes(form)} bytes of shared memory for {form} "
                             f"(> {SMEM_LIMIT})")


@dataclass(frozen=True)
class BlackwellFusedTileConfig:
    """Tile config of one fused form on sm_100 (tlx/blackwell/fused_moe.py). BM rows (the 128 TMEM
    lanes, one MMA), BN columns (SwiGLU: BN gate + BN up columns), BK reduction step, STAGES ring
    depth, LAG stages between issuing a gathered stage and publishing it (<= STAGES - 1 here: an
    MMA releases its own stage), GROUP_M raster, EPI_BN columns per TMEM -> register slice of the
    epilogue, LOAD_WARPS / LOAD_REGS the producer partition (4 warps where it gathers rows, 1 for
    TMA only) and its registers per thread."""

    BM: int = 128
    BN: int = 128
    BK: int = 64
    STAGES: int = 4
    LAG: int = 2
    GROUP_M: int = 1
    EPI_BN: int = 64
    LOAD_WARPS: int = 4
    LOAD_REGS: int = 128

    ARCH = "sm_100"

    def __post_init__(self):
        _check_ints(self)
        name = type(self).__name__
        for f in ("BN", "BK", "EPI_BN"):
            v = getattr(self, f)
            if v < 16 or v > 256 or v & (v - 1):
                raise ValueError(f"{name}.{f}={v} must be a power of two in [16, 256]")
        if self.BM != 128:
            raise ValueError(f"{name}.BM={self.BM} must be 128 (the TMEM lanes of one tcgen05 MMA)")
        if self.EPI_BN > self.BN:
            raise ValueError(f"{name}.EPI_BN={self.EPI_BN} must be <= BN={self.BN}")
        if not 2 <= self.STAGES <= 8:
            raise ValueError(f"{name}.STAGES={self.STAGES} must be in [2, 8]")
        if not 0 <= self.LAG <= self.STAGES - 1:
            raise ValueError(f"{name}.LAG={self.LAG} must be in [0, STAGES - 1 = {self.STAGES - 1}]")
        if self.GROUP_M not in (1, 2, 4, 8, 16):
            raise ValueError(f"{name}.GROUP_M={self.GROUP_M} must be one of 1, 2, 4, 8, 16")
        if self.LOAD_WARPS not in (1, 4):
            raise ValueError(f"{name}.LOAD_WARPS={self.LOAD_WARPS} must be 1 or 4")
        if self.LOAD_REGS % 8 or not 24 <= self.LOAD_REGS <= 256:
            raise ValueError(f"{name}.LOAD_REGS={self.LOAD_REGS} must be a multiple of 8 in [24, 256]")

    def smem_bytes(self, form: str) -> int:
        n_b = 2 if form == "swiglu" else 1
        ring = self.STAGES * (self.BM * self.BK + n_b * self.BK * self.BN) * 2
        return ring + (2 * self.BM * self.EPI_BN * 2 if form.startswith("wgrad") else 0)

    def tmem_cols(self, form: str) -> int:
        """fp32 TMEM columns: two accumulator buffers (two each for SwiGLU's gate and up)."""
        return (4 if form == "swiglu" else 2) * self.BN

    def check_form(self, form: str, where: str) -> None:
        """ValueError (naming ``where``) unless this config can run ``form``."""
        if self.smem_bytes(form) > SMEM_LIMIT:
            raise ValueError(f"{where}: {self} needs {self.smem_bytes(form)} bytes of shared memory for {form} "
                             f"(> {SMEM_LIMIT})")
        if self.tmem_cols(form) > TMEM_COLS:
            raise ValueError(f"{where}: {self} needs {self.tmem_cols(form)} TMEM columns for {form} (> {TMEM_COLS})")


TileConfig = Union[FusedTileConfig, BlackwellFusedTileConfig]
_TILE_TYPES = {"sm_90": FusedTileConfig, "sm_100": BlackwellFusedTileConfig}

FORMS = {
    # gathered A + two B tiles per stage; 192 KB ring; fewer consumer registers leave the producer
    # room for its row pointers.
    "swiglu": FusedTileConfig(BN=128, BK=64, STAGES=4, LAG=2, REGS=216),
    # A by TMA; the epilogue (scale + fp32 atomics) in its own warp group, fed 32-column chunks of each
    # consumer's accumulator through 64 KB of shared memory while the consumers run the next tile:
    # 160 KB ring + 64 KB. Faster than the inline epilogue (4 stages, REGS 232) on every shape
    # measured but Mixtral's forward, where the two were even.
    "scatter": FusedTileConfig(BN=128, BK=64, STAGES=5, LAG=0, REGS=152, EPI_WG=1, EPI_REGS=152, EPI_COLS=32),
    # gathered dout + K-major w2; the epilogue holds g, hg, hu: 128 columns. A stage is half the MMA
    # time of SwiGLU's, so 5 stages of gathers in flight (LAG 4) cover the load latency; 192 KB ring.
    # REGS 232 (not 216): the epilogue's three operands fit without spilling. EARLY_H: the epilogue's
    # h loads hit L2.
    "dswiglu": FusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, REGS=232, EARLY_H=1),
    # the same with dout's rows read in place by TMA (dout_rows "copy"): one epilogue warp group per
    # consumer (EPI_WG=2, 16-column chunks), so each consumer's dSwiGLU runs beside both consumers'
    # next main loops. Deep K (D >= DSWIGLU_PINGPONG_MIN_D) takes DSWIGLU_COPY_DEEP instead.
    "dswiglu_copy": FusedTileConfig(BN=128, BK=64, STAGES=4, LAG=2, REGS=104, EARLY_H=1, EPI_WG=2, EPI_REGS=120,
                                    EPI_COLS=16),
    # dW13 = x[src]^T @ dh, A gathered (BK rows x 128 columns a stage, 16 KB by cp.async): BK 64
    # halves the per-stage overhead of the gather against BK 32; 3 x 48 KB ring + 64 KB TMA-store tile.
    "wgrad_a": FusedTileConfig(BN=256, BK=64, STAGES=3, LAG=1, REGS=224),
    # dW2 = ag^T @ dout[dst], B gathered (BK rows x 256 columns): at BK 64 the gather is 32 KB a stage
    # and the kernel runs several times slower, so BK 32; 144 KB ring + 64 KB store tile.
    "wgrad_b": FusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, REGS=224),
}

BLACKWELL_FORMS = {
    # gathered A + two B tiles per stage: 192 KB ring; 4 x 128 TMEM columns (gate, up; two buffers).
    # EPI_BN 64: the epilogue holds hg and hu of a slice (2 x 64 fp32 registers per thread).
    "swiglu": BlackwellFusedTileConfig(BN=128, BK=64, STAGES=4, LAG=2, EPI_BN=64),
    # A and B by TMA (one producer warp): 160 KB ring, 256 TMEM columns; atomics from 64-column slices.
    "scatter": BlackwellFusedTileConfig(BN=128, BK=64, STAGES=5, LAG=0, EPI_BN=64, LOAD_WARPS=1, LOAD_REGS=48),
    # gathered dout + K-major w2: 192 KB ring; the epilogue holds g, hg, hu: 32-column slices.
    "dswiglu": BlackwellFusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, EPI_BN=32),
    "dswiglu_copy": BlackwellFusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, EPI_BN=32),
    # one gathered operand: 144 KB ring + 32 KB TMA-store tiles; 2 x 256 TMEM columns (dW13, dW2 alike
    # until they are measured on a B200).
    "wgrad_a": BlackwellFusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, EPI_BN=64),
    "wgrad_b": BlackwellFusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, EPI_BN=64),
}
_ARCH_FORMS = {"sm_90": FORMS, "sm_100": BLACKWELL_FORMS}

# dSwiGLU from the dout copy with a deep reduction (K = D): the ping-pong consumers (each computes every
# other tile whole, one's epilogue beside the other's main loop) beat the two epilogue warp groups from
# D = 4096 (Mixtral, DeepSeek-V3 per rank) and lose to them at D = 2048 (OLMoE).
DSWIGLU_PINGPONG_MIN_D = 4096
DSWIGLU_COPY_DEEP = FusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, REGS=232, EARLY_H=1, PINGPONG=1, EPI_COLS=32)
# Column tiles of a dW output from which its tiles walk in groups of 8 rows (sm_90): consecutive tiles
# then read the same gathered rows. Mixtral's dW13 (112 tiles of 256) gains; at 6 column tiles (Qwen3's
# dW13) the raster loses.
WGRAD_GROUP_TILES = 32

# How the backward reads the upstream gradient's rows (dSwiGLU's A operand, dW2's B operand) and the
# forward its input rows (SwiGLU's and dW13's A operand), for the kernels that gather them:
#   "gather": by index, in the kernel (Hopper: cp.async by the producer warp group);
#   "copy":   one index_select into an expert-major [N, D] copy first (a transient N x D tensor),
#             which the kernels read in place by TMA (a dW whose both operands are expert-major is
#             then the grouped GEMM's dW kernel); x's copy is made again in the backward, not saved;
#   "auto":   copy where F >= the threshold below, for the primitives that set AUTO_ROW_COPY (the
#             Hopper TLX kernels, where the rule was measured); the Blackwell and portable kernels
#             gather unless "copy" is asked for.
# A gathered dout row is read again for every F-tile of dSwiGLU, and the copy lets dSwiGLU run its
# epilogue in warp groups of its own: the copy was faster at every F measured, so it is taken at any F
# ("gather" saves the N x D transient). A gathered x row is read again for each of the 2F / BN column
# tiles: the copy pays for wide experts (Mixtral), is even at F 2048 and slower below. The EP overlap's
# phased forward always gathers x's rows (they are still landing).
DOUT_COPY_MIN_F = 0
X_COPY_MIN_F = 4096


@functools.lru_cache(maxsize=None)
def fused_tile_config(form: str, nn: int, arch: str = "sm_90", k_dim: int = 0) -> TileConfig:
    """The default tile config of ``form`` on ``arch`` for an output ``nn`` columns wide and a
    reduction ``k_dim`` deep: the form's entry of :data:`FORMS` / :data:`BLACKWELL_FORMS`; on sm_90
    ``dswiglu_copy`` takes :data:`DSWIGLU_COPY_DEEP` from ``k_dim >= DSWIGLU_PINGPONG_MIN_D``; GROUP_M
    = 8 once the output has >= 16 column tiles (the GEMM forms), or for the sm_90 dW forms >=
    :data:`WGRAD_GROUP_TILES`. Cached on the scalar key: the launch path does one lookup."""
    if arch not in _ARCH_FORMS:
        raise ValueError(f"arch={arch!r}: the fused TLX kernels target {sorted(_ARCH_FORMS)}")
    if form not in TILE_FORMS:
        raise ValueError(f"form={form!r} must be one of {TILE_FORMS}")
    cfg = _ARCH_FORMS[arch][form]
    if form == "dswiglu_copy" and arch == "sm_90" and k_dim >= DSWIGLU_PINGPONG_MIN_D:
        cfg = DSWIGLU_COPY_DEEP
    tiles_n = -(-nn // cfg.BN)
    if tiles_n >= 16 if not form.startswith("wgrad") else arch == "sm_90" and tiles_n >= WGRAD_GROUP_TILES:
        cfg = dataclasses.replace(cfg, GROUP_M=8)
    return cfg


def _row_copy(mode: str, F: int, auto: bool, min_f: int) -> bool:
    return mode == "copy" or (mode == "auto" and auto and F >= min_f)


@dataclass(frozen=True)
class FusedConfig:
    """Launch choices of one fused-expert call (forward and backward).

    x_rows, dout_rows: how the GEMMs read x's and dout's rows (:data:`ROW_MODES`; the comment above
        :data:`DOUT_COPY_MIN_F` says what each does and when ``"auto"`` copies).
    swiglu, scatter, dswiglu, dswiglu_copy, wgrad_a, wgrad_b: a form's tile config
        (:class:`FusedTileConfig` for sm_90, :class:`BlackwellFusedTileConfig` for sm_100), or None:
        :func:`fused_tile_config`'s default for the call. Read by the ``tlx`` backend only.
    wgrad_copy: the grouped GEMM's tile config for a dW launch whose operands are both expert-major
        (the row copies), or None: its default. ``tlx`` backend only.
    layout_kernel: :func:`~tlx_dist.fused.fused_experts` sorts the slots by expert with the
        one-launch layout kernel where it runs (a CUDA GPU, or CPU under ``TRITON_INTERPRET=1``),
        which also writes the TLX kernels' scheduler tables; False: the torch sort (a few small
        kernels), as under torch.compile.
    precision: the operands' precision (:data:`PRECISIONS`).
    """

    x_rows: str = "auto"
    dout_rows: str = "auto"
    swiglu: Optional[TileConfig] = None
    scatter: Optional[TileConfig] = None
    dswiglu: Optional[TileConfig] = None
    dswiglu_copy: Optional[TileConfig] = None
    wgrad_a: Optional[TileConfig] = None
    wgrad_b: Optional[TileConfig] = None
    wgrad_copy: Optional[GroupedGemmConfig] = None
    layout_kernel: bool = True
    precision: str = "bf16"

    def __post_init__(self):
        for f in ("x_rows", "dout_rows"):
            if getattr(self, f) not in ROW_MODES:
                raise ValueError(f"FusedConfig.{f}={getattr(self, f)!r} must be one of {ROW_MODES}")
        for form in TILE_FORMS:
            cfg = getattr(self, form)
            if cfg is None:
                continue
            if not isinstance(cfg, tuple(_TILE_TYPES.values())):
                raise TypeError(f"FusedConfig.{form} must be a FusedTileConfig or BlackwellFusedTileConfig or None, "
                                f"got {type(cfg).__name__}")
            cfg.check_form(form, f"FusedConfig.{form}")
        if self.wgrad_copy is not None and not isinstance(self.wgrad_copy, GroupedGemmConfig):
            raise TypeError(f"FusedConfig.wgrad_copy must be a GroupedGemmConfig or None, "
                            f"got {type(self.wgrad_copy).__name__}")
        if type(self.layout_kernel) is not bool:
            raise TypeError(f"FusedConfig.layout_kernel={self.layout_kernel!r} must be a bool")
        if self.precision not in PRECISIONS:
            raise ValueError(f"FusedConfig.precision={self.precision!r} must be one of {PRECISIONS}")
        # the custom op's string argument, made once here: torch.compile then reads a constant
        object.__setattr__(self, "_json", _to_json(self))

    # --- what the launchers ask ---

    def tile(self, form: str, nn: int, arch: str, k_dim: int = 0) -> TileConfig:
        """The tile config ``form`` runs with on ``arch``: the field if set, else the default."""
        cfg = getattr(self, form)
        if cfg is None:
            return fused_tile_config(form, nn, arch, k_dim)
        if cfg.ARCH != arch:
            raise ValueError(f"FusedConfig.{form} is a {type(cfg).__name__} (for {cfg.ARCH}) but the fused kernels "
                             f"run on {arch}: give a {_TILE_TYPES[arch].__name__}")
        return cfg

    def copies_x(self, F: int, auto: bool) -> bool:
        """Whether x's rows are copied expert-major (``auto``: the primitives allow ``"auto"`` to copy)."""
        return _row_copy(self.x_rows, F, auto, X_COPY_MIN_F)

    def copies_dout(self, F: int, auto: bool) -> bool:
        return _row_copy(self.dout_rows, F, auto, DOUT_COPY_MIN_F)

    @property
    def pins_tiles(self) -> bool:
        """Whether a field the ``tlx`` backend alone reads is set."""
        return any(getattr(self, f) is not None for f in TILE_FORMS + ("wgrad_copy",))

    def check_arch(self, arch: str) -> None:
        """ValueError naming the field if a set tile config is for another generation than ``arch``."""
        for form in TILE_FORMS:
            cfg = getattr(self, form)
            if cfg is not None:
                self.tile(form, 0, arch)

    # --- mappings (TOML / JSON) and the custom op's string argument ---

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], arch: str = "sm_90", prefix: str = "fused") -> "FusedConfig":
        """From a mapping such as a TOML table: scalar fields as they are; a form's value is a
        mapping of tile fields that replace those of the form's base default on ``arch`` (its
        :data:`FORMS` / :data:`BLACKWELL_FORMS` entry; the width and depth rules are not applied);
        ``wgrad_copy`` a mapping of :class:`GroupedGemmConfig` fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{prefix}: unknown field(s) {unknown}; known: {sorted(names)}")
        kw = {}
        for k, v in d.items():
            if k in TILE_FORMS and v is not None:
                if arch not in _ARCH_FORMS:
                    raise ValueError(f"{prefix}.{k}: arch={arch!r} must be one of {sorted(_ARCH_FORMS)}")
                base = _ARCH_FORMS[arch][k]
                fields = {f.name for f in dataclasses.fields(base)}
                bad = sorted(set(v) - fields)
                if bad:
                    raise ValueError(f"{prefix}.{k}: unknown field(s) {bad} of {type(base).__name__} "
                                     f"(fields: {sorted(fields)})")
                kw[k] = dataclasses.replace(base, **v)
            elif k == "wgrad_copy" and v is not None:
                kw[k] = GroupedGemmConfig(**v)
            else:
                kw[k] = v
        return cls(**kw)

    def to_json(self) -> str:
        return self._json

    @staticmethod
    def from_json(text: str) -> "FusedConfig":
        return _from_json(text)


def _to_json(cfg: FusedConfig) -> str:
    d = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = {"type": type(v).__name__, **dataclasses.asdict(v)}
        d[f.name] = v
    return json.dumps(d, sort_keys=True)


_TYPES = {t.__name__: t for t in (FusedTileConfig, BlackwellFusedTileConfig, GroupedGemmConfig)}


@functools.lru_cache(maxsize=64)
def _from_json(text: str) -> FusedConfig:
    d = json.loads(text)
    for k, v in d.items():
        if isinstance(v, dict):
            v = dict(v)
            d[k] = _TYPES[v.pop("type")](**v)
    return FusedConfig(**d)


DEFAULT = FusedConfig()
