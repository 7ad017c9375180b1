"""Host helpers every grouped-GEMM kernel backend shares (portable Triton, TLX Hopper/Blackwell, AMD,
and the fused pipeline): the device tile-count prep (``tile_cum``, one launch of the scheduler's prep
kernel, which also clamps the offsets), the binary-search depth, the tile bound, the ragged TMA
descriptor. Nothing here reads device values on the host: every launch is CUDA-graph safe.

Legend: N rows, E experts, ``offsets_E`` cumulative end rows.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .guard import offsets_flag
from .reference import check_num_experts, safe_offsets_ref

__all__ = ["prep_offsets", "prep_tile_cum", "guard_offsets", "search_steps", "max_m_tiles", "ragged_descriptor",
           "interpret_mode", "num_sms", "lpt_order", "tma_2d_reason", "operand_reason", "launch_meta", "expert_slots",
           "sched_order_offset", "slots_kernel_runs"]


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_meta(defaults: dict, launch: Optional[dict]) -> dict:
    """One kernel launch's meta-parameters: the wrapper's constants ``defaults`` (e.g.
    ``{"BLOCK_M": 32, "num_warps": 4}``), with ``launch``'s overrides where given (None: the
    defaults). The overrides exist for launch-config sweeps (bench/fp8_kernels.py ``--sweep``) and
    may name only the defaults' keys and ``num_stages``: any other constexpr sets what the kernel
    computes, not how it is launched."""
    if launch is None:
        return dict(defaults)
    if not isinstance(launch, dict):
        raise TypeError(f"_launch must be a dict of meta-parameters or None, got {type(launch).__name__}")
    bad = sorted(set(launch) - set(defaults) - {"num_stages"})
    if bad:
        raise ValueError(f"_launch={launch!r}: {bad} not launch parameters of this kernel (it takes "
                         f"{sorted(set(defaults) | {'num_stages'})})")
    for k, v in launch.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"_launch[{k!r}]={v!r} must be a positive int")
    return {**defaults, **launch}


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    """Streaming multiprocessors (AMD: compute units) of CUDA device ``index``: the persistent grid."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def search_steps(n_experts: int) -> int:
    """Binary-search depth over the E + 1 entries of ``tile_cum`` (one spare step)."""
    return max(1, math.ceil(math.log2(n_experts + 1)) + 1)


def max_m_tiles(n_rows: int, n_experts: int, block_m: int) -> int:
    """Upper bound of BM-row tiles over E experts + the padding pseudo-expert, from shapes only:
    sum_e cdiv(rows_e, BM) <= N / BM + (E + 1)."""
    return n_rows // block_m + n_experts + 1


def prep_offsets(offsets_E: torch.Tensor, n_rows: int, block_m: int = 0, phase: int = -1):
    """(``safe_E`` ``[E]`` int32, ``tile_cum`` ``[E + 1]`` int32 or None) on the device, from one
    launch of the scheduler's prep kernel: the offsets clamped into ``[0, n_rows]`` and made
    non-decreasing (the device offsets flag records what was out of range; see ``guard.py``), and,
    with ``block_m``, the inclusive cumsum of BM-row tiles per expert (+ padding). ``offsets_E``
    may be int32 or int64; ``E >= 1``. ``phase`` 0 / 1 (with ``block_m``): the tiles of one phase
    of the EP overlap's split gate/up GEMM over ``3 * experts`` virtual experts
    (``tlx/common/scheduler.py``)."""
    import triton

    from tlx.common.scheduler import _grouped_tile_prep_kernel

    E = offsets_E.shape[0]
    check_num_experts(E, "offsets_E")
    dev = offsets_E.device
    safe = torch.empty(E, dtype=torch.int32, device=dev)
    tile_cum = torch.empty(E + 1, dtype=torch.int32, device=dev) if block_m else None
    _grouped_tile_prep_kernel[(1,)](offsets_E.contiguous(), safe, safe if tile_cum is None else tile_cum,
                                    offsets_flag(dev), E, n_rows, BM=max(block_m, 1),
                                    E1_P2=triton.next_power_of_2(E + 1), TILES=bool(block_m), PHASE=phase, VIRT=3)
    return safe, tile_cum


def prep_tile_cum(offsets_E: torch.Tensor, n_rows: int, block_m: int) -> torch.Tensor:
    """``[E + 1]`` int32 on the device: inclusive cumsum of BM-row tiles per expert (+ padding),
    over the safe offsets (``prep_offsets``, whose ``safe_E`` the kernel should also be given)."""
    return prep_offsets(offsets_E, n_rows, block_m)[1]


def sched_order_offset(E: int) -> int:
    """Where the dW expert order starts in a precomputed schedule: after tile_cum's ``E + 1``
    entries, rounded up to 4 (16-byte aligned, like every pointer the kernels specialise on)."""
    return -(-(E + 1) // 4) * 4


def slots_kernel_runs(idx_TK: torch.Tensor) -> bool:
    """Whether :func:`expert_slots` can take this call: Triton present, a real tensor (not under
    torch.compile, fake tensors, make_fx or another tracing mode: those get torch's sort), on a CUDA
    device, or on the CPU under ``TRITON_INTERPRET=1``."""
    from tlx import triton_available

    from .eager import traced

    if not triton_available() or traced((idx_TK,), {}):
        return False
    cuda = idx_TK.device.type == "cuda"
    return cuda != interpret_mode() and (cuda or idx_TK.device.type == "cpu")


def expert_slots(idx_TK: torch.Tensor, E: int, block_m: int, order_off: int):
    """``(tok_N int32 [S], order_S int64 [S], offsets_E int32 [E], sched int32 [order_off + E])``:
    one launch of ``tlx.common.routing._expert_slots_kernel`` (a stable sort of the ``S = T * K``
    slots by expert, with the scheduler's tables: ``sched[:E + 1]`` the inclusive sum of
    ``block_m``-row tiles per expert, entry E adding the padding rows' tiles; ``sched[order_off:]``
    the experts by row count, longest first). Ids outside ``[0, E)`` become padding rows after
    ``offsets_E[-1]``. ``order_off``: a multiple of 4, at least ``E + 1``. No host sync."""
    import triton

    from tlx.common.routing import _expert_slots_kernel

    check_num_experts(E, "E")
    T, K = idx_TK.shape
    S = T * K
    if S >= 2**31:
        raise ValueError(f"idx_TK has T*K={S} slots; the layout kernel indexes them in int32 (< 2**31)")
    dev = idx_TK.device
    tok_N = torch.empty(S, dtype=torch.int32, device=dev)
    order_S = torch.empty(S, dtype=torch.int64, device=dev)
    offsets_E = torch.empty(E, dtype=torch.int32, device=dev)
    # the kernel writes tile_cum [E + 1] and the order [E]; the entries between them are padding
    sched = torch.empty(order_off + E, dtype=torch.int32, device=dev)
    if S == 0:
        sched.zero_()
        offsets_E.zero_()
        sched[order_off:].copy_(torch.arange(E, dtype=torch.int32, device=dev))
        return tok_N, order_S, offsets_E, sched
    _expert_slots_kernel[(E,)](idx_TK.contiguous().reshape(-1), tok_N, order_S, offsets_E, sched, S, K, E, order_off,
                               BM=block_m, EP=triton.next_power_of_2(E + 1), BLOCK=1024, num_warps=4)
    return tok_N, order_S, offsets_E, sched


def guard_offsets(offsets_E: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``safe_E`` (int32, contiguous, on ``offsets_E``'s device) for a backend, the offsets flag
    updated (``guard.py``); no host sync. On a GPU with Triton one tiny kernel (the scheduler's prep
    kernel) does it; elsewhere a few torch ops."""
    check_num_experts(offsets_E.shape[0], "offsets_E")
    flag = offsets_flag(offsets_E.device)
    if offsets_E.is_cuda:
        from tlx import triton_available

        if triton_available():
            return prep_offsets(offsets_E, n_rows)[0]
    safe, bits = safe_offsets_ref(offsets_E, n_rows)
    flag.bitwise_or_(bits)
    return safe


def ragged_descriptor(t_RC: torch.Tensor, block_rows: int, block_cols: int):
    """A 4-D TMA descriptor over a row-major ``[R, C]`` tensor whose loads/stores can be bounded to
    any row slice (tlx/common/scheduler.py explains the coordinates)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    R, C = t_RC.shape
    s = t_RC.stride(0)
    if R > (1 << 30):
        raise ValueError(f"ragged descriptor: {R} rows exceed 2**30")
    big = 0x7FFF0000
    return TensorDescriptor(t_RC, [big, big, 1 << 30, C], [(1 << 34) - s, s, s, 1], [1, 1, block_rows, block_cols])


def lpt_order(offsets: torch.Tensor) -> torch.Tensor:
    """``[E]`` int32 on the device: experts by row count, largest first (ties by index); the dW
    kernels' longest-first walk (tlx/common/scheduler.py)."""
    from tlx.common.scheduler import _lpt_order_kernel

    E = offsets.shape[0]
    order = torch.empty(E, dtype=torch.int32, device=offsets.device)
    _lpt_order_kernel[(-(-E // 64),)](offsets, order, E, BLOCK=64, num_warps=4)
    return order


def tma_2d_reason(name: str, t: torch.Tensor) -> Optional[str]:
    """Why ``t`` cannot be read by TMA (NVIDIA) / 16-byte vector loads (AMD) as a 2-D row-major
    operand, or None."""
    esz = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})"
    # The base address is not traceable (torch.compile, and AOT tracing of a backward or opcheck, where
    # is_compiling() is False but the tensor is a FakeTensor/FunctionalTensor): there the check moves
    # into the launcher, which runs eagerly inside the custom op and falls back to the portable kernel.
    misaligned_base = False
    if not torch.compiler.is_compiling() and not isinstance(t, FakeTensor):
        try:
            misaligned_base = t.data_ptr() % 16 != 0
        except RuntimeError:  # "Cannot access data pointer of Tensor": traced
            misaligned_base = False
    if any((s * esz) % 16 for s in t.stride()[:-1]) or misaligned_base:
        return f"{name} needs a 16-byte aligned base and row strides for TMA (strides {tuple(t.stride())})"
    return None


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
    why = tma_2d_reason("x_ND", x_ND)
    if why:
        return why
    if w_EDF.stride(2) == 1:
        w_view = w_EDF
    elif w_EDF.stride(1) == 1:
        w_view = w_EDF.transpose(1, 2)
    else:
        return f"w_EDF must be contiguous in its last or second-to-last dimension (strides {tuple(w_EDF.stride())})"
    return tma_2d_reason("w_EDF", w_view)
