"""Host side of the Hopper TLX fused expert kernels (``tlx/hopper/fused_moe.py``).

Registers ``FusedBackend("tlx", priority=10)`` when TLX is importable and the GPU is sm_90. Launch
path per primitive: one config lookup (a frozen dataclass per form, cached per scalar key), the TMA
descriptors of the operands read in place, one launch; the scheduler's ``tile_cum`` prep runs once
per pass and is shared by its three ragged-M launches, and the dW tile order once per backward.
Nothing reads device values on the host, so the whole pass is CUDA-graph capturable.

Operand rules (else ``supports()`` gives the reason and the automatic choice falls back to the
portable kernels): bf16/fp16, D and F multiples of 64 (the gathered K loop has no column tail),
contiguous x / w13 / w2, 16-byte aligned bases.

``TLX_DIST_FUSED_CONFIG="swiglu:BN=128,STAGES=4;wgrad:BK=32"`` overrides fields of a form's config
(read when a form first runs at a given width).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

import tlx

from .backends import FusedBackend, compose_backward, compose_forward, register_fused_backend

__all__ = ["FusedTileConfig", "FORMS", "fused_config", "kernel_signature", "ENV_FUSED_CONFIG"]

ENV_FUSED_CONFIG = "TLX_DIST_FUSED_CONFIG"
_SMEM_LIMIT = 227 * 1024
SWIGLU, SCATTER, DSWIGLU = 1, 2, 3


@dataclass(frozen=True)
class FusedTileConfig:
    """Tile config of one fused form. BM rows (two consumer groups of BM/2), BN columns (SwiGLU: BN
    gate + BN up columns), BK reduction step, STAGES ring depth, LAG stages between issuing a
    gathered stage and publishing it (<= STAGES - 2, see tlx/hopper/fused_moe.py), GROUP_M raster,
    REGS registers per consumer thread (the producer gets the rest)."""

    BM: int = 128
    BN: int = 128
    BK: int = 64
    STAGES: int = 4
    LAG: int = 2
    GROUP_M: int = 1
    REGS: int = 232

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
        if self.REGS % 8 or not 152 <= self.REGS <= 240:
            raise ValueError(f"FusedTileConfig.REGS={self.REGS} must be a multiple of 8 in [152, 240]")

    def smem_bytes(self, form: str) -> int:
        n_b = 2 if form == "swiglu" else 1
        ring = self.STAGES * (self.BM * self.BK + n_b * self.BK * self.BN) * 2
        return ring + (self.BM * self.BN * 2 if form == "wgrad" else 0)


FORMS = {
    # gathered A + two B tiles per stage; 192 KB ring; fewer consumer registers leave the producer
    # room for its row pointers.
    "swiglu": FusedTileConfig(BN=128, BK=64, STAGES=4, LAG=2, REGS=216),
    # A by TMA; 128 KB ring + 64 KB of layout-conversion scratch for the v4 fp32 atomics.
    "scatter": FusedTileConfig(BN=128, BK=64, STAGES=4, LAG=0, REGS=232),
    # gathered dout + K-major w2; the epilogue holds g, hg, hu: 128 columns. A stage is half the MMA
    # time of SwiGLU's, so 5 stages of gathers in flight (LAG 4) cover the load latency; 192 KB ring.
    "dswiglu": FusedTileConfig(BN=128, BK=64, STAGES=6, LAG=4, REGS=216),
    # one gathered operand; 144 KB ring + 64 KB TMA-store tile.
    "wgrad": FusedTileConfig(BN=256, BK=32, STAGES=6, LAG=4, REGS=224),
}


@functools.lru_cache(maxsize=None)
def _env_overrides(text: str) -> dict:
    out = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        form, _, fields = part.partition(":")
        form = form.strip().lower()
        if form not in FORMS:
            raise ValueError(f"{ENV_FUSED_CONFIG}: unknown form {form!r} in {text!r} (forms: {sorted(FORMS)})")
        names = {f.name for f in dataclasses.fields(FusedTileConfig)}
        kw = {}
        for item in fields.split(","):
            if not item.strip():
                continue
            k, _, v = item.partition("=")
            k = k.strip().upper()
            if k not in names:
                raise ValueError(f"{ENV_FUSED_CONFIG}: unknown field {k!r} in {text!r} (fields: {sorted(names)})")
            kw[k] = int(v)
        cfg = dataclasses.replace(FORMS[form], **kw)
        if cfg.smem_bytes(form) > _SMEM_LIMIT:
            raise ValueError(f"{ENV_FUSED_CONFIG}: {form} config {cfg} needs {cfg.smem_bytes(form)} bytes of "
                             "shared memory")
        out[form] = cfg
    return out


_CACHE: dict[tuple, FusedTileConfig] = {}


def fused_config(form: str, nn: int) -> FusedTileConfig:
    """Config of ``form`` for an output ``nn`` columns wide: the env override, else the default
    (GROUP_M = 8 once the output has >= 16 column tiles, as the landed kernel does for Mixtral).
    Resolved once per (form, nn) and cached: the launch path does one dict lookup (reading the
    environment costs more than that)."""
    key = (form, nn)
    cfg = _CACHE.get(key)
    if cfg is None:
        over = _env_overrides(os.environ.get(ENV_FUSED_CONFIG, ""))
        cfg = over.get(form, FORMS[form])
        if form not in over and form != "wgrad" and -(-nn // cfg.BN) >= 16:
            cfg = dataclasses.replace(cfg, GROUP_M=8)
        _CACHE[key] = cfg
    return cfg


# --- checks -----------------------------------------------------------------------------------------


def _supports(x_RD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor) -> Optional[str]:
    if not tlx.tlx_available():
        return "TLX (fbtriton) is not importable"
    if tlx.gpu_arch() != "sm_90":
        return f"gpu_arch()={tlx.gpu_arch()} (the fused TLX kernels target sm_90)"
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


class _Hopper:
    """Launchers of tlx/hopper/fused_moe.py."""

    @staticmethod
    def tile_cum(offsets_E, n_rows, x=None):
        from ..grouped_gemm.host import prep_tile_cum

        return prep_tile_cum(offsets_E, n_rows, 128) if n_rows else None

    @staticmethod
    def wgrad_order(offsets_E):
        from ..grouped_gemm.tlx_backend import _lpt_order

        return _lpt_order(offsets_E)  # experts by row count, longest first (tlx/common/scheduler.py)

    @staticmethod
    def _mm(form, epilogue, a, src, w_desc_args, offsets, tile_cum, n_rows, K, nn, f_off, b_kmajor,
            c, c2=None, dst=None, scale=None, h=None, part=None):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from tlx.hopper.fused_moe import _fused_mm_hopper_kernel

        from ..grouped_gemm.host import max_m_tiles, search_steps

        cfg = fused_config(form, nn)
        w, shape, strides = w_desc_args
        E = shape[0]
        block = [1, cfg.BN, cfg.BK] if b_kmajor else [1, cfg.BK, cfg.BN]
        b_desc = TensorDescriptor(w, shape, strides, block)
        a_desc = None
        if src is None:  # A read in place: TMA
            a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.BM // 2, cfg.BK])
        grid = _grid(a.device, max_m_tiles(n_rows, E, cfg.BM) * -(-nn // cfg.BN))
        _fused_mm_hopper_kernel[(grid,)](
            a_desc, a if src is not None else None, src, b_desc, offsets, tile_cum,
            c, c2, dst, scale, h, part, n_rows, E, K, nn, f_off, a.stride(0), c.stride(0),
            c2.stride(0) if c2 is not None else 0, h.stride(0) if h is not None else 0,
            part.stride(0) if part is not None else 0,
            EPILOGUE=epilogue, A_GATHER=src is not None, HAS_SCALE=scale is not None, B_KMAJOR=b_kmajor,
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NUM_STAGES=cfg.STAGES, NUM_SMS=grid, SEARCH_STEPS=search_steps(E),
            GROUP_M=cfg.GROUP_M, LAG=cfg.LAG, CONSUMER_REGS=cfg.REGS, num_warps=4, num_stages=1)

    @staticmethod
    def gate_up_swiglu(x_RD, src_N, w13_EDF2, offsets_E, tile_cum):
        N, (E, D, F2) = src_N.shape[0], w13_EDF2.shape
        h = x_RD.new_empty(N, F2)
        a = x_RD.new_empty(N, F2 // 2)
        if N:
            w = (w13_EDF2, [E, D, F2], [w13_EDF2.stride(0), w13_EDF2.stride(1), 1])
            _Hopper._mm("swiglu", SWIGLU, x_RD, src_N, w, offsets_E, tile_cum, N, D, F2 // 2, F2 // 2, False, h, c2=a)
        return h, a

    @staticmethod
    def down_scatter(a_NF, w_EFD, offsets_E, dst_N, scale_N, num_dst, tile_cum):
        E, K, NN = w_EFD.shape
        out = torch.zeros(num_dst, NN, dtype=torch.float32, device=a_NF.device)
        N = a_NF.shape[0]
        if N:
            b_kmajor = w_EFD.stride(2) != 1  # dX of GEMM 1: w13^T, read K-major
            if b_kmajor:
                w = (w_EFD, [E, NN, K], [w_EFD.stride(0), w_EFD.stride(2), 1])
            else:
                w = (w_EFD, [E, K, NN], [w_EFD.stride(0), w_EFD.stride(1), 1])
            _Hopper._mm("scatter", SCATTER, a_NF, None, w, offsets_E, tile_cum, N, K, NN, 0, b_kmajor, out,
                        dst=dst_N, scale=scale_N)
        return out

    @staticmethod
    def down_dswiglu(dout_TD, dst_N, w2_EFD, offsets_E, h_N2F, gate_N, tile_cum):
        N, (E, F, D) = h_N2F.shape[0], w2_EFD.shape
        dh = h_N2F.new_empty(N, 2 * F)
        ag = h_N2F.new_empty(N, F)
        cfg = fused_config("dswiglu", F)
        part = torch.empty(N, -(-F // cfg.BN), dtype=torch.float32, device=h_N2F.device)
        if N:
            w = (w2_EFD, [E, F, D], [w2_EFD.stride(0), w2_EFD.stride(1), 1])  # w2^T read K-major
            _Hopper._mm("dswiglu", DSWIGLU, dout_TD.contiguous(), dst_N, w, offsets_E, tile_cum, N, D, F, F, True,
                        dh, c2=ag, scale=gate_N, h=h_N2F, part=part)
        return dh, ag, part.sum(1)

    @staticmethod
    def wgrad_gather(a, ia_N, b, ib_N, offsets_E, order=None):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from tlx.hopper.fused_moe import _fused_wgrad_hopper_kernel

        from ..grouped_gemm.host import ragged_descriptor

        E, D, F = offsets_E.shape[0], a.shape[1], b.shape[1]
        N = (ia_N if ia_N is not None else a).shape[0]
        dw = a.new_empty(E, D, F)
        if N == 0:
            return dw.zero_()
        b = b.contiguous()
        cfg = fused_config("wgrad", F)
        a_desc = None if ia_N is not None else ragged_descriptor(a, cfg.BK, cfg.BM // 2)
        b_desc = None if ib_N is not None else ragged_descriptor(b, cfg.BK, cfg.BN)
        c_desc = TensorDescriptor(dw, [E, D, F], [D * F, F, 1], [1, cfg.BM // 2, cfg.BN])
        grid = _grid(a.device, E * -(-D // cfg.BM) * -(-F // cfg.BN))
        order = _Hopper.wgrad_order(offsets_E) if order is None else order
        sched = torch.zeros(1, dtype=torch.int32, device=a.device)
        _fused_wgrad_hopper_kernel[(grid,)](
            a_desc, a if ia_N is not None else None, ia_N, b_desc, b if ib_N is not None else None, ib_N, c_desc,
            offsets_E, order, sched, N, E, D, F, a.stride(0), b.stride(0),
            A_GATHER=ia_N is not None, B_GATHER=ib_N is not None, DYNAMIC=True, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
            NUM_STAGES=cfg.STAGES, NUM_SMS=grid, GROUP_M=cfg.GROUP_M, LAG=cfg.LAG, CONSUMER_REGS=cfg.REGS,
            num_warps=4, num_stages=1)
        return dw


# --- compile-only signatures (tests, no GPU) ---------------------------------------------------------


def kernel_signature(form: str, E: int = 64, dtype: str = "bf16", cfg: Optional[FusedTileConfig] = None):
    """(kernel, signature, constexprs, attrs, options) for ``triton.compile`` of one form without a
    GPU. ``form``: ``swiglu``, ``scatter`` (fwd, w2 N-major), ``scatter_t`` (dX of GEMM 1, w13^T
    K-major), ``dswiglu``, ``wgrad_a`` (dW13: A gathered), ``wgrad_b`` (dW2: B gathered). Integer and
    pointer arguments carry the 16-divisibility the launcher specialises on (D, F multiples of 64)."""
    from ..grouped_gemm.host import search_steps

    base = "scatter" if form == "scatter_t" else "wgrad" if form.startswith("wgrad") else form
    cfg = cfg or FORMS[base]
    bms = cfg.BM // 2
    none = "constexpr"
    if base != "wgrad":
        from tlx.hopper.fused_moe import _fused_mm_hopper_kernel as fn

        gather = form in ("swiglu", "dswiglu")
        kmajor = form in ("scatter_t", "dswiglu")
        b_block = f"[1,{cfg.BN},{cfg.BK}]" if kmajor else f"[1,{cfg.BK},{cfg.BN}]"
        sig = {"a_desc": none if gather else f"tensordesc<{dtype}[{bms},{cfg.BK}]>",
               "a_ptr": f"*{dtype}" if gather else none, "src_ptr": "*i32" if gather else none,
               "b_desc": f"tensordesc<{dtype}{b_block}>", "offsets_ptr": "*i32", "tile_cum_ptr": "*i32",
               "c_ptr": "*fp32" if base == "scatter" else f"*{dtype}",
               "c2_ptr": none if base == "scatter" else f"*{dtype}",
               "dst_ptr": "*i32" if base == "scatter" else none,
               "scale_ptr": "*fp32" if form in ("scatter", "dswiglu") else none,
               "h_ptr": f"*{dtype}" if base == "dswiglu" else none,
               "part_ptr": "*fp32" if base == "dswiglu" else none}
        ints = ["N_ROWS", "E", "K_DIM", "NN", "F_OFF", "stride_an", "stride_cn", "stride_c2n", "stride_hn", "stride_pn"]
        epi = {"swiglu": SWIGLU, "scatter": SCATTER, "dswiglu": DSWIGLU}[base]
        constexprs = {"EPILOGUE": epi, "A_GATHER": gather, "HAS_SCALE": form in ("scatter", "dswiglu"),
                      "B_KMAJOR": kmajor, "SEARCH_STEPS": search_steps(E)}
    else:
        from tlx.hopper.fused_moe import _fused_wgrad_hopper_kernel as fn

        ga, gb = form == "wgrad_a", form == "wgrad_b"
        sig = {"a_desc": none if ga else f"tensordesc<{dtype}[1,1,{cfg.BK},{bms}]>",
               "a_ptr": f"*{dtype}" if ga else none, "ia_ptr": "*i32" if ga else none,
               "b_desc": none if gb else f"tensordesc<{dtype}[1,1,{cfg.BK},{cfg.BN}]>",
               "b_ptr": f"*{dtype}" if gb else none, "ib_ptr": "*i32" if gb else none,
               "c_desc": f"tensordesc<{dtype}[1,{bms},{cfg.BN}]>", "offsets_ptr": "*i32", "order_ptr": "*i32",
               "sched_ptr": "*i32"}
        ints = ["N_ROWS", "E", "M_DIM", "NN", "stride_an", "stride_bn"]
        constexprs = {"A_GATHER": ga, "B_GATHER": gb, "DYNAMIC": True}
    for k, v in list(sig.items()):
        if v == none:
            constexprs[k] = None
    sig.update({k: "i32" for k in ints})
    constexprs.update({"BM": cfg.BM, "BN": cfg.BN, "BK": cfg.BK, "NUM_STAGES": cfg.STAGES, "NUM_SMS": 132,
                       "GROUP_M": cfg.GROUP_M, "LAG": cfg.LAG, "CONSUMER_REGS": cfg.REGS})
    for k in constexprs:
        sig[k] = "constexpr"
    names = fn.arg_names
    sig = {k: sig[k] for k in names}
    # D and F are multiples of 64, so are these (N_ROWS, E and the partials' stride are not).
    div16 = {"K_DIM", "NN", "F_OFF", "M_DIM", "stride_an", "stride_bn", "stride_cn", "stride_c2n", "stride_hn"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*") or k in div16}
    return fn, sig, constexprs, attrs, {"num_warps": 4, "num_stages": 1}


if tlx.tlx_available() and tlx.gpu_arch() == "sm_90":
    register_fused_backend(FusedBackend(
        "tlx", lambda *a: compose_forward(_Hopper, *a), lambda *a: compose_backward(_Hopper, *a), _supports,
        priority=10))
