"""Host side of the TLX grouped GEMM (``tlx/hopper/grouped_gemm.py``, ``tlx/blackwell/grouped_gemm.py``).

Registers the sm_90 / sm_100 implementation of ``Backend("tlx", priority=10)`` when ``tlx.tlx_available()``
(``amd_backend.py`` registers the gfx94x one). One kernel per architecture runs the three forms:

* forward ``y_NF = x_ND @ w_EDF`` (weight N-contiguous),
* dX ``dx_ND = dy_NF @ w_EDF^T`` via ``mm(dy, w.transpose(1, 2))`` (weight K-contiguous),
* weight gradient ``dw_EDF[e] = x[rows e]^T @ dy[rows e]``.

Operands the TMA path cannot take (misaligned rows/strides, fp32, other layouts) make ``supports()``
return a reason (the automatic choice falls back to the ``triton`` backend), or, for the weight
gradient, whose ``dy`` the selector does not see, delegate to the portable kernel.

Tile configs are a frozen dataclass; the choice is cached per scalar key (form, E, K, NN, row
bucket, dtype, arch). ``TLX_DIST_GROUPED_MM_CONFIG="BM=128,BN=256,BK=64,STAGES=3"`` pins one;
``TLX_DIST_GROUPED_MM_AUTOTUNE=1`` times the candidates once per key on the real operands (never
while a CUDA graph is being captured). Nothing reads device values on the host.

Hopper dW walks its tiles longest expert first and claims them from an atomic counter (see
tlx/common/scheduler.py): the heavy experts of imbalanced routing start first and the other SMs
fill in around them. ``TLX_DIST_GROUPED_MM_DW_SCHED=static`` restores the plain round-robin walk
(for A/B measurements). Both are deterministic: each tile is summed whole by one CTA in K order.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

import tlx

from .registry import Backend, register_backend, register_unavailable

__all__ = ["GroupedGemmConfig", "TileSpec", "CANDIDATES", "pick_config", "operand_reason", "kernel_signature",
           "ENV_CONFIG", "ENV_AUTOTUNE", "ENV_DW_SCHED"]

ENV_CONFIG = "TLX_DIST_GROUPED_MM_CONFIG"
ENV_AUTOTUNE = "TLX_DIST_GROUPED_MM_AUTOTUNE"
ENV_DW_SCHED = "TLX_DIST_GROUPED_MM_DW_SCHED"
_ARCH_CC = {"sm_90": 90, "sm_100": 100}


@dataclass(frozen=True)
class GroupedGemmConfig:
    BM: int = 128
    BN: int = 256
    BK: int = 64
    STAGES: int = 3
    GROUP_M: int = 1  # rows of tiles walked together (L2 reuse); Hopper only, 1 = row-major

    def __post_init__(self):
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

    def smem_bytes(self, cc: int) -> int:
        ring = self.STAGES * (self.BM * self.BK + self.BK * self.BN) * 2
        epi = self.BM * self.BN * 2 if cc == 90 else 2 * self.BM * min(self.BN, 128) * 2
        return ring + epi

    @staticmethod
    def parse(text: str) -> "GroupedGemmConfig":
        fields = {f.name for f in dataclasses.fields(GroupedGemmConfig)}
        kw = {}
        for part in text.split(","):
            if not part.strip():
                continue
            k, _, v = part.partition("=")
            k = k.strip().upper()
            if k not in fields:
                raise ValueError(f"{ENV_CONFIG}: unknown field {k!r} in {text!r} (fields: {sorted(fields)})")
            kw[k] = int(v)
        return GroupedGemmConfig(**kw)


CANDIDATES = {
    90: (GroupedGemmConfig(128, 256, 64, 3), GroupedGemmConfig(128, 128, 64, 4), GroupedGemmConfig(256, 128, 64, 3),
         GroupedGemmConfig(128, 256, 64, 3, 8), GroupedGemmConfig(128, 128, 64, 5, 8),
         GroupedGemmConfig(256, 128, 64, 3, 8), GroupedGemmConfig(128, 256, 32, 6, 8)),
    100: (GroupedGemmConfig(128, 256, 64, 3), GroupedGemmConfig(128, 128, 64, 4)),
}
_SMEM_LIMIT = {90: 227 * 1024, 100: 227 * 1024}


@dataclass(frozen=True)
class TileSpec:
    """What ``pick_config`` needs to know about one compile target (sm_90, sm_100, an AMD gfx)."""

    key: object  # the target's part of the config cache key
    candidates: tuple  # GroupedGemmConfig candidates timed under TLX_DIST_GROUPED_MM_AUTOTUNE=1
    smem_limit: int  # bytes of shared memory (LDS) one CTA may use
    smem_bytes: Callable[[GroupedGemmConfig], int]
    default: Callable[[str, int, int, int, int], GroupedGemmConfig]  # (form, n_rows, E, K, NN) -> config


def _nv_spec(cc: int) -> TileSpec:
    return TileSpec(cc, CANDIDATES[cc], _SMEM_LIMIT[cc], lambda c: c.smem_bytes(cc),
                    functools.partial(_default_config, cc))


# --- checks -----------------------------------------------------------------------------------------


def _arch_cc() -> Optional[int]:
    return _ARCH_CC.get(tlx.gpu_arch())


def _tma_2d_reason(name: str, t: torch.Tensor) -> Optional[str]:
    esz = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})"
    # The base address is not traceable (torch.compile, and AOT tracing of a backward or opcheck, where
    # is_compiling() is False but the tensor is a FakeTensor/FunctionalTensor): there the check moves
    # into _mm, which runs eagerly inside the custom op and falls back to the portable kernel if it fails.
    misaligned_base = False
    if not torch.compiler.is_compiling() and not isinstance(t, FakeTensor):
        try:
            misaligned_base = t.data_ptr() % 16 != 0
        except RuntimeError:  # "Cannot access data pointer of Tensor": traced
            misaligned_base = False
    if any((s * esz) % 16 for s in t.stride()[:-1]) or misaligned_base:
        return f"{name} needs a 16-byte aligned base and row strides for TMA (strides {tuple(t.stride())})"
    return None


def _supports(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> Optional[str]:
    if not tlx.tlx_available():
        return "TLX (fbtriton) is not importable"
    if tlx.gpu_arch() not in _ARCH_CC:
        return f"gpu_arch()={tlx.gpu_arch()} (the TLX kernels target sm_90 and sm_100)"
    return operand_reason(x_ND, w_EDF)


def operand_reason(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> Optional[str]:
    """Why the TLX kernels cannot take these operands (TMA on NVIDIA, 16-byte vector loads on AMD
    need the same layouts), or None."""
    if x_ND.device.type != "cuda":
        return f"operands are on {x_ND.device}, not a CUDA GPU"
    if x_ND.dtype not in (torch.bfloat16, torch.float16) or w_EDF.dtype != x_ND.dtype:
        return f"dtype {x_ND.dtype} (the TLX kernels take bfloat16 or float16; float32 runs on 'triton')"
    D, F = w_EDF.shape[1], w_EDF.shape[2]
    if D == 0 or F == 0 or w_EDF.shape[0] == 0:
        return f"empty dimension (E, D, F) = {tuple(w_EDF.shape)}"
    if (D * 2) % 16 or (F * 2) % 16:
        return f"D={D} and F={F} must be multiples of 8 for 16-byte aligned TMA rows"
    why = _tma_2d_reason("x_ND", x_ND)
    if why:
        return why
    if w_EDF.stride(2) == 1:
        w_view = w_EDF
    elif w_EDF.stride(1) == 1:
        w_view = w_EDF.transpose(1, 2)
    else:
        return f"w_EDF must be contiguous in its last or second-to-last dimension (strides {tuple(w_EDF.stride())})"
    return _tma_2d_reason("w_EDF", w_view)


# --- configs ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_CACHE: dict[tuple, GroupedGemmConfig] = {}


def _default_config(cc: int, form: str, n_rows: int, E: int, K: int, NN: int) -> GroupedGemmConfig:
    # 128x256 tiles (each consumer group 64x256) have the most arithmetic per byte of shared memory;
    # narrow outputs waste half a 256-wide tile, so take 128x128 there.
    if NN <= 128 or (NN % 256 and NN % 256 <= 128 and NN < 1024):
        return GroupedGemmConfig(128, 128, 64, 4)
    # Wide outputs (>= 16 column tiles, e.g. Mixtral's F=14336): a row-major walk has the 132 tiles in
    # flight read all of B (117 MB for one Mixtral expert, twice the L2) per wave; walking 8 rows of
    # tiles together keeps ~45 MB of operands in flight instead.
    group_m = 8 if cc == 90 and -(-NN // 256) >= 16 else 1
    return GroupedGemmConfig(128, 256, 64, 3, group_m)


def pick_config(cc, form: str, n_rows: int, E: int, K: int, NN: int, dtype: torch.dtype,
                bench=None) -> GroupedGemmConfig:
    """The tile config for a call: pinned (env) > cached > timed (env, not capturing) > default.
    ``cc``: 90 or 100, or the :class:`TileSpec` of another target. The key holds scalars only; rows
    are bucketed to powers of two."""
    spec = cc if isinstance(cc, TileSpec) else _nv_spec(cc)
    pinned = os.environ.get(ENV_CONFIG)
    if pinned:
        cfg = GroupedGemmConfig.parse(pinned)
        if spec.smem_bytes(cfg) > spec.smem_limit:
            raise ValueError(f"{ENV_CONFIG}={pinned!r} needs {spec.smem_bytes(cfg)} bytes of shared memory "
                             f"(limit {spec.smem_limit} on {spec.key})")
        return cfg
    key = (spec.key, form, E, K, NN, 1 << max(0, n_rows - 1).bit_length(), str(dtype))
    cfg = _CACHE.get(key)
    if cfg is not None:
        return cfg
    cfg = spec.default(form, n_rows, E, K, NN)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if bench is not None and not capturing and os.environ.get(ENV_AUTOTUNE, "0") == "1":
        import triton

        fits = [c for c in spec.candidates if spec.smem_bytes(c) <= spec.smem_limit]
        times = {c: triton.testing.do_bench(lambda c=c: bench(c), warmup=5, rep=20) for c in fits}
        cfg = min(times, key=times.get)
    _CACHE[key] = cfg
    return cfg


# --- launch -----------------------------------------------------------------------------------------


def _kernel(cc: int):
    if cc == 90:
        from tlx.hopper.grouped_gemm import _grouped_gemm_hopper_kernel as k
    else:
        from tlx.blackwell.grouped_gemm import _grouped_gemm_blackwell_kernel as k
    return k


def _a_rows(cc: int, cfg: GroupedGemmConfig) -> int:
    # Hopper splits the M tile between two consumer warp groups; Blackwell's MMA takes all of it.
    return cfg.BM // 2 if cc == 90 else cfg.BM


def _c_cols(cc: int, cfg: GroupedGemmConfig) -> int:
    # Blackwell's epilogue stores the TMEM accumulator in column slices of at most 128.
    return cfg.BN if cc == 90 else min(cfg.BN, 128)


def _launch(cc, cfg, wgrad, b_kmajor, a_desc, b_desc, c_desc, offsets, tile_cum, n_rows, E, M_DIM, K_DIM, NN,
            n_tiles_bound, device, order=None):
    from .host import search_steps

    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    grid = (max(1, min(sms, n_tiles_bound)),)
    common = dict(WGRAD=wgrad, B_KMAJOR=b_kmajor, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NUM_STAGES=cfg.STAGES,
                  NUM_SMS=grid[0], SEARCH_STEPS=search_steps(E), num_warps=4, num_stages=1)
    if cc == 90:
        common["GROUP_M"] = cfg.GROUP_M
        # order is None: static round-robin tile walk; else longest-expert-first + atomic tile claims
        # from a counter zeroed here (a memset node under CUDA-graph capture).
        dynamic = order is not None
        sched = torch.zeros(1, dtype=torch.int32, device=device) if dynamic else tile_cum
        _kernel(cc)[grid](a_desc, b_desc, c_desc, offsets, tile_cum, order if dynamic else tile_cum, sched,
                          n_rows, E, M_DIM, K_DIM, NN, DYNAMIC=dynamic, **common)
    else:
        _kernel(cc)[grid](a_desc, b_desc, c_desc, offsets, tile_cum, n_rows, E, M_DIM, K_DIM, NN, **common)


def _dw_schedule() -> str:
    mode = os.environ.get(ENV_DW_SCHED, "lpt")
    if mode not in ("lpt", "static"):
        raise ValueError(f"{ENV_DW_SCHED}={mode!r} must be 'lpt' or 'static'")
    return mode


def _lpt_order(offsets: torch.Tensor) -> torch.Tensor:
    """``[E]`` int32 on the device: experts by row count, largest first (ties by index)."""
    from tlx.common.scheduler import _lpt_order_kernel

    E = offsets.shape[0]
    order = torch.empty(E, dtype=torch.int32, device=offsets.device)
    _lpt_order_kernel[(-(-E // 64),)](offsets, order, E, BLOCK=64, num_warps=4)
    return order


def _mm_with(cfg: GroupedGemmConfig, cc: int, x_ND, w_EDF, offsets, y_NF):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .host import max_m_tiles, prep_offsets, ragged_descriptor

    N, K = x_ND.shape
    E, _, NN = w_EDF.shape
    b_kmajor = w_EDF.stride(2) != 1
    a_desc = TensorDescriptor(x_ND, [N, K], [x_ND.stride(0), 1], [_a_rows(cc, cfg), cfg.BK])
    if b_kmajor:
        b_desc = TensorDescriptor(w_EDF, [E, NN, K], [w_EDF.stride(0), w_EDF.stride(2), 1], [1, cfg.BN, cfg.BK])
    else:
        b_desc = TensorDescriptor(w_EDF, [E, K, NN], [w_EDF.stride(0), w_EDF.stride(1), 1], [1, cfg.BK, cfg.BN])
    c_desc = ragged_descriptor(y_NF, _a_rows(cc, cfg), _c_cols(cc, cfg))
    offsets, tile_cum = prep_offsets(offsets, N, cfg.BM)  # clamped on the device (guard.py)
    bound = max_m_tiles(N, E, cfg.BM) * -(-NN // cfg.BN)
    _launch(cc, cfg, False, b_kmajor, a_desc, b_desc, c_desc, offsets, tile_cum, N, E, N, K, NN, bound, x_ND.device)


def _mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    if x_ND.data_ptr() % 16 or w_EDF.data_ptr() % 16:
        # Only reachable when backend choice ran under torch.compile (no base-address check there).
        from .triton_backend import _mm as portable_mm

        return portable_mm(x_ND, w_EDF, offsets_E)
    N = x_ND.shape[0]
    E, K, NN = w_EDF.shape
    y_NF = torch.empty(N, NN, dtype=x_ND.dtype, device=x_ND.device)
    if N == 0:
        return y_NF
    cc = _arch_cc()
    form = "dX" if w_EDF.stride(2) != 1 else "fwd"
    cfg = pick_config(cc, form, N, E, K, NN, x_ND.dtype,
                      bench=lambda c: _mm_with(c, cc, x_ND, w_EDF, offsets_E, torch.empty_like(y_NF)))
    _mm_with(cfg, cc, x_ND, w_EDF, offsets_E, y_NF)
    return y_NF


def _wgrad_with(cfg: GroupedGemmConfig, cc: int, x_ND, dy_NF, offsets, dw_EDF, order=None):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .host import ragged_descriptor

    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets.shape[0]
    a_desc = ragged_descriptor(x_ND, cfg.BK, _a_rows(cc, cfg))
    b_desc = ragged_descriptor(dy_NF, cfg.BK, cfg.BN)
    c_desc = TensorDescriptor(dw_EDF, [E, D, F], [D * F, F, 1], [1, _a_rows(cc, cfg), _c_cols(cc, cfg)])
    bound = E * -(-D // cfg.BM) * -(-F // cfg.BN)
    if cc != 90 or _dw_schedule() != "lpt":
        order = None  # the static walk (Blackwell's kernel has no order argument)
    elif order is None:
        order = _lpt_order(offsets)
    _launch(cc, cfg, True, False, a_desc, b_desc, c_desc, offsets, offsets, N, E, D, N, F, bound, x_ND.device,
            order=order)


def _wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor, order: Optional[torch.Tensor] = None,
           trusted: bool = False) -> torch.Tensor:
    """``dW[e] = x[rows of e]^T @ dy[rows of e]``. The fused pipeline's callers (its dout copy) pass
    ``trusted=True`` for int32 offsets their own routing kernel made (valid: the clamp launch is
    skipped) and ``order``, the longest-first expert order the routing kernel already wrote (the
    order launch is skipped): two launches fewer per call, the same kernel and tiles."""
    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets_E.shape[0]
    if N == 0 or _tma_2d_reason("dy_NF", dy_NF) is not None or x_ND.data_ptr() % 16:
        # dy is not seen by supports() (nor x's base address under torch.compile); the portable
        # kernel takes any layout (and N == 0 -> zeros).
        from .triton_backend import _wgrad as portable_wgrad

        return portable_wgrad(x_ND, dy_NF, offsets_E)
    from .host import prep_offsets

    dw_EDF = torch.empty(E, D, F, dtype=x_ND.dtype, device=x_ND.device)
    cc = _arch_cc()
    if trusted and offsets_E.dtype == torch.int32 and offsets_E.is_contiguous():
        offsets = offsets_E
    else:
        offsets = prep_offsets(offsets_E, N)[0]  # clamped into [0, N] on the device (guard.py)
    cfg = pick_config(cc, "dW", N, E, D, F, x_ND.dtype,
                      bench=lambda c: _wgrad_with(c, cc, x_ND, dy_NF, offsets, torch.empty_like(dw_EDF), order))
    _wgrad_with(cfg, cc, x_ND, dy_NF, offsets, dw_EDF, order)
    return dw_EDF


def kernel_signature(cc: int, wgrad: bool, b_kmajor: bool, cfg: Optional[GroupedGemmConfig] = None,
                     E: int = 64, dtype: str = "bf16", dynamic: Optional[bool] = None):
    """(kernel, signature, constexprs, options) for ``triton.compile`` without a GPU (tests)."""
    from .host import search_steps

    cfg = cfg or CANDIDATES[cc][0]
    ar, cc_cols = _a_rows(cc, cfg), _c_cols(cc, cfg)
    if wgrad:
        a = f"tensordesc<{dtype}[1,1,{cfg.BK},{ar}]>"
        b = f"tensordesc<{dtype}[1,1,{cfg.BK},{cfg.BN}]>"
        c = f"tensordesc<{dtype}[1,{ar},{cc_cols}]>"
    else:
        a = f"tensordesc<{dtype}[{ar},{cfg.BK}]>"
        b = f"tensordesc<{dtype}[1,{cfg.BN},{cfg.BK}]>" if b_kmajor else f"tensordesc<{dtype}[1,{cfg.BK},{cfg.BN}]>"
        c = f"tensordesc<{dtype}[1,1,{ar},{cc_cols}]>"
    sig = {"a_desc": a, "b_desc": b, "c_desc": c, "offsets_ptr": "*i32", "tile_cum_ptr": "*i32"}
    constexprs = {"WGRAD": wgrad, "B_KMAJOR": b_kmajor}
    if cc == 90:  # the Hopper kernel's dW walks tiles longest-expert-first with atomic claims
        sig.update({"order_ptr": "*i32", "sched_ptr": "*i32"})
        constexprs["DYNAMIC"] = wgrad if dynamic is None else dynamic
        constexprs["GROUP_M"] = cfg.GROUP_M
    sig.update({"N_ROWS": "i32", "E": "i32", "M_DIM": "i32", "K_DIM": "i32", "NN": "i32"})
    constexprs.update({"BM": cfg.BM, "BN": cfg.BN, "BK": cfg.BK, "NUM_STAGES": cfg.STAGES, "NUM_SMS": 132,
                       "SEARCH_STEPS": search_steps(E), **constexprs})
    for k in constexprs:
        sig[k] = "constexpr"
    return _kernel(cc), sig, constexprs, {"num_warps": 4, "num_stages": 1}


if tlx.tlx_available():  # the architecture is checked per call (supports), so overrides reach it
    register_backend(Backend("tlx", _mm, _wgrad, _supports, priority=10, archs=tuple(_ARCH_CC)))
else:
    register_unavailable("tlx", "TLX (fbtriton) is not importable (pip install -e '.[tlx]')")
