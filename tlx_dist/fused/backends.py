"""Backends of the fused expert pipeline and the one composition they share.

A kernel backend provides four primitives, methods of a primitives object bound to one
:class:`~tlx_dist.fused.config.FusedConfig` (``Primitives(config)``; legend and index arrays:
``reference.py``):

* ``gate_up_swiglu(x_RD, src_N, w13_EDF2, offsets_E, tile_cum) -> (h_N2F, a_NF)``
  gather-on-load GEMM 1 with the SwiGLU epilogue;
* ``down_scatter(a_NF, w_EFD, offsets_E, dst_N, scale_N | None, num_dst, tile_cum) -> out_f32``
  GEMM 2 whose epilogue adds ``scale[n] * row`` into ``out[dst[n]]`` (also dX of GEMM 1 with
  ``w = w13^T``, ``scale = None``, ``dst = src``);
* ``down_dswiglu(dout_TD, dst_N, w2_EFD, offsets_E, h_N2F, gate_N, tile_cum) -> (dh_N2F, ag_NF, dgate_N)``
  dX of GEMM 2 reading ``dout`` rows by index, with the dSwiGLU and gate-gradient epilogue;
* ``wgrad_gather(a, ia_N | None, b, ib_N | None, offsets_E, order) -> dw``  varlen-K dW with either
  operand read by index;

plus ``tile_cum(offsets_E, n_rows, x)`` (the scheduler's prep, for the tile height ``x``'s dtype
gets; shared by the ragged-M launches of a pass), ``wgrad_order(offsets_E)`` (the dW tile order,
shared by both dW launches) and ``supports(x_RD, w13_EDF2, w2_EFD) -> reason | None``.
:func:`compose_forward` and :func:`compose_backward` chain them, reading the config's row modes
from the primitives they are given (``p.config``); the ``reference`` backend computes
the same two passes in PyTorch (``reference.py``). Backends: ``tlx`` (Hopper / Blackwell TLX kernels,
``tlx_backend.py``), ``triton`` (the portable stock-Triton kernels, ``tlx/portable/fused_moe.py``:
any CUDA/ROCm GPU, and CPU under ``TRITON_INTERPRET=1`` when pinned), ``reference``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tlx import triton_available

from ..grouped_gemm.host import sched_order_offset
from .arrival import ArrivalPlan
from .config import DEFAULT, FusedConfig
from .reference import fused_backward_ref, fused_forward_ref

__all__ = ["FusedBackend", "Primitives", "register_fused_backend", "registered_fused_backends", "compose_forward",
           "compose_backward", "SCHED_BM", "sched_order_offset"]


class Primitives:
    """Base of a kernel backend's primitives: the launch config they run with (row modes for the
    compositions, tile configs for the launchers). ``AUTO_ROW_COPY``: whether ``"auto"`` row modes
    may copy rows for these kernels (where that rule was measured); ``PHASED``: the kernels take
    VIRT (:func:`compose_forward`'s overlapped form)."""

    AUTO_ROW_COPY = False
    PHASED = False

    def __init__(self, config: Optional[FusedConfig] = None):
        self.config = DEFAULT if config is None else config


def _rows_by_mode(rows_TD: torch.Tensor, idx_N: torch.Tensor, copy: bool):
    """``(rows_TD, idx_N)`` (read by index) or ``(rows_TD[idx_N], None)`` (the expert-major copy).
    Padding rows past the last expert carry indices that are never read; they are clamped into range
    for the copy (a device op, no host sync)."""
    if not copy:
        return rows_TD, idx_N
    if rows_TD.shape[0] == 0 or idx_N.shape[0] == 0:
        return rows_TD.new_zeros(idx_N.shape[0], rows_TD.shape[1]), None
    return rows_TD.index_select(0, idx_N.clamp(0, rows_TD.shape[0] - 1)), None


def _dout_rows(dout_TD: torch.Tensor, dst_N: torch.Tensor, F: int, p: Primitives):
    """``(rows, index)`` the backward's dout operands read: ``(dout_TD, dst_N)`` (by index) or, when
    ``p.config.dout_rows`` copies for these primitives at this F, ``(dout_TD[dst_N], None)``."""
    return _rows_by_mode(dout_TD, dst_N, p.config.copies_dout(F, getattr(p, "AUTO_ROW_COPY", False)))


def _x_rows(x_RD: torch.Tensor, src_N: torch.Tensor, F: int, p: Primitives):
    """``(rows, index)`` the gate/up GEMM and dW13 read: ``(x_RD, src_N)`` (by index) or, when
    ``p.config.x_rows`` copies, ``(x_RD[src_N], None)``."""
    return _rows_by_mode(x_RD, src_N, p.config.copies_x(F, getattr(p, "AUTO_ROW_COPY", False)))


# Rows per scheduler tile of the TLX primitives (both generations' ragged-M kernels, BM = 128): the
# height the routing kernel's precomputed tile_cum must use for them (``compose_forward(sched=)``).
SCHED_BM = 128


@dataclass(frozen=True)
class FusedBackend:
    """One backend. The kernel backends' ``forward`` / ``backward`` also take ``sched=`` (the
    routing's scheduler tables), ``config=`` (a :class:`FusedConfig`) and, forward, ``overlap=``."""

    name: str
    forward: Callable    # (x_RD, src_N, dst_N, gate_N, w13, w2, offsets_E, num_dst) -> (out, h_N2F)
    backward: Callable   # (dout, x_RD, src_N, dst_N, gate_N, w13, w2, offsets_E, h_N2F) -> (dx, dgate, dw13, dw2)
    supports: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Optional[str]]
    priority: int        # lower is preferred
    auto_on_cpu: bool = False


_BACKENDS: dict[str, FusedBackend] = {}


def register_fused_backend(b: FusedBackend) -> None:
    _BACKENDS[b.name] = b


def registered_fused_backends() -> dict[str, FusedBackend]:
    """The backends registered so far, by name (``selection.py`` imports the kernel modules first)."""
    return dict(_BACKENDS)


# --- the composition shared by the kernel backends ---------------------------------------------------


def _sched_parts(sched, offsets_E):
    """``(tile_cum [E + 1], order [E])`` views of a precomputed schedule (``tlx.common.routing``)."""
    E = offsets_E.shape[0]
    o = sched_order_offset(E)
    return sched[:E + 1], sched[o:o + E]


def compose_forward(p, x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, sched=None,
                    overlap: Optional[ArrivalPlan] = None):
    """``(out [num_dst, D] in x's dtype, h_N2F)`` from a primitives module ``p``. ``sched``: the
    scheduler tables already computed with the routing (int32: tile_cum ``[E + 1]`` for ``p``'s tile
    height, then from :func:`sched_order_offset` the dW expert order ``[E]``; the TLX primitives
    only), else the prep kernel runs. ``overlap`` (the EP overlap's receive plan,
    an :class:`~tlx_dist.fused.arrival.ArrivalPlan`): rows of ``x_RD`` are still arriving; ``PHASED``
    primitives (the TLX and portable kernels, which take VIRT) run :func:`_forward_overlapped`, the
    others wait for every row first (``overlap.wait()``)."""
    if overlap is not None and getattr(p, "PHASED", False):
        return _forward_overlapped(p, x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, overlap)
    tile_cum = p.tile_cum(offsets_E, src_N.shape[0], x_RD) if sched is None else _sched_parts(sched, offsets_E)[0]
    if overlap is not None:
        overlap.wait()
    x_rows, x_idx = _x_rows(x_RD, src_N, w2_EFD.shape[1], p)  # or x_RD[src_N]
    h_N2F, a_NF = p.gate_up_swiglu(x_rows, x_idx, w13_EDF2, offsets_E, tile_cum)
    del x_rows
    out = p.down_scatter(a_NF, w2_EFD, offsets_E, dst_N, gate_N, num_dst, tile_cum)
    return out.to(x_RD.dtype), h_N2F


def phase_tile_cums(offsets_V, n_rows: int, block_m: int):
    """The two tile walks of ``_forward_overlapped``'s launches over ``3 * E`` virtual experts
    (``tile_cum`` of phase 0 and of phase 1, tiles of ``block_m`` rows)."""
    from ..grouped_gemm.host import prep_offsets

    return prep_offsets(offsets_V, n_rows, block_m, phase=0)[1], prep_offsets(offsets_V, n_rows, block_m, phase=1)[1]


def _forward_overlapped(p, x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, ov: ArrivalPlan):
    """The EP overlap's forward (``ov``: an :class:`~tlx_dist.fused.arrival.ArrivalPlan`): each local
    expert's rows as three runs -- sources before the present ones | the present sources' rows
    (``ov.present_rows``: this rank's own, or its node's under the hierarchical exchange) | sources
    after (``ov.offsets_V``, virtual experts with VIRT=3) -- so that
      gate/up GEMM, present runs (the other rows are still landing; on the SMs the side stream leaves free)
      down GEMM, present runs  (the same; it reads only the present rows' SwiGLU output)
      cast the present partial rows (final: no other source's row adds into them)
      ov.wait()                (every other source's rows landed)
      gate/up GEMM, the rest + padding
      down GEMM, other runs    -> those partial rows are final: ``ov.send_partials`` rounds them
                                 from the accumulator and starts them home (the combine's first
                                 kernel, on the side stream)
    The present-run GEMMs and their rows' cast go before the wait: all the work that needs no other
    source's row hides under the arrival (the hierarchical exchange's inter-node leg is the slow
    one), and the other sources' partial rows still leave as soon as their down GEMM is done.
    Same tiles' arithmetic as the one-launch forms (h and a bit for bit; the partial rows' fp32
    atomic sums in another order). The expert-major rows of source s's tokens only ever add into
    receive rows of source s, so after the peers' runs those receive rows are complete."""
    N, (E, D, F2) = src_N.shape[0], w13_EDF2.shape
    offs_V = ov.offsets_V
    ov.check_rows(src_N, dst_N, offsets_E, num_dst, E)  # before anything is launched
    # Under activation checkpointing's recompute (inside a backward) the forward may stop right after
    # these GEMMs (non-reentrant early stop: the combine that follows saves nothing), so it must not
    # start the combine's op: join the rows' side stream and leave the combine whole.
    recompute = torch._C._current_graph_task_id() != -1
    acc = torch.promote_types(x_RD.dtype, torch.float32)
    out = torch.zeros(num_dst, w2_EFD.shape[2], dtype=acc, device=x_RD.device)
    part = torch.empty(num_dst, w2_EFD.shape[2], dtype=x_RD.dtype, device=x_RD.device)
    lo, hi = ov.present_rows
    if not N:
        ov.wait()
        h = x_RD.new_empty(0, F2)
        part.copy_(out)
        if recompute:
            ov.finish()
        else:
            ov.send_partials(part)
        return part, h
    tc0, tc1 = p.phase_tile_cums(offs_V, N, x_RD)
    cap = p.free_sms(x_RD.device, ov.side_sms)
    h, a = p.gate_up_swiglu(x_RD, src_N, w13_EDF2, offs_V, tc0, virt=3, grid_cap=cap)
    p.down_scatter(a, w2_EFD, offs_V, dst_N, gate_N, num_dst, tc0, virt=3, grid_cap=cap, out=out)
    part[lo:hi].copy_(out[lo:hi])
    ov.wait()
    if recompute:
        ov.finish()
    p.gate_up_swiglu(x_RD, src_N, w13_EDF2, offs_V, tc1, virt=3, out=(h, a))
    p.down_scatter(a, w2_EFD, offs_V, dst_N, gate_N, num_dst, tc1, virt=3, out=out)
    if recompute:
        part[:lo].copy_(out[:lo])
        part[hi:].copy_(out[hi:])
    else:
        ov.send_partials(part, out)
    return part, h


def compose_backward(p, dout_TD, x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F, sched=None):
    """``(dx_RD, dgate_N, dw13_EDF2, dw2_EFD)`` from a primitives module ``p`` (``sched``: as in
    :func:`compose_forward`)."""
    if sched is None:
        tile_cum, order = p.tile_cum(offsets_E, src_N.shape[0], x_RD), None
    else:
        tile_cum, order = _sched_parts(sched, offsets_E)
    dout_rows, dout_idx = _dout_rows(dout_TD, dst_N, w2_EFD.shape[1], p)  # by index, or dout_TD[dst_N]
    dh_N2F, ag_NF, dgate_N = p.down_dswiglu(dout_rows, dout_idx, w2_EFD, offsets_E, h_N2F, gate_N, tile_cum)
    dx = p.down_scatter(dh_N2F, w13_EDF2.transpose(1, 2), offsets_E, src_N, None, x_RD.shape[0], tile_cum)
    order = p.wgrad_order(offsets_E) if order is None else order
    dw2 = p.wgrad_gather(ag_NF, None, dout_rows, dout_idx, offsets_E, order)
    del dout_rows  # (the dout copy's last reader) before the x copy: one N x D transient at a time
    x_rows, x_idx = _x_rows(x_RD, src_N, w2_EFD.shape[1], p)  # recomputed: the forward keeps no copy
    dw13 = p.wgrad_gather(x_rows, x_idx, dh_N2F, None, offsets_E, order)
    del x_rows
    return dx.to(x_RD.dtype), dgate_N.to(gate_N.dtype), dw13, dw2


# --- the portable stock-Triton backend ---------------------------------------------------------------


class _Portable(Primitives):
    """Launchers of tlx/portable/fused_moe.py (one program per possible tile; masks for every tail;
    fixed tiles per dtype: a config's tile fields are the ``tlx`` backend's)."""

    @staticmethod
    def _blocks(x: torch.Tensor):
        from ..grouped_gemm.triton_backend import _blocks

        return _blocks(x)

    @staticmethod
    def _stages(stages: int) -> int:
        # AMD keeps num_stages - 1 tiles per operand in LDS: at 3, the SwiGLU form's two weight tiles
        # need 96 KiB (> gfx942's 64 KiB) and fbtriton 3.7.4 fails to compile the dW kernel for gfx950
        # (block-pingpong pass); 2 fits and compiles (tests/test_fused_compile.py).
        import tlx

        return min(stages, 2) if tlx.gpu_arch() == "gfx94x" else stages

    @staticmethod
    def _flags(x: torch.Tensor) -> dict:
        from ..grouped_gemm.host import interpret_mode

        return dict(IEEE=x.dtype == torch.float32, NO_DOT=interpret_mode())

    @staticmethod
    def tile_cum(offsets_E, n_rows, x):
        from ..grouped_gemm.host import prep_tile_cum

        return prep_tile_cum(offsets_E, n_rows, _Portable._blocks(x)[0]) if n_rows else None

    @staticmethod
    def wgrad_order(offsets_E):
        return None  # one program per dW tile: no walk order

    PHASED = True

    @staticmethod
    def phase_tile_cums(offsets_V, n_rows, x):
        return phase_tile_cums(offsets_V, n_rows, _Portable._blocks(x)[0])

    @staticmethod
    def free_sms(device, side_sms):
        return None  # one program per tile: no persistent grid to shrink

    @staticmethod
    def _mm(a, src, w_EKN, offsets, tile_cum, nn, f_off, epilogue, c, c2=None, dst=None, scale=None, h=None,
            part=None, virt=1):
        from tlx.portable.fused_moe import _fused_mm_kernel

        from ..grouped_gemm.host import max_m_tiles, search_steps

        N = src.shape[0] if src is not None else a.shape[0]  # expert-major rows
        E, K = w_EKN.shape[0] * virt, w_EKN.shape[1]
        BM, BN, BK, warps, stages = _Portable._blocks(a)
        grid = (max_m_tiles(N, E, BM) * -(-nn // BN),)
        _fused_mm_kernel[grid](
            a, src, w_EKN, offsets, tile_cum, c, c2, dst, scale, h, part, N, E, K, nn, f_off,
            a.stride(0), a.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2), c.stride(0),
            c2.stride(0) if c2 is not None else 0, h.stride(0) if h is not None else 0,
            part.stride(0) if part is not None else 0,
            EPILOGUE=epilogue, A_GATHER=src is not None, HAS_SCALE=scale is not None, BM=BM, BN=BN, BK=BK,
            SEARCH_STEPS=search_steps(E), **_Portable._flags(a), num_warps=warps, num_stages=_Portable._stages(stages),
            **({"VIRT": virt} if virt > 1 else {}))

    @staticmethod
    def gate_up_swiglu(x_RD, src_N, w13_EDF2, offsets_E, tile_cum, virt=1, grid_cap=None, out=None):
        N, (E, D, F2) = (src_N if src_N is not None else x_RD).shape[0], w13_EDF2.shape
        h, a = out if out is not None else (x_RD.new_empty(N, F2), x_RD.new_empty(N, F2 // 2))
        if N:
            _Portable._mm(x_RD, src_N, w13_EDF2, offsets_E, tile_cum, F2 // 2, F2 // 2, 1, h, c2=a, virt=virt)
        return h, a

    @staticmethod
    def down_scatter(a_NF, w_EFD, offsets_E, dst_N, scale_N, num_dst, tile_cum, virt=1, grid_cap=None, out=None):
        acc = torch.promote_types(a_NF.dtype, torch.float32)
        if out is None:
            out = torch.zeros(num_dst, w_EFD.shape[2], dtype=acc, device=a_NF.device)
        if a_NF.shape[0]:
            _Portable._mm(a_NF, None, w_EFD, offsets_E, tile_cum, w_EFD.shape[2], 0, 2, out, dst=dst_N, scale=scale_N,
                          virt=virt)
        return out

    @staticmethod
    def down_dswiglu(dout_TD, dst_N, w2_EFD, offsets_E, h_N2F, gate_N, tile_cum):
        N, F = h_N2F.shape[0], w2_EFD.shape[1]
        dh = h_N2F.new_empty(N, 2 * F)
        ag = h_N2F.new_empty(N, F)
        BN = _Portable._blocks(h_N2F)[1]
        part = torch.zeros(N, max(1, -(-F // BN)), dtype=torch.promote_types(h_N2F.dtype, torch.float32),
                           device=h_N2F.device)
        if N:
            _Portable._mm(dout_TD, dst_N, w2_EFD.transpose(1, 2), offsets_E, tile_cum, F, F, 3, dh, c2=ag,
                          scale=gate_N, h=h_N2F, part=part)
        return dh, ag, part.sum(1)

    @staticmethod
    def wgrad_gather(a, ia_N, b, ib_N, offsets_E, order=None):
        from tlx.portable.fused_moe import _fused_wgrad_kernel

        E, D, F = offsets_E.shape[0], a.shape[1], b.shape[1]
        N = (ia_N if ia_N is not None else a).shape[0]
        dw = a.new_empty(E, D, F)
        if dw.numel() == 0:
            return dw
        BM, BN, BK, warps, stages = _Portable._blocks(a)
        grid = (E * -(-D // BM) * -(-F // BN),)
        _fused_wgrad_kernel[grid](
            a, ia_N, b, ib_N, dw, offsets_E, N, E, D, F, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            dw.stride(0), dw.stride(1), dw.stride(2), A_GATHER=ia_N is not None, B_GATHER=ib_N is not None,
            BM=BM, BN=BN, BK=BK, **_Portable._flags(a), num_warps=warps,
            num_stages=_Portable._stages(stages))
        return dw


def _portable_supports(x_RD, w13_EDF2, w2_EFD) -> Optional[str]:
    if not triton_available():
        return "triton is not importable"
    if x_RD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {x_RD.dtype} (needs bfloat16, float16 or float32)"
    if x_RD.device.type == "cpu":
        from ..grouped_gemm.host import interpret_mode

        return None if interpret_mode() else "CPU tensors (set TRITON_INTERPRET=1 to run the kernels interpreted)"
    if x_RD.device.type != "cuda":
        return f"device {x_RD.device}"
    return None


def _portable_forward(*a, config: Optional[FusedConfig] = None, **kw):
    return compose_forward(_Portable(config), *a, **kw)


def _portable_backward(*a, config: Optional[FusedConfig] = None, **kw):
    return compose_backward(_Portable(config), *a, **kw)


register_fused_backend(FusedBackend(
    "triton", _portable_forward, _portable_backward,
    _portable_supports, priority=20))
register_fused_backend(FusedBackend("reference", fused_forward_ref, fused_backward_ref, lambda x, w13, w2: None,
                                    priority=100, auto_on_cpu=True))
