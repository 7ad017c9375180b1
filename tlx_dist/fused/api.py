"""Functional fused expert pipeline with autograd, registered as torch custom ops.

Legend: T tokens, K top-k, E experts, D hidden, F expert intermediate; R source rows, N expert-major
rows, T_out destination rows (one rank: R = T_out = T, N = T*K).

    out_TD = fused_experts(x_TD, idx_TK, gate_TK, w13_EDF2, w2_EFD)
           = sum_k gate[t, k] * SwiGLU-expert_{idx[t, k]}(x[t])

One rank: the (token, k) slots are sorted by expert on the device (no host sync); row n of expert
order reads ``x[src[n]]`` in the gate/up GEMM (gather-on-load, no permuted copy) and its down-GEMM
row, scaled by ``gate[n]``, is added into ``out[dst[n]]`` in that GEMM's epilogue (src = dst = the
slot's token). :func:`fused_experts_rows` takes the row-index form directly -- ``src_N`` into any
row source (a receive buffer under expert parallelism), ``dst_N`` into any destination -- and is
what the EP pipeline builds on.

Launch choices (row copies, tile configs, the layout kernel): ``config=``, a frozen
:class:`~tlx_dist.fused.config.FusedConfig` (None: every default).

Ops: ``tlx_dist::fused_experts_fwd(x, src, dst, gate, w13, w2, offsets, num_dst, backend, sched,
config) -> (out, h)`` and ``tlx_dist::fused_experts_bwd(...) -> (dx, dgate, dw13, dw2)``, each with a
fake implementation (the config travels as its JSON, the backend as its name); the forward keeps ``h = x[src] @ w13`` (bf16, N x 2F) for the backward rather than
recomputing it (a third of the forward FLOPs); ``a = SwiGLU(h)`` is recomputed from ``h`` in the
backward epilogue. The output and dx are k-sums of fp32 atomic adds: bitwise run-to-run
reproducible only up to fp32 summation order (far below the final bf16 rounding); the separate
pipeline (``MoELayer(pipeline="separate")``) is the deterministic alternative.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

import tlx

from .arrival import ArrivalPlan
from .backends import SCHED_BM, sched_order_offset
from .config import FusedConfig
from .selection import get_fused_backend, select_fused_backend

__all__ = ["fused_experts", "fused_experts_rows", "check_fused_args", "fused_tlx_supports", "expert_major_slots",
           "expert_major_layout"]


# --- custom ops ------------------------------------------------------------------------------------


_KERNEL_BACKENDS = ("tlx", "triton")  # the backends whose compositions take sched / config / overlap


def _as_config(config: Union[None, str, FusedConfig]) -> Optional[FusedConfig]:
    """The op's JSON argument, or the eager path's object, as a FusedConfig (None stays None)."""
    return FusedConfig.from_json(config) if isinstance(config, str) else config


def _fwd_impl(x_RD: torch.Tensor, src_N: torch.Tensor, dst_N: torch.Tensor, gate_N: torch.Tensor,
              w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor, num_dst: int,
              backend: str, sched: Optional[torch.Tensor] = None,
              config: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_body(x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, backend, sched, config)


def _fwd_body(x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, backend, sched=None, config=None,
              overlap=None):
    """The forward's body; ``overlap`` (a receive plan, eager only) is no custom-op argument."""
    b = get_fused_backend(backend)
    args = (x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst)
    kw = {} if sched is None else {"sched": sched}
    config = _as_config(config)
    if config is not None and backend in _KERNEL_BACKENDS:
        kw["config"] = config
    if overlap is not None:  # (eager only: the custom op never gets one)
        if backend in _KERNEL_BACKENDS:  # phased launches where the kernels can
            kw["overlap"] = overlap
        else:
            overlap.wait()  # every row landed before the one-launch gate/up GEMM
    return b.forward(*args, **kw)


def _bwd_impl(dout_TD: torch.Tensor, x_RD: torch.Tensor, src_N: torch.Tensor, dst_N: torch.Tensor,
              gate_N: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
              h_N2F: torch.Tensor, backend: str, sched: Optional[torch.Tensor] = None,
              config: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b = get_fused_backend(backend)
    args = (dout_TD.contiguous(), x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F)
    kw = {} if sched is None else {"sched": sched}
    config = _as_config(config)
    if config is not None and backend in _KERNEL_BACKENDS:
        kw["config"] = config
    return b.backward(*args, **kw)


_fwd_op = torch.library.custom_op("tlx_dist::fused_experts_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("tlx_dist::fused_experts_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _(x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, backend, sched=None, config=None):
    return x_RD.new_empty(num_dst, x_RD.shape[1]), x_RD.new_empty(src_N.shape[0], w13_EDF2.shape[2])


@_bwd_op.register_fake
def _(dout_TD, x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F, backend, sched=None, config=None):
    return torch.empty_like(x_RD), torch.empty_like(gate_N), torch.empty_like(w13_EDF2), torch.empty_like(w2_EFD)


def _setup_context(ctx, inputs, output):
    x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, num_dst, backend, *rest = inputs
    ctx.save_for_backward(x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, output[1], *rest[:1])
    ctx.backend = backend
    ctx.config = rest[1] if len(rest) > 1 else None  # the op's JSON, or the eager path's FusedConfig
    ctx.num_dst = num_dst
    ctx.num_inputs = len(inputs)
    # h's gradient is never used: without this autograd fills an [N, 2F] zero tensor for it every
    # backward (half a gigabyte at OLMoE's shape and 16384 tokens)
    ctx.set_materialize_grads(False)


def _grads(ctx, dout_TD, bwd):
    """The backward of both paths; ``bwd``: the custom op or its body."""
    x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F, *sched = ctx.saved_tensors
    if dout_TD is None:  # the output took no part in the loss
        dout_TD = x_RD.new_zeros(ctx.num_dst, x_RD.shape[1])
    dx, dgate, dw13, dw2 = bwd(dout_TD, x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E, h_N2F, ctx.backend,
                               sched[0] if sched else None, ctx.config)
    grads = (dx, None, None, dgate, dw13, dw2)
    return grads + (None,) * (ctx.num_inputs - len(grads))


def _backward(ctx, dout_TD, _dh):
    return _grads(ctx, dout_TD, _bwd_op)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _FusedEager(torch.autograd.Function):
    """The ops' bodies called directly, for eager mode: the custom op's dispatch layers (the op
    call, its autograd wrapper, the redispatch, the dynamo-disable wrapper) cost host time on every
    call, and the layer is host-bound at a few thousand tokens. Under ``torch.compile`` the custom op
    is used: it is what traces. Same kernels, same saved tensors."""

    @staticmethod
    def forward(ctx, *inputs):
        out, h_N2F = _fwd_body(*inputs)
        _setup_context(ctx, inputs, (out, h_N2F))
        ctx.mark_non_differentiable(h_N2F)
        return out, h_N2F

    @staticmethod
    def backward(ctx, dout_TD, _dh):
        return _grads(ctx, dout_TD, _bwd_impl)


def _run_fused(*args, sched=None, config: Optional[FusedConfig] = None, overlap=None):
    """``(out, h)``: the custom op under torch.compile, :class:`_FusedEager` in eager mode.
    ``args``: the op's up to ``backend``; ``overlap``: see :func:`fused_experts_rows` (the compiled
    op waits for every row first)."""
    if torch.compiler.is_compiling():
        if overlap is not None:
            overlap.wait()
        return _fwd_op(*args, sched, None if config is None else config.to_json())
    if overlap is not None:
        return _FusedEager.apply(*args, sched, config, overlap)
    return _FusedEager.apply(*args, sched, config)


# --- checks ----------------------------------------------------------------------------------------


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_fused_args(x_RD, w13_EDF2, w2_EFD) -> None:
    """Shapes, dtypes and devices of the activations and weights; TypeError / ValueError naming the
    argument."""
    for name, t in (("x", x_RD), ("w13_EDF2", w13_EDF2), ("w2_EFD", w2_EFD)):
        _tensor(name, t)
    if x_RD.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, D], got shape {tuple(x_RD.shape)}")
    if w13_EDF2.dim() != 3 or w13_EDF2.shape[2] % 2:
        raise ValueError(f"w13_EDF2 must be [E, D, 2F], got shape {tuple(w13_EDF2.shape)}")
    E, D, F2 = w13_EDF2.shape
    if tuple(w2_EFD.shape) != (E, F2 // 2, D):
        raise ValueError(f"w2_EFD must be [E={E}, F={F2 // 2}, D={D}] to match w13_EDF2, got {tuple(w2_EFD.shape)}")
    if x_RD.shape[1] != D:
        raise ValueError(f"x has D={x_RD.shape[1]} columns but w13_EDF2 expects D={D}")
    if not x_RD.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {x_RD.dtype}")
    for name, t in (("w13_EDF2", w13_EDF2), ("w2_EFD", w2_EFD)):
        if t.dtype != x_RD.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} differs from x.dtype={x_RD.dtype}")
        if t.device != x_RD.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x_RD.device}")


def _check_index(name: str, t, n: Optional[int], device) -> None:
    _tensor(name, t)
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        raise ValueError(f"{name} must be 1-D{'' if n is None else f' with {n} entries'}, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def fused_tlx_supports(x_RD: torch.Tensor, w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor) -> bool:
    """True when the Hopper TLX fused kernels run these operands (what ``MoELayer(pipeline="auto")``
    keys on). The Blackwell kernels are not chosen automatically until they have run on a B200
    (``pipeline="fused"`` selects them). Never raises; reads no device values."""
    if tlx.gpu_arch() != "sm_90":
        return False
    try:
        return get_fused_backend("tlx").supports(x_RD, w13_EDF2, w2_EFD) is None
    except ValueError:  # not registered: no TLX
        return False


def _check_config(config, b) -> Optional[FusedConfig]:
    """``config`` checked against the backend that runs: its tile fields are the ``tlx`` backend's
    (a ValueError elsewhere, never a silent no-op) and must be for this GPU's generation."""
    if config is None:
        return None
    if not isinstance(config, FusedConfig):
        raise TypeError(f"config must be a FusedConfig or None, got {type(config).__name__}")
    if b.name == "tlx":
        config.check_arch(tlx.gpu_arch())
    elif config.pins_tiles:
        raise ValueError(f"config pins tile configs of the TLX kernels, but the fused backend {b.name!r} runs these "
                         "operands; pin backend='tlx' or leave the tile fields None")
    return config


# --- public functions --------------------------------------------------------------------------------


def fused_experts_rows(x_RD: torch.Tensor, src_N: torch.Tensor, dst_N: torch.Tensor, gate_N: torch.Tensor,
                       w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor, num_dst: int,
                       *, backend: Optional[str] = None, overlap: Optional[ArrivalPlan] = None,
                       config: Optional[FusedConfig] = None) -> torch.Tensor:
    """The fused experts in row-index form, differentiable in ``x_RD``, ``gate_N``, ``w13``, ``w2``.

    ``out[dst[n]] += gate[n] * (SwiGLU(x[src[n]] @ w13[e]) @ w2[e])`` for every row n of expert e
    (rows ``[offsets[e-1], offsets[e])``); rows past ``offsets_E[-1]`` are padding (their indices
    are never read).

    Args:
        x_RD: ``[R, D]`` row source (bf16 / fp16 / fp32 / fp64).
        src_N, dst_N: ``[N]`` int32/int64 source and destination row of each expert-major row,
            in ``[0, R)`` and ``[0, num_dst)`` (not validated on the device: the caller's routing
            guarantees it).
        gate_N: ``[N]`` float gate weight of each row (fp32 from the router).
        w13_EDF2: ``[E, D, 2F]`` gate | up; w2_EFD: ``[E, F, D]``.
        offsets_E: ``[E]`` int32/int64 cumulative end rows, ``offsets_E[-1] <= N``.
        num_dst: rows of the output.
        backend: ``"tlx" | "triton" | "reference"`` to pin one; default automatic.
        overlap: the receive plan of an overlapped EP dispatch (``SymmDispatcher(overlap=True)``,
            an :class:`~tlx_dist.fused.arrival.ArrivalPlan`): some sources' rows of ``x_RD`` may
            still be landing. The Hopper TLX and the portable kernels compute the rows present first
            (this rank's own, or its node's under the hierarchical exchange), wait, then the rest,
            whose partial rows the plan starts home at once (the combine's first kernel; under the
            hierarchical exchange that kernel also writes them into the output, on the exchange's
            side stream, so they are there once the combine has joined it); the output must then go
            to ``combine_rows`` as it is. Other backends wait for every row first and leave the
            combine whole.
        config: the launch choices (:class:`~tlx_dist.fused.config.FusedConfig`); default: all defaults.
    Returns:
        ``[num_dst, D]`` in ``x_RD.dtype``.
    """
    check_fused_args(x_RD, w13_EDF2, w2_EFD)
    N = src_N.shape[0] if isinstance(src_N, torch.Tensor) else None
    for name, t in (("src_N", src_N), ("dst_N", dst_N)):
        _check_index(name, t, N, x_RD.device)
    _check_index("offsets_E", offsets_E, w13_EDF2.shape[0], x_RD.device)
    _tensor("gate_N", gate_N)
    if gate_N.shape != (N,) or not gate_N.is_floating_point() or gate_N.device != x_RD.device:
        raise ValueError(f"gate_N must be a float [N={N}] tensor on {x_RD.device}, got {gate_N.dtype} "
                         f"{tuple(gate_N.shape)} on {gate_N.device}")
    if not isinstance(num_dst, int) or isinstance(num_dst, bool) or num_dst < 0:
        raise ValueError(f"num_dst={num_dst!r} must be a non-negative int")
    b = select_fused_backend(x_RD, w13_EDF2, w2_EFD, backend)
    config = _check_config(config, b)
    out, _h = _run_fused(x_RD, src_N, dst_N, gate_N, w13_EDF2, w2_EFD, offsets_E.to(torch.int32), num_dst, b.name,
                         config=config, overlap=overlap)
    return out


def _routing_kernel_runs(idx_TK: torch.Tensor, wanted: bool = True) -> bool:
    """Whether :func:`fused_experts` takes the one-launch expert-major layout
    (``tlx/common/routing.py``) instead of the torch sort: where it can run (CUDA, and CPU under
    ``TRITON_INTERPRET=1``), in eager mode on real tensors (torch.compile, fake tensors and other
    tracing modes get the torch ops), unless ``wanted``
    (``FusedConfig.layout_kernel``) is False. It also writes the TLX kernels' scheduler tables, so
    neither pass runs their prep kernel: fewer launches between the router and the first GEMM, where
    the GPU waits on the host at a few thousand tokens."""
    from ..grouped_gemm.host import slots_kernel_runs

    return wanted and slots_kernel_runs(idx_TK)


def expert_major_layout(idx_TK: torch.Tensor, E: int, block_m: int = SCHED_BM):
    """:func:`expert_major_slots` in one launch (``tlx.common.routing._expert_slots_kernel``), plus
    the scheduler tables of the TLX kernels: ``(tok_N int32, order_S int64, offsets_E int32,
    sched int32)`` with ``sched[:E + 1]`` the inclusive sum of ``block_m``-row tiles per expert
    (entry E adds the padding rows' tiles) and ``sched[o:o + E]``, ``o = sched_order_offset(E)``, the
    experts by row count, longest first (ties by index). Same rows, same order as
    :func:`expert_major_slots` (a stable sort by expert). Ids
    outside ``[0, E)`` (never from the router) become padding rows after ``offsets_E[-1]`` that no
    kernel computes: those slots get no expert output. No host sync."""
    from ..grouped_gemm.host import expert_slots

    return expert_slots(idx_TK, E, block_m, sched_order_offset(E))


def fused_experts(x_TD: torch.Tensor, idx_TK: torch.Tensor, gate_TK: torch.Tensor, w13_EDF2: torch.Tensor,
                  w2_EFD: torch.Tensor, *, backend: Optional[str] = None,
                  config: Optional[FusedConfig] = None) -> torch.Tensor:
    """One rank's routed experts, fused: ``out[t] = sum_k gate[t, k] * expert_{idx[t, k]}(x[t])``
    with ``expert_e(x) = (silu(x @ w13[e][:, :F]) * (x @ w13[e][:, F:])) @ w2[e]``.

    Args:
        x_TD: ``[T, D]`` tokens (bf16 on the GPU; any float dtype on the reference backend).
        idx_TK: ``[T, K]`` int32/int64 expert ids in ``[0, E)`` (the router's; not validated on
            the device).
        gate_TK: ``[T, K]`` float gate weights (fp32 from the router).
        w13_EDF2: ``[E, D, 2F]``; w2_EFD: ``[E, F, D]``.
        backend: ``"tlx"`` (Hopper TLX kernels), ``"triton"`` (portable Triton kernels),
            ``"reference"`` (PyTorch) to pin one; default automatic.
        config: the launch choices (:class:`~tlx_dist.fused.config.FusedConfig`); default: all defaults.
    Returns:
        ``[T, D]`` in ``x_TD.dtype``; differentiable in x, gate, w13 and w2. No host sync on the
        kernel backends: CUDA-graph capturable.
    """
    check_fused_args(x_TD, w13_EDF2, w2_EFD)
    _tensor("idx_TK", idx_TK)
    _tensor("gate_TK", gate_TK)
    if idx_TK.dim() != 2 or idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"idx_TK must be [T={x_TD.shape[0]}, K], got shape {tuple(idx_TK.shape)}")
    if idx_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx_TK must be int32 or int64, got {idx_TK.dtype}")
    if gate_TK.shape != idx_TK.shape or not gate_TK.is_floating_point():
        raise ValueError(f"gate_TK must be a float tensor of shape {tuple(idx_TK.shape)}, got {gate_TK.dtype} "
                         f"{tuple(gate_TK.shape)}")
    for name, t in (("idx_TK", idx_TK), ("gate_TK", gate_TK)):
        if t.device != x_TD.device:
            raise ValueError(f"{name} is on {t.device} but x_TD is on {x_TD.device}")
    T, E = idx_TK.shape[0], w13_EDF2.shape[0]
    b = select_fused_backend(x_TD, w13_EDF2, w2_EFD, backend)
    config = _check_config(config, b)
    # The layout kernel: one launch for the layout and, for the TLX kernels, their scheduler tables.
    if _routing_kernel_runs(idx_TK, config is None or config.layout_kernel):
        tok_N, order_S, offsets_E, sched = expert_major_layout(idx_TK, E)
    else:
        (tok_N, order_S, offsets_E), sched = expert_major_slots(idx_TK, E), None
    gate_N = gate_TK.reshape(-1).index_select(0, order_S)  # backward: a scatter of a permutation
    out, _h = _run_fused(x_TD, tok_N, tok_N, gate_N, w13_EDF2, w2_EFD, offsets_E, T, b.name,
                         sched=sched if b.name == "tlx" else None, config=config)
    return out


def expert_major_slots(idx_TK: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, k) slots sorted by expert (stable: token order within an expert), as
    :func:`fused_experts_rows` takes them: ``(tok_N int32 token of each row, order_S int64 slot
    index t*K + k of each row, offsets_E int32 end row of each expert)``. A handful of small
    kernels, no host sync."""
    K = idx_TK.shape[1]
    expert_S, order_S = torch.sort(idx_TK.reshape(-1), stable=True)
    # each expert's end row is the number of sorted ids <= e
    offsets_E = torch.searchsorted(expert_S, torch.arange(E, device=idx_TK.device, dtype=expert_S.dtype),
                                   right=True, out_int32=True)
    tok_N = torch.div(order_S, K, rounding_mode="floor").to(torch.int32)
    return tok_N, order_S, offsets_E
