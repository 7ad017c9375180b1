"""Host side of the TLX fused expert kernels: Hopper (``tlx/hopper/fused_moe.py``, class ``_Hopper``)
and Blackwell (``tlx/blackwell/fused_moe.py``, class ``_Blackwell``; compile-checked, not yet run on a
B200). Both take the same launch arguments; what differs per generation (tile config dataclass, how
many A rows one TMA box holds, the kernels' partition constexprs) sits in the two small subclasses
of ``_TlxFused``.

Registers ``FusedBackend("tlx", priority=10)`` when TLX is importable and the GPU is sm_90 or sm_100;
each call runs the primitives of ``tlx.gpu_arch()`` (``_tlx_prims``). Launch
path per primitive: one config lookup (a frozen dataclass per form, cached per scalar key), the TMA
descriptors of the operands read in place, one launch; the scheduler's ``tile_cum`` prep runs once
per pass and is shared by its three ragged-M launches, and the dW tile order once per backward.
Nothing reads device values on the host, so the whole pass is CUDA-graph capturable.

Operand rules (else ``supports()`` gives the reason and the automatic choice falls back to the
portable kernels): bf16/fp16, D and F multiples of 64 (the gathered K loop has no column tail),
contiguous x / w13 / w2, 16-byte aligned bases.

``TLX_DIST_FUSED_CONFIG="swiglu:BN=128,STAGES=4;wgrad:BK=32"`` overrides fields of a form's config
for the generation that runs (``FusedTileConfig`` fields on sm_90, ``BlackwellFusedTileConfig`` on
sm_100; read when a form first runs at a given width). Forms: ``swiglu``, ``scatter`` (both scatter
launches), ``dswiglu``, ``wgrad_a`` (dW13, x gathered), ``wgrad_b`` (dW2, dout gathered); ``wgrad``
sets both dW forms.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

import tlx

from .backends import SCHED_BM, FusedBackend, compose_backward, compose_forward, phase_tile_cums, register_fused_backend

__all__ = ["FusedTileConfig", "BlackwellFusedTileConfig", "FORMS", "BLACKWELL_FORMS", "fused_config", "DSWIGLU_COPY_DEEP",
           "kernel_signature", "ENV_FUSED_CONFIG"]

ENV_FUSED_CONFIG = "TLX_DIST_FUSED_CONFIG"
_SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block, sm_90 and sm_100
_TMEM_COLS = 512  # Blackwell tensor memory: 128 lanes x 512 fp32 columns per SM
SWIGLU, SCATTER, DSWIGLU = 1, 2, 3


@dataclass(frozen=True)
class FusedTileConfig:
    """Tile config of one fused form. BM rows (two consumer groups of BM/2), BN columns (SwiGLU: BN
    gate + BN up columns), BK reduction step, STAGES ring depth, LAG stages between issuing a
    gathered stage and publishing it (<= STAGES - 2, see tlx/hopper/fused_moe.py), GROUP_M raster,
    REGS registers per consumer thread (the producer gets the rest). PREFETCH_H (dswiglu only): the
    producer TMA-loads each tile's h into shared memory during the main loop (64 KB at BN 128) instead
    of the epilogue reading it from global memory. Off: on an H200 (OLMoE, T=16384) it ran 1.78-2.57 ms
    against 1.56 ms without -- the stages it takes from the ring cost more than the loads it hides.
    EARLY_H (dswiglu only, not with PREFETCH_H, BN >= 64): each consumer prefetches its h lines (gate
    and up halves of its 64 rows) into L2 before the tile's main loop, so the epilogue's h loads hit
    L2 instead of waiting on HBM; no shared memory, no registers across the loop (loading h into
    registers there instead spilled ~1.8 KB a thread). On by default for dswiglu since session 11: on
    an H200 (``bench/fused_forms.py --forms dswiglu``, T=16384) the form ran 1.478 / 1.156 / 1.563 ms
    against 1.546 / 1.247 / 1.643 without (OLMoE / Qwen3-30B-A3B / DeepSeek-V2-Lite, 4-7% faster).
    An override that sets PREFETCH_H=1 or BN < 64 without naming EARLY_H turns it off.
    EPI_WG (scatter, dswiglu, dswiglu_copy; not with PREFETCH_H): 1 = a fourth warp group (EPI_REGS
    registers) runs both consumers' epilogues, 2 = one epilogue warp group per consumer (five warp
    groups). Each consumer stashes its fp32 accumulator in shared memory as column chunks of EPI_COLS
    (0 = BN/2) and goes on to the next tile's main loop (REGS then as low as max(96, BN/2 + 32); 2 *
    REGS + EPI_WG * EPI_REGS <= 456 leaves the producer 56). EPI_WG=1 is the scatter default (session
    13), EPI_WG=2 the dswiglu_copy default (session 14); the gathered dSwiGLU keeps its epilogue inline
    (its ring would drop from 6 stages to 4).
    PINGPONG (dswiglu_copy only: dSwiGLU reading dout's expert-major copy in place): each consumer
    computes every other tile whole (two 64-row fp32 accumulators, BN registers a thread) and the two
    take turns issuing their main loops, so one's epilogue (in EPI_COLS-column chunks) runs beside the
    other's MMAs. The dswiglu_copy default from a reduction depth of DSWIGLU_PINGPONG_MIN_D
    (``DSWIGLU_COPY_DEEP``, session 14)."""

    BM: int = 128
    BN: int = 128
    BK: int = 64
    STAGES: int = 4
    LAG: int = 2
    GROUP_M: int = 1
    REGS: int = 232
    PREFETCH_H: int = 0
    EARLY_H: int = 0
    EPI_WG: int = 0
    EPI_REGS: int = 152
    EPI_COLS: int = 0  # 0: BN / 2
    PINGPONG: int = 0

    def __post_init__(self):
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
        if self.PREFETCH_H not in (0, 1):
            raise ValueError(f"FusedTileConfig.PREFETCH_H={self.PREFETCH_H} must be 0 or 1")
        if self.EARLY_H not in (0, 1):
            raise ValueError(f"FusedTileConfig.EARLY_H={self.EARLY_H} must be 0 or 1")
        if self.EARLY_H and self.BN < 64:
            raise ValueError(f"FusedTileConfig.EARLY_H prefetches 128-byte lines: needs BN >= 64, got {self.BN}")
        if self.PINGPONG not in (0, 1):
            raise ValueError(f"FusedTileConfig.PINGPONG={self.PINGPONG} must be 0 or 1")
        if self.PINGPONG and (self.EPI_WG or self.PREFETCH_H):
            raise ValueError("FusedTileConfig.PINGPONG runs the epilogue in the consumers: "
                             "not with EPI_WG or PREFETCH_H")
        if self.PINGPONG and self.epi_cols not in (self.BN // 2, self.BN // 4):
            raise ValueError(f"FusedTileConfig.PINGPONG: EPI_COLS={self.EPI_COLS} must be BN/2 or BN/4 (0 = BN/4)")
        if self.PINGPONG and (self.BN > 128 or self.REGS < 232):
            # a consumer holds the whole tile (BN fp32 registers a thread) plus one chunk's epilogue:
            # below that, or at BN 256, ptxas spills 0.8-13 KB a thread
            raise ValueError(f"FusedTileConfig.PINGPONG needs BN <= 128 and REGS >= 232 "
                             f"(BN={self.BN}, REGS={self.REGS})")
        if self.EPI_WG not in (0, 1, 2):
            raise ValueError(f"FusedTileConfig.EPI_WG={self.EPI_WG} must be 0, 1 or 2")
        if self.EPI_WG:
            if self.PREFETCH_H:
                raise ValueError("FusedTileConfig.EPI_WG hands the epilogue to its own warp group: not with PREFETCH_H")
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
        if self.EARLY_H and self.PREFETCH_H:
            raise ValueError("FusedTileConfig.EARLY_H and PREFETCH_H are two ways to bring h early: pick one")

    @property
    def epi_cols(self) -> int:
        return self.EPI_COLS or (self.BN // 4 if self.PINGPONG else self.BN // 2)

    def smem_bytes(self, form: str) -> int:
        n_b = 2 if form == "swiglu" else 1
        ring = self.STAGES * (self.BM * self.BK + n_b * self.BK * self.BN) * 2
        h_tile = 2 * self.BM * self.BN * 2 if form.startswith("dswiglu") and self.PREFETCH_H else 0  # gate + up
        acc_tiles = self.BM * self.BN * 4 if self.EPI_WG else 0  # both consumers' fp32 accumulators
        return ring + h_tile + acc_tiles + (self.BM * self.BN * 2 if form.startswith("wgrad") else 0)


FORMS = {
    # gathered A + two B tiles per stage; 192 KB ring; fewer consumer registers leave the producer
    # room for its row pointers.
    "swiglu": FusedTileConfig(BN=128, BK=64, STAGES=4, LAG=2, REGS=216),
    # A by TMA; the epilogue (scale + fp32 atomics) in its own warp group, fed 32-column chunks of each
    # consumer's accumulator through 64 KB of shared memory while the consumers run the next tile:
    # 160 KB ring + 64 KB. On an H200 (x2_s28, T=16384, same process) the forward / dX scatter went
    # 1.223 / 1.960 -> 1.152 / 1.944 ms (OLMoE), 1.146 / 1.706 -> 0.976 / 1.614 (Qwen3-30B-A3B),
    # 7.637 / 13.73 -> 6.853 / 12.77 (DeepSeek-V3 per rank), Mixtral 6.05 / 12.26 -> 6.21 / 11.85;
    # before: 4 stages, REGS 232 and the epilogue inline (EPI_WG=0).
    "scatter": FusedTileConfig(BN=128, BK=64, STAGES=5, LAG=0, REGS=152, EPI_WG=1, EPI_REGS=152, EPI_COLS=32),
    # gathered dout + K-major w2; the epilogue holds g, hg, hu: 128 columns. A stage is half the MMA
    # time of SwiGLU's, so 5 stages of gathers in flight (LAG 4) cover the load latency; 192 KB ring.
    # REGS 232 since session 14 (h200_s16 / s17, T=16384, interleaved rounds: OLMoE 1.661 -> 1.500 ms,
    # DeepSeek-V2-Lite 1.616 -> 1.562 against 216).
    "dswiglu": FusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, REGS=232, EARLY_H=1),
    # the same with dout's rows read in place by TMA (TLX_DIST_FUSED_DOUT copy): one epilogue warp group
    # per consumer (EPI_WG=2, 16-column chunks), so each consumer's dSwiGLU runs beside both consumers'
    # next main loops. h200_s17 (T=16384, medians of 3 interleaved rounds, ms, inline -> this):
    # DeepSeek-V2-Lite 1.600 -> 1.419, OLMoE 1.499 -> 1.368, Qwen3-30B-A3B 1.207 -> 1.144. Deep K
    # (D >= DSWIGLU_PINGPONG_MIN_D) takes DSWIGLU_COPY_DEEP instead (fused_config).
    "dswiglu_copy": FusedTileConfig(BN=128, BK=64, STAGES=4, LAG=2, REGS=104, EARLY_H=1, EPI_WG=2, EPI_REGS=120,
                                    EPI_COLS=16),
    # dW13 = x[src]^T @ dh, A gathered (BK rows x 128 columns a stage, 16 KB by cp.async): BK 64
    # halves the per-stage overhead of the gather; 3 x 48 KB ring + 64 KB TMA-store tile. 1.55-1.79 ms
    # (three runs) vs 1.87 ms at BK 32 (OLMoE T=16384, bench/fused_forms.py on an H200).
    "wgrad_a": FusedTileConfig(BN=256, BK=64, STAGES=3, LAG=1, REGS=224),
    # dW2 = ag^T @ dout[dst], B gathered (BK rows x 256 columns): at BK 64 the gather is 32 KB a stage
    # and the kernel runs 3.4x slower (4.16 ms vs 1.24 ms), so BK 32; 144 KB ring + 64 KB store tile.
    "wgrad_b": FusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, REGS=224),
}
# ``wgrad`` in TLX_DIST_FUSED_CONFIG sets both dW forms.
_ALIASES = {"wgrad": ("wgrad_a", "wgrad_b")}


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

    def __post_init__(self):
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
    # until a B200 run says otherwise).
    "wgrad_a": BlackwellFusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, EPI_BN=64),
    "wgrad_b": BlackwellFusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, EPI_BN=64),
}
_ARCH_FORMS = {"sm_90": (FusedTileConfig, FORMS), "sm_100": (BlackwellFusedTileConfig, BLACKWELL_FORMS)}


@functools.lru_cache(maxsize=None)
def _env_overrides(text: str, arch: str = "sm_90") -> dict:
    cls, forms = _ARCH_FORMS[arch]
    out = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, _, fields = part.partition(":")
        name = name.strip().lower()
        if name not in forms and name not in _ALIASES:
            raise ValueError(f"{ENV_FUSED_CONFIG}: unknown form {name!r} in {text!r} "
                             f"(forms: {sorted(forms) + sorted(_ALIASES)})")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {}
        for item in fields.split(","):
            if not item.strip():
                continue
            k, _, v = item.partition("=")
            k = k.strip().upper()
            if k not in names:
                raise ValueError(f"{ENV_FUSED_CONFIG}: unknown field {k!r} in {text!r} (fields of {cls.__name__} "
                                 f"on {arch}: {sorted(names)})")
            kw[k] = int(v)
        if "EARLY_H" in names and "EARLY_H" not in kw and (kw.get("PREFETCH_H") or kw.get("BN", 64) < 64):
            kw["EARLY_H"] = 0  # the dSwiGLU default's early h loads exclude these: asking for them turns it off
        for form in _ALIASES.get(name, (name,)):
            cfg = dataclasses.replace(out.get(form, forms[form]), **kw)  # later parts refine earlier ones
            if getattr(cfg, "EPI_WG", 0) and form not in ("scatter", "dswiglu", "dswiglu_copy"):
                raise ValueError(f"{ENV_FUSED_CONFIG}: EPI_WG is an option of the scatter and dswiglu forms, "
                                 f"not {form}")
            if getattr(cfg, "PINGPONG", 0) and form != "dswiglu_copy":
                raise ValueError(f"{ENV_FUSED_CONFIG}: PINGPONG is an option of the dswiglu_copy form (dSwiGLU "
                                 f"reading dout's expert-major copy, TLX_DIST_FUSED_DOUT=copy), not {form}")
            if cfg.smem_bytes(form) > _SMEM_LIMIT:
                raise ValueError(f"{ENV_FUSED_CONFIG}: {form} config {cfg} needs {cfg.smem_bytes(form)} bytes of "
                                 "shared memory")
            if hasattr(cfg, "tmem_cols") and cfg.tmem_cols(form) > _TMEM_COLS:
                raise ValueError(f"{ENV_FUSED_CONFIG}: {form} config {cfg} needs {cfg.tmem_cols(form)} TMEM "
                                 f"columns (> {_TMEM_COLS})")
            out[form] = cfg
    return out


_CACHE: dict[tuple, object] = {}


# dSwiGLU from the dout copy with a deep reduction (K = D): the ping-pong consumers (each computes every
# other tile whole, one's epilogue beside the other's main loop). h200_s17 (T=16384, ms, inline /
# EPI_WG=2 / this): DeepSeek-V3 per rank (D 7168) 7.740 / 7.498 / 6.396, Mixtral (D 4096) 8.691 /
# 7.866 / 7.734; at D 2048 it lost to EPI_WG=2 (OLMoE 1.653 vs 1.368).
DSWIGLU_PINGPONG_MIN_D = 4096
DSWIGLU_COPY_DEEP = FusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, REGS=232, EARLY_H=1, PINGPONG=1, EPI_COLS=32)


def fused_config(form: str, nn: int, arch: str = "sm_90", k_dim: int = 0):
    """Config of ``form`` on ``arch`` for an output ``nn`` columns wide: the env override, else the
    default, with GROUP_M = 8 once the output has >= 16 column tiles (as the landed kernel does for
    Mixtral), or for the Hopper dW forms >= WGRAD_GROUP_TILES (Mixtral's dW13, 112 tiles of 256: 14.8 ->
    12.4 ms on an H200, consecutive tiles reading the same gathered rows; x2_s27). Resolved once per
    (form, nn, arch, k_dim) and cached: the launch path does one dict lookup (reading the environment
    costs more than that). ``k_dim`` (the reduction depth) picks DSWIGLU_COPY_DEEP for ``dswiglu_copy``
    on sm_90 from DSWIGLU_PINGPONG_MIN_D."""
    key = (form, nn, arch, k_dim)
    cfg = _CACHE.get(key)
    if cfg is None:
        over = _env_overrides(os.environ.get(ENV_FUSED_CONFIG, ""), arch)
        cfg = over.get(form, _ARCH_FORMS[arch][1][form])
        if form == "dswiglu_copy" and form not in over and arch == "sm_90" and k_dim >= DSWIGLU_PINGPONG_MIN_D:
            cfg = DSWIGLU_COPY_DEEP
        tiles_n = -(-nn // cfg.BN)
        if form not in over and (tiles_n >= 16 if not form.startswith("wgrad")
                                 else arch == "sm_90" and tiles_n >= WGRAD_GROUP_TILES):
            cfg = dataclasses.replace(cfg, GROUP_M=8)
        _CACHE[key] = cfg
    return cfg


WGRAD_GROUP_TILES = 32  # column tiles of a dW output from which its tiles walk in groups of 8 rows (sm_90)


# --- checks -----------------------------------------------------------------------------------------


def _supports(x_RD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor) -> Optional[str]:
    if not tlx.tlx_available():
        return "TLX (fbtriton) is not importable"
    if tlx.gpu_arch() not in _ARCH_FORMS:
        return f"gpu_arch()={tlx.gpu_arch()} (the fused TLX kernels target sm_90 and sm_100)"
    if x_RD.device.type != "cuda":
        return f"operands are on {x_RD.device}, not a CUDA GPU"
    if x_RD.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x_RD.dtype} (the TLX kernels take bfloat16 or float16)"
    D, F = w2_EFD.shape[2], w2_EFD.shape[1]
    if D % 64 or F % 64:
        return f"D={D} and F={F} must be multiples of 64"
    for name, t in (("x", x_RD), ("w13", w13_EDF2), ("w2", w2_EFD)):
        if not t.is_contiguous():
            return f"{name} must be contiguous (strides {tuple(t.stride())})"
        if not torch.compiler.is_compiling() and t.data_ptr() % 16:
            return f"{name} needs a 16-byte aligned base address"
    return None


# --- launches ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(device: torch.device, bound: int) -> int:
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(sms, bound))


class _TlxFused:
    """Launchers of the TLX fused kernels; a subclass per generation says which kernels, configs
    and partition constexprs. The primitives (``backends.py``) are classmethods."""

    ARCH = ""
    A_SPLIT = 1  # A rows per TMA box = BM / A_SPLIT (Hopper: two consumer warp groups)
    AUTO_ROW_COPY = False  # TLX_DIST_FUSED_DOUT / _X "auto" may copy rows (backends._dout_rows, _x_rows):
    # where it was measured (the Hopper subclass)

    @staticmethod
    def tile_cum(offsets_E, n_rows, x=None):
        from ..grouped_gemm.host import prep_tile_cum

        return prep_tile_cum(offsets_E, n_rows, SCHED_BM) if n_rows else None

    @staticmethod
    def wgrad_order(offsets_E):
        from ..grouped_gemm.host import lpt_order

        return lpt_order(offsets_E)  # experts by row count, longest first (tlx/common/scheduler.py)

    @classmethod
    def _mm(cls, form, epilogue, a, src, w_desc_args, offsets, tile_cum, n_rows, K, nn, f_off, b_kmajor,
            c, c2=None, dst=None, scale=None, h=None, part=None, virt=1, grid_cap=None):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from ..grouped_gemm.host import max_m_tiles, search_steps

        cfg = fused_config(form, nn, cls.ARCH, K)
        w, shape, strides = w_desc_args
        E = shape[0] * virt  # virt > 1: the tile walk's virtual experts (runs of each expert's rows)
        block = [1, cfg.BN, cfg.BK] if b_kmajor else [1, cfg.BK, cfg.BN]
        b_desc = TensorDescriptor(w, shape, strides, block)
        a_desc = None
        if src is None:  # A read in place: TMA
            a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.BM // cls.A_SPLIT, cfg.BK])
        grid = _grid(a.device, max_m_tiles(n_rows, E, cfg.BM) * -(-nn // cfg.BN))
        if grid_cap is not None:
            grid = max(1, min(grid, grid_cap))
        if virt > 1 and not cls.PHASED:
            raise ValueError(f"the {cls.ARCH} fused kernels take no virtual experts (virt={virt})")
        virt_meta = {"VIRT": virt} if cls.PHASED else {}
        cls._mm_kernel()[(grid,)](
            a_desc, a if src is not None else None, src, b_desc, offsets, tile_cum,
            c, c2, dst, scale, h, part, n_rows, E, K, nn, f_off, a.stride(0), c.stride(0),
            c2.stride(0) if c2 is not None else 0, h.stride(0) if h is not None else 0,
            part.stride(0) if part is not None else 0,
            EPILOGUE=epilogue, A_GATHER=src is not None, HAS_SCALE=scale is not None, B_KMAJOR=b_kmajor,
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NUM_STAGES=cfg.STAGES, NUM_SMS=grid, SEARCH_STEPS=search_steps(E),
            GROUP_M=cfg.GROUP_M, **cls._meta(cfg), **cls._h_args(epilogue, h, cfg), **cls._pp_args(epilogue, src, cfg),
            **virt_meta, num_warps=4, num_stages=1)

    @staticmethod
    def _pp_args(epilogue, src, cfg) -> dict:
        return {}  # kernels without the ping-pong consumers

    PHASED = False  # kernels that take VIRT (backends.compose_forward's overlapped form): Hopper's

    @staticmethod
    def phase_tile_cums(offsets_V, n_rows, x):
        return phase_tile_cums(offsets_V, n_rows, SCHED_BM)

    @staticmethod
    def free_sms(device, side_sms):
        """The persistent grid of a launch that runs beside a ``side_sms``-program kernel."""
        return max(1, _num_sms(device.index if device.index is not None else torch.cuda.current_device()) - side_sms)

    @classmethod
    def gate_up_swiglu(cls, x_RD, src_N, w13_EDF2, offsets_E, tile_cum, virt=1, grid_cap=None, out=None):
        N, (E, D, F2) = (src_N if src_N is not None else x_RD).shape[0], w13_EDF2.shape
        h, a = out if out is not None else (x_RD.new_empty(N, F2), x_RD.new_empty(N, F2 // 2))
        if N:
            w = (w13_EDF2, [E, D, F2], [w13_EDF2.stride(0), w13_EDF2.stride(1), 1])
            cls._mm("swiglu", SWIGLU, x_RD, src_N, w, offsets_E, tile_cum, N, D, F2 // 2, F2 // 2, False, h, c2=a,
                    virt=virt, grid_cap=grid_cap)
        return h, a

    @classmethod
    def down_scatter(cls, a_NF, w_EFD, offsets_E, dst_N, scale_N, num_dst, tile_cum, virt=1, grid_cap=None,
                     out=None):
        E, K, NN = w_EFD.shape
        if out is None:
            out = torch.zeros(num_dst, NN, dtype=torch.float32, device=a_NF.device)
        N = a_NF.shape[0]
        if N:
            b_kmajor = w_EFD.stride(2) != 1  # dX of GEMM 1: w13^T, read K-major
            if b_kmajor:
                w = (w_EFD, [E, NN, K], [w_EFD.stride(0), w_EFD.stride(2), 1])
            else:
                w = (w_EFD, [E, K, NN], [w_EFD.stride(0), w_EFD.stride(1), 1])
            cls._mm("scatter", SCATTER, a_NF, None, w, offsets_E, tile_cum, N, K, NN, 0, b_kmajor, out,
                    dst=dst_N, scale=scale_N, virt=virt, grid_cap=grid_cap)
        return out

    @classmethod
    def down_dswiglu(cls, dout_TD, dst_N, w2_EFD, offsets_E, h_N2F, gate_N, tile_cum):
        N, (E, F, D) = h_N2F.shape[0], w2_EFD.shape
        dh = h_N2F.new_empty(N, 2 * F)
        ag = h_N2F.new_empty(N, F)
        form = "dswiglu" if dst_N is not None else "dswiglu_copy"  # gathered rows, or the copy read by TMA
        cfg = fused_config(form, F, cls.ARCH, D)
        part = torch.empty(N, -(-F // cfg.BN), dtype=torch.float32, device=h_N2F.device)
        if N:
            w = (w2_EFD, [E, F, D], [w2_EFD.stride(0), w2_EFD.stride(1), 1])  # w2^T read K-major
            cls._mm(form, DSWIGLU, dout_TD.contiguous(), dst_N, w, offsets_E, tile_cum, N, D, F, F, True,
                    dh, c2=ag, scale=gate_N, h=h_N2F, part=part)
        return dh, ag, part.sum(1)

    @classmethod
    def wgrad_gather(cls, a, ia_N, b, ib_N, offsets_E, order=None):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from ..grouped_gemm.host import ragged_descriptor

        E, D, F = offsets_E.shape[0], a.shape[1], b.shape[1]
        N = (ia_N if ia_N is not None else a).shape[0]
        if ia_N is None and ib_N is None and N:
            # both operands expert-major already (the dout copy): the landed grouped dW kernel, with its
            # own longest-expert-first order and config (TLX_DIST_GROUPED_MM_* apply)
            from ..grouped_gemm.backends import get_backend

            return get_backend("tlx").wgrad(a, b.contiguous(), offsets_E, order=order, trusted=True)
        dw = a.new_empty(E, D, F)
        if N == 0:
            return dw.zero_()
        b = b.contiguous()
        cfg = fused_config("wgrad_a" if ia_N is not None else "wgrad_b", F, cls.ARCH)
        a_rows = cfg.BM // cls.A_SPLIT
        a_desc = None if ia_N is not None else ragged_descriptor(a, cfg.BK, a_rows)
        b_desc = None if ib_N is not None else ragged_descriptor(b, cfg.BK, cfg.BN)
        c_desc = TensorDescriptor(dw, [E, D, F], [D * F, F, 1], [1, a_rows, cls._c_cols(cfg)])
        grid = _grid(a.device, E * -(-D // cfg.BM) * -(-F // cfg.BN))
        order = cls.wgrad_order(offsets_E) if order is None else order
        cls._wgrad_kernel()[(grid,)](
            a_desc, a if ia_N is not None else None, ia_N, b_desc, b if ib_N is not None else None, ib_N, c_desc,
            offsets_E, order, *cls._wgrad_sched(a.device), N, E, D, F, a.stride(0), b.stride(0),
            A_GATHER=ia_N is not None, B_GATHER=ib_N is not None, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
            NUM_STAGES=cfg.STAGES, NUM_SMS=grid, GROUP_M=cfg.GROUP_M, **cls._wgrad_meta(cfg),
            num_warps=4, num_stages=1)
        return dw


class _Hopper(_TlxFused):
    """tlx/hopper/fused_moe.py: producer warp group + two consumer warp groups of BM/2 rows."""

    ARCH = "sm_90"
    A_SPLIT = 2
    PHASED = True
    AUTO_ROW_COPY = True  # measured on H200s (backends.DOUT_COPY_MIN_F, X_COPY_MIN_F)

    @staticmethod
    def _mm_kernel():
        from tlx.hopper.fused_moe import _fused_mm_hopper_kernel

        return _fused_mm_hopper_kernel

    @staticmethod
    def _wgrad_kernel():
        from tlx.hopper.fused_moe import _fused_wgrad_hopper_kernel

        return _fused_wgrad_hopper_kernel

    @staticmethod
    def _meta(cfg) -> dict:
        return dict(LAG=cfg.LAG, CONSUMER_REGS=cfg.REGS, EPI_WG=cfg.EPI_WG, EPI_REGS=cfg.EPI_REGS,
                    EPI_COLS=cfg.epi_cols)

    @staticmethod
    def _pp_args(epilogue, src, cfg) -> dict:
        """PINGPONG: dSwiGLU with its A operand read in place (src None: the dout copy) only."""
        return dict(PINGPONG=bool(cfg.PINGPONG) and epilogue == DSWIGLU and src is None)

    @staticmethod
    def _h_args(epilogue, h, cfg) -> dict:
        """dSwiGLU with PREFETCH_H: a TMA descriptor over h [N, 2F] in boxes of one consumer half;
        EARLY_H: the consumers' early h loads (no descriptor)."""
        early = epilogue == DSWIGLU and bool(cfg.EARLY_H)
        if epilogue != DSWIGLU or not cfg.PREFETCH_H or h is None or (h.shape[1] // 2) % cfg.BN:
            return dict(h_desc=None, PREFETCH_H=False, EARLY_H=early)  # (the gate box must end at F)
        from triton.tools.tensor_descriptor import TensorDescriptor

        return dict(h_desc=TensorDescriptor(h, list(h.shape), [h.stride(0), 1], [cfg.BM // 2, cfg.BN]),
                    PREFETCH_H=True, EARLY_H=False)

    @staticmethod
    def _c_cols(cfg) -> int:
        return cfg.BN

    @staticmethod
    def _wgrad_sched(device) -> tuple:
        # the dW tiles' atomic claim counter (DYNAMIC), zeroed per launch (a memset under capture)
        return (torch.zeros(1, dtype=torch.int32, device=device),)

    @staticmethod
    def _wgrad_meta(cfg) -> dict:
        return dict(DYNAMIC=True, LAG=cfg.LAG, CONSUMER_REGS=cfg.REGS)


class _Blackwell(_TlxFused):
    """tlx/blackwell/fused_moe.py: producer (1 or 4 warps), tcgen05 MMA warp, epilogue warp group."""

    ARCH = "sm_100"
    A_SPLIT = 1
    PHASED = True

    @staticmethod
    def _mm_kernel():
        from tlx.blackwell.fused_moe import _fused_mm_blackwell_kernel

        return _fused_mm_blackwell_kernel

    @staticmethod
    def _wgrad_kernel():
        from tlx.blackwell.fused_moe import _fused_wgrad_blackwell_kernel

        return _fused_wgrad_blackwell_kernel

    @staticmethod
    def _h_args(epilogue, h, cfg) -> dict:
        return {}  # the epilogue warp group reads h itself

    @staticmethod
    def _meta(cfg) -> dict:
        return dict(LAG=cfg.LAG, EPI_BN=cfg.EPI_BN, LOAD_WARPS=cfg.LOAD_WARPS, LOAD_REGS=cfg.LOAD_REGS)

    @staticmethod
    def _c_cols(cfg) -> int:
        return cfg.EPI_BN  # the epilogue stores the TMEM accumulator in EPI_BN-column slices

    @staticmethod
    def _wgrad_sched(device) -> tuple:
        return ()  # static walk of the longest-first order: no claim counter

    @staticmethod
    def _wgrad_meta(cfg) -> dict:
        return _Blackwell._meta(cfg)


_PRIMS = {"sm_90": _Hopper, "sm_100": _Blackwell}


def _tlx_prims() -> type:
    """The primitives of the detected (or overridden) generation."""
    arch = tlx.gpu_arch()
    if arch not in _PRIMS:
        raise ValueError(f"the fused TLX kernels target sm_90 and sm_100, not gpu_arch()={arch!r}")
    return _PRIMS[arch]


# --- compile-only signatures (tests, no GPU) ---------------------------------------------------------


def kernel_signature(form: str, E: int = 64, dtype: str = "bf16", cfg=None, arch: str = "sm_90"):
    """(kernel, signature, constexprs, attrs, options) for ``triton.compile`` of one form on ``arch``
    without a GPU. ``form``: ``swiglu``, ``scatter`` (fwd, w2 N-major), ``scatter_t`` (dX of GEMM 1,
    w13^T K-major), ``dswiglu``, ``dswiglu_copy`` / ``swiglu_copy`` (their A read in place: the dout /
    x copies, TLX_DIST_FUSED_DOUT / _X), ``wgrad_a`` (dW13: A gathered), ``wgrad_b`` (dW2: B gathered). Integer
    and pointer arguments carry the 16-divisibility the launcher specialises on (D, F multiples of 64);
    every constexpr is given explicitly (``ASTSource`` applies no defaults)."""
    from ..grouped_gemm.host import search_steps

    p = _PRIMS[arch]
    base = {"scatter_t": "scatter", "dswiglu_copy": "dswiglu", "swiglu_copy": "swiglu"}.get(form, form)
    cfg = cfg or _ARCH_FORMS[arch][1].get(form, _ARCH_FORMS[arch][1][base])
    a_rows = cfg.BM // p.A_SPLIT
    none = "constexpr"
    if not base.startswith("wgrad"):
        fn = p._mm_kernel()
        gather = form in ("swiglu", "dswiglu")
        kmajor = form in ("scatter_t", "dswiglu", "dswiglu_copy")
        b_block = f"[1,{cfg.BN},{cfg.BK}]" if kmajor else f"[1,{cfg.BK},{cfg.BN}]"
        sig = {"a_desc": none if gather else f"tensordesc<{dtype}[{a_rows},{cfg.BK}]>",
               "a_ptr": f"*{dtype}" if gather else none, "src_ptr": "*i32" if gather else none,
               "b_desc": f"tensordesc<{dtype}{b_block}>", "offsets_ptr": "*i32", "tile_cum_ptr": "*i32",
               "c_ptr": "*fp32" if base == "scatter" else f"*{dtype}",
               "c2_ptr": none if base == "scatter" else f"*{dtype}",
               "dst_ptr": "*i32" if base == "scatter" else none,
               "scale_ptr": "*fp32" if form in ("scatter", "dswiglu", "dswiglu_copy") else none,
               "h_ptr": f"*{dtype}" if base == "dswiglu" else none,
               "part_ptr": "*fp32" if base == "dswiglu" else none}
        ints = ["N_ROWS", "E", "K_DIM", "NN", "F_OFF", "stride_an", "stride_cn", "stride_c2n", "stride_hn", "stride_pn"]
        epi = {"swiglu": SWIGLU, "scatter": SCATTER, "dswiglu": DSWIGLU}[base]
        constexprs = {"EPILOGUE": epi, "A_GATHER": gather, "HAS_SCALE": form in ("scatter", "dswiglu", "dswiglu_copy"),
                      "B_KMAJOR": kmajor, "SEARCH_STEPS": search_steps(E)}
        constexprs.update(p._meta(cfg))
        if "PREFETCH_H" in fn.arg_names:
            pre = base == "dswiglu" and bool(cfg.PREFETCH_H)
            sig["h_desc"] = f"tensordesc<{dtype}[{a_rows},{cfg.BN}]>" if pre else none
            constexprs["PREFETCH_H"] = pre
        if "EARLY_H" in fn.arg_names:
            constexprs["EARLY_H"] = base == "dswiglu" and bool(getattr(cfg, "EARLY_H", 0))
        if "VIRT" in fn.arg_names:
            constexprs["VIRT"] = 1
        if "PINGPONG" in fn.arg_names:
            constexprs["PINGPONG"] = form == "dswiglu_copy" and bool(getattr(cfg, "PINGPONG", 0))
    else:
        fn = p._wgrad_kernel()
        ga, gb = form == "wgrad_a", form == "wgrad_b"
        sig = {"a_desc": none if ga else f"tensordesc<{dtype}[1,1,{cfg.BK},{a_rows}]>",
               "a_ptr": f"*{dtype}" if ga else none, "ia_ptr": "*i32" if ga else none,
               "b_desc": none if gb else f"tensordesc<{dtype}[1,1,{cfg.BK},{cfg.BN}]>",
               "b_ptr": f"*{dtype}" if gb else none, "ib_ptr": "*i32" if gb else none,
               "c_desc": f"tensordesc<{dtype}[1,{a_rows},{p._c_cols(cfg)}]>", "offsets_ptr": "*i32",
               "order_ptr": "*i32", "sched_ptr": "*i32"}
        ints = ["N_ROWS", "E", "M_DIM", "NN", "stride_an", "stride_bn"]
        constexprs = {"A_GATHER": ga, "B_GATHER": gb}
        constexprs.update(p._wgrad_meta(cfg))
    names = fn.arg_names
    sig = {k: v for k, v in sig.items() if k in names}
    for k, v in list(sig.items()):
        if v == none:
            constexprs[k] = None
    sig.update({k: "i32" for k in ints})
    constexprs.update({"BM": cfg.BM, "BN": cfg.BN, "BK": cfg.BK, "NUM_STAGES": cfg.STAGES, "NUM_SMS": 132,
                       "GROUP_M": cfg.GROUP_M})
    for k in constexprs:
        sig[k] = "constexpr"
    sig = {k: sig[k] for k in names}
    # D and F are multiples of 64, so are these (N_ROWS, E and the partials' stride are not).
    div16 = {"K_DIM", "NN", "F_OFF", "M_DIM", "stride_an", "stride_bn", "stride_cn", "stride_c2n", "stride_hn"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*") or k in div16}
    return fn, sig, constexprs, attrs, {"num_warps": 4, "num_stages": 1}


def _tlx_forward(*a, sched=None, overlap=None):
    return compose_forward(_tlx_prims(), *a, sched=sched, overlap=overlap)


def _tlx_backward(*a, sched=None):
    return compose_backward(_tlx_prims(), *a, sched=sched)


if tlx.tlx_available() and tlx.gpu_arch() in _PRIMS:
    register_fused_backend(FusedBackend("tlx", _tlx_forward, _tlx_backward, _supports, priority=10))
