"""Expert-parallel dispatch/combine over symmetric memory: peer stores + device-side signals.

Legend: T tokens on this rank, D hidden, K top-k, S = T*K slots, E experts, W ranks, e = E/W,
N = N_CAP receive rows (static: the buffers' capacity). Receive layout and handle semantics are
those of :class:`AllToAllDispatcher` (expert-major, source-minor; ``offsets_e`` int32 ends; rows
past ``offsets_e[-1]`` are padding, zero-filled), computed with the same ``layout.py`` math.

No host sync and no data-dependent shape: counts are exchanged through the symmetric COUNTS
region and the layout is computed on the GPU; ``num_recv_rows`` is the static capacity; signals
use device-side epochs and counters, so a captured CUDA graph replays correctly.

Each op (dispatch, combine, and their gradients) is a sequence of *phases* written as a Python
generator that yields between kernel launches (``tlx/comm/dispatch.py`` lists them). A real rank
runs its generator straight through; the emulated world (``emulated.py``) advances the generators
of W virtual ranks phase by phase on one stream, so no kernel waits on a later launch.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Generator, Optional

import torch
import torch.distributed as dist

from .dispatcher import DispatchHandle, Dispatcher, check_dispatch_args, inverse_permutation
from .layout import dest_rows, layout_from_counts, sort_slots
from .symm_buffers import SymmBuffers

__all__ = ["SymmDispatcher", "SymmHandle", "dispatch_steps", "combine_steps", "dispatch_grad_steps",
           "combine_grad_steps", "run_steps"]


@dataclass(frozen=True)
class SymmHandle(DispatchHandle):
    """Adds what the symmetric kernels need to undo (or repeat) the dispatch.

    dest_rank_sorted_S / dest_row_sorted_S: ``[S]`` int64, destination rank / row of each sorted slot.
    row_S: ``[S]`` int64 destination row of slot (t*K + k) (>= capacity: the row was dropped).
    recv_from_W: ``[W]`` int64 rows this rank receives from each source.
    sent_to_W: ``[W]`` int64 rows of this rank stored on each destination (dropped ones excluded).
    src_N: ``[N]`` int64 ``src_rank * T_max*K + slot`` of each received row (-1 on padding).
    buffers: the :class:`SymmBuffers` the rows went through.
    """

    dest_rank_sorted_S: torch.Tensor
    dest_row_sorted_S: torch.Tensor
    row_S: torch.Tensor
    recv_from_W: torch.Tensor
    sent_to_W: torch.Tensor
    src_N: torch.Tensor
    buffers: SymmBuffers


# ---------------------------------------------------------------- launch helpers

@functools.lru_cache(maxsize=None)
def _num_programs(device_str: str) -> int:
    if device_str.startswith("cuda"):
        return 4 * torch.cuda.get_device_properties(torch.device(device_str)).multi_processor_count
    return 2  # Triton interpreter: a couple of programs still exercises the persistent loops


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels(device: torch.device):
    """The ``tlx/comm`` kernels (imported on first use). Triton fixes compiled vs interpreted when
    the kernels are decorated, from ``TRITON_INTERPRET``: CPU tensors need it set, CUDA ones unset."""
    if (device.type == "cpu") != _interpreting():
        raise ValueError(f"symmetric dispatch on {device.type} tensors needs TRITON_INTERPRET="
                         f"{'1' if device.type == 'cpu' else '0'} (it is {os.environ.get('TRITON_INTERPRET')!r})")
    from tlx import comm
    return comm


@functools.lru_cache(maxsize=None)
def _with_nvshmem(kernel):
    from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem
    return requires_nvshmem(kernel)


def _launch(bufs: SymmBuffers, kernel, grid, *args, nvshmem_arg: bool = True, **meta):
    if bufs.use_nvshmem:
        kernel = _with_nvshmem(kernel)
    if nvshmem_arg:
        meta["USE_NVSHMEM"] = bufs.use_nvshmem
    kernel[grid](*args, **meta)


def _tiles(words: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_W words): row chunks that divide the row when possible, ~16 KiB tiles."""
    bw = 512
    while bw > 64 and words % bw:
        bw //= 2
    bw = min(bw, _next_pow2(words))
    return max(1, 2048 // bw), bw


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(n_blocks: int, dev: torch.device) -> tuple[int]:
    return (max(1, min(n_blocks, _num_programs(str(dev)))),)


def _barrier(bufs: SymmBuffers, counts_E: Optional[torch.Tensor]):
    """Phase 1 of every op; returns the wait launcher (phase 2). See tlx/comm/dispatch.py."""
    L, k = bufs.layout, _kernels(bufs.device)
    W, E = L.world_size, L.num_experts
    be = _next_pow2(E)
    has = counts_E is not None
    _launch(bufs, k._barrier_signal_kernel, (1,), bufs.peers, bufs.pes, counts_E if has else bufs.peers,
            bufs.rank, W=W, WP2=_next_pow2(2 * W), E=E, BLOCK_E=be, OFF_STATE=L.off_state,
            OFF_FLAGS=L.off_flags, OFF_ARRIVE=L.off_arrive, OFF_COUNTS=L.off_counts, HAS_COUNTS=has)

    def wait() -> Optional[torch.Tensor]:
        counts_WE = torch.empty(W, E, dtype=torch.int64, device=bufs.device) if has else bufs.peers
        _launch(bufs, k._barrier_wait_kernel, (1,), bufs.peers, counts_WE, bufs.rank, nvshmem_arg=False,
                W=W, E=E, BLOCK_E=be, OFF_STATE=L.off_state, OFF_FLAGS=L.off_flags,
                OFF_COUNTS=L.off_counts, HAS_COUNTS=has)
        return counts_WE if has else None
    return wait


def _words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """Rows of ``t`` as raw words (a view; copies only if the last dim is not contiguous)."""
    if t.stride(-1) != 1 or (t.dim() > 1 and t.stride(-2) * t.element_size() % word.itemsize):
        t = t.contiguous()
    return t.view(word)


def _send_rows(bufs, src_RD, h_order, dest_rank, dest_row, S, K, src_is_slot):
    L, k = bufs.layout, _kernels(bufs.device)
    word = L.word_dtype
    src = _words(src_RD, word)
    bm, bw = _tiles(L.words)
    _launch(bufs, k._dispatch_send_kernel, _grid(_cdiv(S, bm), bufs.device),
            src, src.stride(0), h_order, dest_rank, dest_row, bufs.peers, bufs.pes, bufs.rank, S, K,
            W=L.world_size, WP=_next_pow2(L.world_size), N_CAP=L.n_cap, S_MAX=L.s_max,
            WORDS=L.words, ROW_BYTES=L.row_bytes, OFF_STATE=L.off_state, OFF_ARRIVE=L.off_arrive,
            OFF_SRC=L.off_src, OFF_RECV=L.off_recv, SRC_IS_SLOT=src_is_slot, BLOCK_M=bm, BLOCK_W=bw,
            num_warps=8)


def _recv_rows(bufs, recv_from_W, copy_out):
    L, k = bufs.layout, _kernels(bufs.device)
    bm, bw = _tiles(L.words)
    out = (torch.empty(L.n_cap, L.hidden, dtype=L.dtype, device=bufs.device) if copy_out
           else bufs.recv_view())
    src_N = torch.empty(L.n_cap, dtype=torch.int64, device=bufs.device)
    _launch(bufs, k._dispatch_recv_kernel, _grid(_cdiv(L.n_cap, bm), bufs.device),
            out.view(L.word_dtype), src_N, recv_from_W, bufs.peers, bufs.rank, nvshmem_arg=False,
            W=L.world_size, WP=_next_pow2(L.world_size), N_CAP=L.n_cap, WORDS=L.words,
            OFF_STATE=L.off_state, OFF_ARRIVE=L.off_arrive, OFF_SRC=L.off_src, OFF_RECV=L.off_recv,
            COPY_ROWS=copy_out, BLOCK_M=bm, BLOCK_W=bw, num_warps=8)
    return out, src_N

# ---------------------------------------------------------------- the ops, as phase generators

Steps = Generator[None, None, object]


def _check_bufs(bufs: SymmBuffers, x_TD: torch.Tensor, K: int, num_experts: int) -> None:
    L = bufs.layout
    bufs._check_open()
    if x_TD.dtype != L.dtype:
        raise TypeError(f"x_TD.dtype={x_TD.dtype} differs from the symmetric buffers' dtype {L.dtype}")
    if x_TD.shape[1] != L.hidden:
        raise ValueError(f"x_TD has D={x_TD.shape[1]} but the symmetric buffers were built for hidden={L.hidden}")
    if x_TD.shape[0] > L.max_tokens:
        raise ValueError(f"x_TD has T={x_TD.shape[0]} tokens, more than the buffers' max_tokens={L.max_tokens}")
    if K != L.top_k:
        raise ValueError(f"idx_TK has K={K} but the symmetric buffers were built for top_k={L.top_k}")
    if num_experts != L.num_experts:
        raise ValueError(f"num_experts={num_experts} differs from the buffers' num_experts={L.num_experts}")
    if x_TD.device != bufs.device:
        raise ValueError(f"x_TD is on {x_TD.device} but the symmetric buffers are on {bufs.device}")


def dispatch_steps(bufs: SymmBuffers, x_TD: torch.Tensor, idx_TK: torch.Tensor, copy_out: bool = True) -> Steps:
    """Phases of one dispatch on rank ``bufs.rank``; returns ``(recv_ND, SymmHandle)``."""
    L = bufs.layout
    T, K = idx_TK.shape
    _check_bufs(bufs, x_TD, K, L.num_experts)
    W, r, E = L.world_size, bufs.rank, L.num_experts
    e = E // W
    slots = sort_slots(idx_TK, E)
    wait = _barrier(bufs, slots.counts_E)
    yield
    counts_WE = wait()
    layout = layout_from_counts(counts_WE)
    row_sorted_S = dest_rows(layout, r, slots, idx_TK)
    rank_sorted_S = torch.div(idx_TK.reshape(-1).long()[slots.order_S], e, rounding_mode="floor")
    _send_rows(bufs, x_TD, slots.order_S, rank_sorted_S, row_sorted_S, T * K, K, src_is_slot=False)
    yield
    recv_from_W = counts_WE[:, r * e:(r + 1) * e].sum(1)
    recv_ND, src_N = _recv_rows(bufs, recv_from_W, copy_out)
    inverse_S = inverse_permutation(slots.order_S)
    kept = (row_sorted_S < L.n_cap).long()
    sent_to_W = torch.zeros(W, dtype=torch.int64, device=x_TD.device).scatter_add_(0, rank_sorted_S, kept)
    handle = SymmHandle(
        num_tokens=T, top_k=K, num_recv_rows=L.n_cap,
        offsets_e=layout.offsets_We[r].clamp(max=L.n_cap).to(torch.int32),
        recv_counts_e=layout.recv_counts_We[r], tokens_per_expert_E=slots.counts_E,
        order_S=slots.order_S, inverse_S=inverse_S,
        dest_rank_sorted_S=rank_sorted_S, dest_row_sorted_S=row_sorted_S, row_S=row_sorted_S[inverse_S],
        recv_from_W=recv_from_W, sent_to_W=sent_to_W, src_N=src_N, buffers=bufs)
    return recv_ND, handle


def combine_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: SymmHandle, copy_out: bool = True) -> Steps:
    """Phases of one combine; returns ``y_TKD`` (row [t, k] = expert output of slot (t, k))."""
    L, k = bufs.layout, _kernels(bufs.device)
    wait = _barrier(bufs, None)
    yield
    wait()
    y = _words(y_ND, L.word_dtype)
    bm, bw = _tiles(L.words)
    _launch(bufs, k._combine_send_kernel, _grid(_cdiv(L.n_cap, bm), bufs.device),
            y, y.stride(0), h.src_N, h.recv_from_W, bufs.peers, bufs.pes, bufs.rank,
            W=L.world_size, WP=_next_pow2(L.world_size), N_CAP=L.n_cap, S_MAX=L.s_max,
            WORDS=L.words, ROW_BYTES=L.row_bytes, OFF_ARRIVE=L.off_arrive, OFF_COMB=L.off_comb,
            BLOCK_M=bm, BLOCK_W=bw, num_warps=8)
    yield
    T, K = h.num_tokens, h.top_k
    out = (torch.empty(T, K, L.hidden, dtype=L.dtype, device=bufs.device) if copy_out
           else bufs.comb_view(T))
    _launch(bufs, k._combine_recv_kernel, _grid(_cdiv(T * K, bm), bufs.device),
            out.view(L.word_dtype), h.row_S, h.sent_to_W, bufs.peers, bufs.rank, T * K, nvshmem_arg=False,
            W=L.world_size, N_CAP=L.n_cap, WORDS=L.words, OFF_ARRIVE=L.off_arrive, OFF_COMB=L.off_comb,
            COPY_ROWS=copy_out, BLOCK_M=bm, BLOCK_W=bw, num_warps=8)
    return out


def dispatch_grad_steps(bufs: SymmBuffers, g_TKD: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of combine: slot rows ``g_TKD[t, k]`` to their receive rows; returns ``g_ND``
    (padding rows zero)."""
    wait = _barrier(bufs, None)
    yield
    wait()
    S = h.num_tokens * h.top_k
    _send_rows(bufs, g_TKD.reshape(S, bufs.layout.hidden), h.order_S, h.dest_rank_sorted_S, h.dest_row_sorted_S, S,
               h.top_k, src_is_slot=True)
    yield
    g_ND, _ = _recv_rows(bufs, h.recv_from_W, copy_out=True)
    return g_ND


def combine_grad_steps(bufs: SymmBuffers, g_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of dispatch: ``g_ND`` rows back to their slots, summed over k; returns ``g_TD``."""
    g_TKD = yield from combine_steps(bufs, g_ND, h, copy_out=True)
    return g_TKD.sum(1)


def run_steps(steps: Steps):
    """Runs one rank's phases straight through (a real rank, or an emulated world of one)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


# ---------------------------------------------------------------- autograd

class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, idx_TK, bufs, copy_out):
        recv_ND, h = run_steps(dispatch_steps(bufs, x_TD, idx_TK, copy_out))
        ctx.h = h
        return recv_ND, h

    @staticmethod
    def backward(ctx, g_ND, _g_handle):
        h = ctx.h
        return run_steps(combine_grad_steps(h.buffers, g_ND.contiguous(), h)), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, h, copy_out):
        ctx.h = h
        return run_steps(combine_steps(h.buffers, y_ND, h, copy_out))

    @staticmethod
    def backward(ctx, g_TKD):
        h = ctx.h
        return run_steps(dispatch_grad_steps(h.buffers, g_TKD.contiguous(), h)), None, None


class SymmDispatcher(Dispatcher):
    """Dispatch/combine through symmetric memory (see the module docstring).

    Args:
        num_experts: E.
        group: the EP process group (``None``: one rank).
        buffers: a :class:`SymmBuffers` for this group, shared by every layer; built on the first
            dispatch when omitted (then ``max_tokens`` is required, or taken as the largest first
            T over the group, which syncs the host once).
        max_tokens / capacity / backend: passed to :class:`SymmBuffers` when it is built here.
        copy_out: copy the receive buffers out (default). ``False`` returns views of the symmetric
            buffers, valid until the next op on them: for inference and benchmarks, not autograd.
        validate: check expert ids (syncs the host).
    """

    def __init__(self, num_experts: int, group: Optional[dist.ProcessGroup] = None, *,
                 buffers: Optional[SymmBuffers] = None, max_tokens: Optional[int] = None,
                 capacity: Optional[int] = None, backend: str = "auto", copy_out: bool = True,
                 validate: bool = True):
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if buffers is not None:
            if not isinstance(buffers, SymmBuffers):
                raise TypeError(f"buffers must be a SymmBuffers, got {type(buffers).__name__}")
            world, rank = buffers.world_size, buffers.rank
        super().__init__(num_experts, world, rank, validate)
        if buffers is not None and buffers.layout.num_experts != num_experts:
            raise ValueError(f"buffers were built for num_experts={buffers.layout.num_experts}, not {num_experts}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be a positive integer")
        self.group = group
        self.buffers = buffers
        self.max_tokens = max_tokens
        self.capacity = capacity
        self.backend = backend
        self.copy_out = bool(copy_out)

    def _buffers_for(self, x_TD: torch.Tensor, K: int) -> SymmBuffers:
        if self.buffers is None:
            T = self.max_tokens
            if T is None:
                t = torch.tensor([max(1, x_TD.shape[0])], device=x_TD.device)
                if self.group is not None:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                T = int(t.item())  # one-time setup sync
            self.buffers = SymmBuffers(T, x_TD.shape[1], K, self.num_experts, x_TD.dtype, self.group,
                                       capacity=self.capacity, backend=self.backend, device=x_TD.device)
        return self.buffers

    def dispatch(self, x_TD, idx_TK):
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        bufs = self._buffers_for(x_TD, idx_TK.shape[1])
        if not self.copy_out and torch.is_grad_enabled() and x_TD.requires_grad:
            raise ValueError("copy_out=False returns views the next op overwrites; it cannot be used under autograd")
        recv_ND, h = _Dispatch.apply(x_TD, idx_TK, bufs, self.copy_out)
        return recv_ND, h

    def combine(self, y_ND, handle):
        self._check_combine(y_ND, handle)
        if not isinstance(handle, SymmHandle):
            raise TypeError(f"handle must come from SymmDispatcher.dispatch, got {type(handle).__name__}")
        if y_ND.dtype != handle.buffers.layout.dtype or y_ND.shape[1] != handle.buffers.layout.hidden:
            raise ValueError(f"y_ND must be [N, {handle.buffers.layout.hidden}] {handle.buffers.layout.dtype}, "
                             f"got {tuple(y_ND.shape)} {y_ND.dtype}")
        if not self.copy_out and torch.is_grad_enabled() and y_ND.requires_grad:
            raise ValueError("copy_out=False returns views the next op overwrites; it cannot be used under autograd")
        return _Combine.apply(y_ND, handle, self.copy_out)

    def check(self) -> None:
        """Raises if a dispatch dropped rows past the capacity (host sync; see SymmBuffers.check)."""
        if self.buffers is not None:
            self.buffers.check()

    def extra_repr(self) -> Optional[str]:
        return f"{super().extra_repr()}, buffers={self.buffers!r}"
