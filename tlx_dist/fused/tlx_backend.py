"""Host side of the TLX fused expert kernels: Hopper (``tlx/hopper/fused_moe.py``, class ``_Hopper``)
and Blackwell (``tlx/blackwell/fused_moe.py``, class ``_Blackwell``; compile-checked, not yet run on a
B200). Both take the same launch arguments; what differs per generation (how many A rows one TMA box
holds, the kernels' partition constexprs) sits in the two small subclasses of ``_TlxFused``.

Registers ``FusedBackend("tlx", priority=10)`` when TLX is importable and the GPU is sm_90 or sm_100;
each call runs the primitives of ``tlx.gpu_arch()`` (``_tlx_prims``), bound to the call's
:class:`~tlx_dist.fused.config.FusedConfig`. Launch path per primitive: one tile-config lookup
(``FusedConfig.tile``: the pinned one, or the cached default of its scalar key), the TMA descriptors
of the operands read in place, one launch; the scheduler's ``tile_cum`` prep runs once per pass and
is shared by its three ragged-M launches, and the dW tile order once per backward. Nothing reads
device values on the host, so the whole pass is CUDA-graph capturable.

Operand rules (else ``supports()`` gives the reason and the automatic choice falls back to the
portable kernels): bf16/fp16, D and F multiples of 64 (the gathered K loop has no column tail),
contiguous x / w13 / w2, 16-byte aligned bases.
"""

from __future__ import annotations

from typing import Optional

import torch

import tlx

from ..grouped_gemm.host import num_sms
from .backends import SCHED_BM, FusedBackend, Primitives, compose_backward, compose_forward, phase_tile_cums, register_fused_backend
from .config import BLACKWELL_FORMS, FORMS, FusedConfig

__all__ = ["kernel_signature"]

SWIGLU, SCATTER, DSWIGLU = 1, 2, 3
_ARCH_FORMS = {"sm_90": FORMS, "sm_100": BLACKWELL_FORMS}


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


def _grid(device: torch.device, bound: int) -> int:
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(sms, bound))


class _TlxFused(Primitives):
    """Launchers of the TLX fused kernels; a subclass per generation says which kernels and partition
    constexprs; an instance is bound to one FusedConfig (the primitives of ``backends.py`` are its
    methods)."""

    ARCH = ""
    A_SPLIT = 1  # A rows per TMA box = BM / A_SPLIT (Hopper: two consumer warp groups)

    @staticmethod
    def tile_cum(offsets_E, n_rows, x=None):
        from ..grouped_gemm.host import prep_tile_cum

        return prep_tile_cum(offsets_E, n_rows, SCHED_BM) if n_rows else None

    @staticmethod
    def wgrad_order(offsets_E):
        from ..grouped_gemm.host import lpt_order

        return lpt_order(offsets_E)  # experts by row count, longest first (tlx/common/scheduler.py)

    def _mm(self, form, epilogue, a, src, w_desc_args, offsets, tile_cum, n_rows, K, nn, f_off, b_kmajor,
            c, c2=None, dst=None, scale=None, h=None, part=None, virt=1, grid_cap=None):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from ..grouped_gemm.host import max_m_tiles, search_steps

        cfg = self.config.tile(form, nn, self.ARCH, K)
        w, shape, strides = w_desc_args
        E = shape[0] * virt  # virt > 1: the tile walk's virtual experts (runs of each expert's rows)
        block = [1, cfg.BN, cfg.BK] if b_kmajor else [1, cfg.BK, cfg.BN]
        b_desc = TensorDescriptor(w, shape, strides, block)
        a_desc = None
        if src is None:  # A read in place: TMA
            a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.BM // self.A_SPLIT, cfg.BK])
        grid = _grid(a.device, max_m_tiles(n_rows, E, cfg.BM) * -(-nn // cfg.BN))
        if grid_cap is not None:
            grid = max(1, min(grid, grid_cap))
        if virt > 1 and not self.PHASED:
            raise ValueError(f"the {self.ARCH} fused kernels take no virtual experts (virt={virt})")
        virt_meta = {"VIRT": virt} if self.PHASED else {}
        self._mm_kernel()[(grid,)](
            a_desc, a if src is not None else None, src, b_desc, offsets, tile_cum,
            c, c2, dst, scale, h, part, n_rows, E, K, nn, f_off, a.stride(0), c.stride(0),
            c2.stride(0) if c2 is not None else 0, h.stride(0) if h is not None else 0,
            part.stride(0) if part is not None else 0,
            EPILOGUE=epilogue, A_GATHER=src is not None, HAS_SCALE=scale is not None, B_KMAJOR=b_kmajor,
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NUM_STAGES=cfg.STAGES, NUM_SMS=grid, SEARCH_STEPS=search_steps(E),
            GROUP_M=cfg.GROUP_M, **self._meta(cfg), **self._h_args(epilogue, cfg), **self._pp_args(epilogue, src, cfg),
            **virt_meta, num_warps=4, num_stages=1)

    @staticmethod
    def _pp_args(epilogue, src, cfg) -> dict:
        return {}  # kernels without the ping-pong consumers

    @staticmethod
    def phase_tile_cums(offsets_V, n_rows, x):
        return phase_tile_cums(offsets_V, n_rows, SCHED_BM)

    @staticmethod
    def free_sms(device, side_sms):
        """The persistent grid of a launch that runs beside a ``side_sms``-program kernel."""
        return max(1, num_sms(device.index if device.index is not None else torch.cuda.current_device()) - side_sms)

    def gate_up_swiglu(self, x_RD, src_N, w13_EDF2, offsets_E, tile_cum, virt=1, grid_cap=None, out=None):
        N, (E, D, F2) = (src_N if src_N is not None else x_RD).shape[0], w13_EDF2.shape
        h, a = out if out is not None else (x_RD.new_empty(N, F2), x_RD.new_empty(N, F2 // 2))
        if N:
            w = (w13_EDF2, [E, D, F2], [w13_EDF2.stride(0), w13_EDF2.stride(1), 1])
            self._mm("swiglu", SWIGLU, x_RD, src_N, w, offsets_E, tile_cum, N, D, F2 // 2, F2 // 2, False, h, c2=a,
                    virt=virt, grid_cap=grid_cap)
        return h, a

    def down_scatter(self, a_NF, w_EFD, offsets_E, dst_N, scale_N, num_dst, tile_cum, virt=1, grid_cap=None,
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
            self._mm("scatter", SCATTER, a_NF, None, w, offsets_E, tile_cum, N, K, NN, 0, b_kmajor, out,
                    dst=dst_N, scale=scale_N, virt=virt, grid_cap=grid_cap)
        return out

    def down_dswiglu(self, dout_TD, dst_N, w2_EFD, offsets_E, h_N2F, gate_N, tile_cum):
        N, (E, F, D) = h_N2F.shape[0], w2_EFD.shape
        dh = h_N2F.new_empty(N, 2 * F)
        ag = h_N2F.new_empty(N, F)
        form = "dswiglu" if dst_N is not None else "dswiglu_copy"  # gathered rows, or the copy read by TMA
        cfg = self.config.tile(form, F, self.ARCH, D)
        part = torch.empty(N, -(-F // cfg.BN), dtype=torch.float32, device=h_N2F.device)
        if N:
            w = (w2_EFD, [E, F, D], [w2_EFD.stride(0), w2_EFD.stride(1), 1])  # w2^T read K-major
            self._mm(form, DSWIGLU, dout_TD.contiguous(), dst_N, w, offsets_E, tile_cum, N, D, F, F, True,
                    dh, c2=ag, scale=gate_N, h=h_N2F, part=part)
        return dh, ag, part.sum(1)

    def wgrad_gather(self, a, ia_N, b, ib_N, offsets_E, order=None):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from ..grouped_gemm.host import ragged_descriptor

        E, D, F = offsets_E.shape[0], a.shape[1], b.shape[1]
        N = (ia_N if ia_N is not None else a).shape[0]
        if ia_N is None and ib_N is None and N:
            # both operands expert-major already (the row copies): the grouped GEMM's dW kernel, with its
            # own longest-expert-first order and tile config (``FusedConfig.wgrad_copy``)
            from ..grouped_gemm.backends import get_backend

            return get_backend("tlx").wgrad(a, b.contiguous(), offsets_E, config=self.config.wgrad_copy, order=order,
                                            trusted=True)
        dw = a.new_empty(E, D, F)
        if N == 0:
            return dw.zero_()
        b = b.contiguous()
        cfg = self.config.tile("wgrad_a" if ia_N is not None else "wgrad_b", F, self.ARCH)
        a_rows = cfg.BM // self.A_SPLIT
        a_desc = None if ia_N is not None else ragged_descriptor(a, cfg.BK, a_rows)
        b_desc = None if ib_N is not None else ragged_descriptor(b, cfg.BK, cfg.BN)
        c_desc = TensorDescriptor(dw, [E, D, F], [D * F, F, 1], [1, a_rows, self._c_cols(cfg)])
        grid = _grid(a.device, E * -(-D // cfg.BM) * -(-F // cfg.BN))
        order = self.wgrad_order(offsets_E) if order is None else order
        self._wgrad_kernel()[(grid,)](
            a_desc, a if ia_N is not None else None, ia_N, b_desc, b if ib_N is not None else None, ib_N, c_desc,
            offsets_E, order, *self._wgrad_sched(a.device), N, E, D, F, a.stride(0), b.stride(0),
            A_GATHER=ia_N is not None, B_GATHER=ib_N is not None, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
            NUM_STAGES=cfg.STAGES, NUM_SMS=grid, GROUP_M=cfg.GROUP_M, **self._wgrad_meta(cfg),
            num_warps=4, num_stages=1)
        return dw


class _Hopper(_TlxFused):
    """tlx/hopper/fused_moe.py: producer warp group + two consumer warp groups of BM/2 rows."""

    ARCH = "sm_90"
    A_SPLIT = 2
    PHASED = True
    AUTO_ROW_COPY = True  # where the row-copy rules were measured (config.DOUT_COPY_MIN_F, X_COPY_MIN_F)

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
    def _h_args(epilogue, cfg) -> dict:
        """EARLY_H: dSwiGLU's consumers prefetch their h lines into L2 before each tile's main loop."""
        return dict(EARLY_H=epilogue == DSWIGLU and bool(cfg.EARLY_H))

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
    def _h_args(epilogue, cfg) -> dict:
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
    x copies, ``FusedConfig.dout_rows`` / ``x_rows`` "copy"), ``wgrad_a`` (dW13: A gathered), ``wgrad_b`` (dW2: B gathered). Integer
    and pointer arguments carry the 16-divisibility the launcher specialises on (D, F multiples of 64);
    every constexpr is given explicitly (``ASTSource`` applies no defaults)."""
    from ..grouped_gemm.host import search_steps

    p = _PRIMS[arch]
    base = {"scatter_t": "scatter", "dswiglu_copy": "dswiglu", "swiglu_copy": "swiglu"}.get(form, form)
    cfg = cfg or _ARCH_FORMS[arch].get(form, _ARCH_FORMS[arch][base])
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


def _tlx_forward(*a, sched=None, overlap=None, config: Optional[FusedConfig] = None):
    return compose_forward(_tlx_prims()(config), *a, sched=sched, overlap=overlap)


def _tlx_backward(*a, sched=None, config: Optional[FusedConfig] = None):
    return compose_backward(_tlx_prims()(config), *a, sched=sched)


if tlx.tlx_available() and tlx.gpu_arch() in _PRIMS:
    register_fused_backend(FusedBackend("tlx", _tlx_forward, _tlx_backward, _supports, priority=10))
