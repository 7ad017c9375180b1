"""Symmetric buffers for one expert-parallel group: allocation, peer table, sizing, overflow check.

Legend: T_max max tokens per rank, D hidden, K top-k, E experts, W ranks, e = E/W,
S_MAX = T_max*K slots, N_CAP receive rows per rank.

One allocation per rank, the same byte layout on every rank (see ``tlx/comm/dispatch.py`` for the
regions). ``N_CAP`` is the worst case ``W * T_max * min(K, e)`` (a token sends at most min(K, e)
distinct experts to one rank) unless a smaller ``capacity`` is declared; rows past it are dropped
*and counted*: the overflow flag is raised on the device and :meth:`SymmBuffers.check` raises.

Backends:
  ``"cuda"``     torch symmetric memory (CUDA backend): peer pointers over NVLink, one node.
  ``"nvshmem"``  torch symmetric memory on its NVSHMEM backend: peer pointers for ranks on this
                 node, NVSHMEM puts/signals for ranks on other nodes (kernels link libnvshmem_device).
  ``"local"``    W = 1 without a process group: a plain device allocation.
  ``"emulated"`` W virtual ranks in one process (:meth:`SymmBuffers.emulated`): slices of one
                 allocation, each with its own peer table; tier T4 tests and single-GPU benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .topology import Topology

__all__ = ["SymmLayout", "SymmBuffers"]

_ALIGN = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return v


@dataclass(frozen=True)
class SymmLayout:
    """Byte layout of one rank's symmetric region (identical on every rank)."""

    world_size: int
    num_experts: int
    max_tokens: int
    hidden: int
    top_k: int
    dtype: torch.dtype
    n_cap: int
    off_state: int
    off_flags: int
    off_arrive: int
    off_counts: int
    off_src: int
    off_recv: int
    off_comb: int
    nbytes: int

    @property
    def s_max(self) -> int:
        return self.max_tokens * self.top_k

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def word_dtype(self) -> torch.dtype:
        """Rows move as raw words: the widest of 8/4/2/1 bytes dividing a row."""
        for w in (8, 4, 2, 1):
            if self.row_bytes % w == 0:
                return _WORD[w]
        raise AssertionError("unreachable")

    @property
    def words(self) -> int:
        return self.row_bytes // self.word_dtype.itemsize

    @classmethod
    def build(cls, max_tokens: int, hidden: int, top_k: int, num_experts: int, world_size: int,
              dtype: torch.dtype, capacity: Optional[int] = None) -> "SymmLayout":
        _pos_int("max_tokens", max_tokens)
        _pos_int("hidden", hidden)
        _pos_int("top_k", top_k)
        _pos_int("num_experts", num_experts)
        _pos_int("world_size", world_size)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise TypeError(f"dtype={dtype!r} must be one of {_DTYPES}")
        if num_experts % world_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size}")
        e = num_experts // world_size
        worst = world_size * max_tokens * min(top_k, e)
        n_cap = worst if capacity is None else _pos_int("capacity", capacity)
        if world_size * max_tokens * top_k >= 2**31:
            raise ValueError(f"world_size*max_tokens*top_k={world_size * max_tokens * top_k} must be < 2**31")
        row = hidden * dtype.itemsize
        off, offs = 0, {}
        for name, size in (("state", 64), ("flags", 8 * world_size), ("arrive", 16 * world_size),
                           ("counts", 16 * world_size * num_experts), ("src", 8 * n_cap),
                           ("recv", row * n_cap), ("comb", row * max_tokens * top_k)):
            offs[name] = off
            off = _align(off + size)
        return cls(world_size, num_experts, max_tokens, hidden, top_k, dtype, n_cap,
                   offs["state"], offs["flags"], offs["arrive"], offs["counts"], offs["src"],
                   offs["recv"], offs["comb"], off)


class SymmBuffers:
    """Symmetric buffers of one rank of an EP group; build once, share across layers and steps.

    Args:
        max_tokens: T_max, the most tokens any rank dispatches in one call.
        hidden: D. top_k: K. num_experts: E. dtype: the rows' dtype.
        group: the EP process group (``None``: one rank, ``backend="local"``).
        capacity: receive rows per rank; default the worst case ``W * T_max * min(K, E/W)``.
        backend: ``"auto"`` (cuda on one node, nvshmem across nodes), ``"cuda"``, ``"nvshmem"``, ``"local"``.
        device: CUDA device (default: the current one).
    """

    def __init__(self, max_tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                 group=None, *, capacity: Optional[int] = None, backend: str = "auto", device=None):
        import torch.distributed as dist

        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world, dtype, capacity)
        if backend not in ("auto", "cuda", "nvshmem", "local"):
            raise ValueError(f"backend={backend!r} is not one of 'auto', 'cuda', 'nvshmem', 'local'")
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if group is None:
            if backend not in ("auto", "local"):
                raise ValueError(f"backend={backend!r} needs a process group")
            mem = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
            self._init(layout, rank, mem, [mem.data_ptr()], [0], "local", handle=None)
            return
        topo = Topology.from_group(group)
        if backend == "auto":
            backend = "cuda" if topo.single_node else "nvshmem"
        if backend == "cuda" and not topo.single_node:
            raise ValueError("backend='cuda' reaches only ranks on this node; the group spans nodes (use 'nvshmem')")
        from torch.distributed import _symmetric_memory as symm_mem

        if backend == "nvshmem":
            if not symm_mem.is_nvshmem_available():
                raise RuntimeError("backend='nvshmem' needs torch built with NVSHMEM")
            symm_mem.set_backend("NVSHMEM")
        mem = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=device)
        mem.zero_()
        handle = symm_mem.rendezvous(mem, group)
        # Peers on other nodes get 0: the kernels reach them with NVSHMEM puts to this rank's own
        # (symmetric) addresses on PE ``pes[d]`` (torch's NVSHMEM PEs are global ranks).
        ptrs = [int(p) if topo.same_node(d) else 0 for d, p in enumerate(handle.buffer_ptrs)]
        self._init(layout, rank, mem, ptrs, list(topo.global_ranks), backend, handle=handle)
        handle.barrier(channel=0)  # every rank's region is zeroed before anyone signals into it
        torch.cuda.synchronize(device)

    def _init(self, layout, rank, mem, ptrs, pes, backend, handle):
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.backend = backend
        self._mem = mem
        self._handle = handle
        self.device = mem.device
        self.peers = torch.tensor(ptrs, dtype=torch.int64, device=mem.device)
        self.pes = torch.tensor(pes, dtype=torch.int32, device=mem.device)
        self.use_nvshmem = backend == "nvshmem" and 0 in ptrs

    # ---- sizing ----
    @staticmethod
    def size_hint(max_tokens: int, hidden: int, top_k: int, num_experts: int, world_size: int,
                  dtype: torch.dtype, capacity: Optional[int] = None) -> int:
        """Bytes of symmetric memory one rank allocates for these sizes."""
        return SymmLayout.build(max_tokens, hidden, top_k, num_experts, world_size, dtype, capacity).nbytes

    @property
    def capacity(self) -> int:
        return self.layout.n_cap

    # ---- views of the regions (this rank's) ----
    def _region(self, off: int, nbytes: int) -> torch.Tensor:
        self._check_open()
        return self._mem[off: off + nbytes]

    def recv_view(self) -> torch.Tensor:
        """``[N_CAP, D]`` the dispatch receive rows (overwritten by the next dispatch)."""
        L = self.layout
        return self._region(L.off_recv, L.n_cap * L.row_bytes).view(L.dtype).view(L.n_cap, L.hidden)

    def comb_view(self, num_tokens: int) -> torch.Tensor:
        """``[T, K, D]`` the combine receive rows (overwritten by the next combine)."""
        L = self.layout
        n = num_tokens * L.top_k
        return self._region(L.off_comb, n * L.row_bytes).view(L.dtype).view(num_tokens, L.top_k, L.hidden)

    def state(self) -> torch.Tensor:
        """``[2]`` int64: ops started (epoch), overflow flag."""
        return self._region(self.layout.off_state, 16).view(torch.int64)

    # ---- overflow ----
    def check(self) -> None:
        """Raises RuntimeError if any dispatch since the last check dropped rows past the capacity.
        Syncs with the host: call it at a logging step, not per layer."""
        flag = self.state()[1]
        if int(flag.item()):
            flag.zero_()
            raise RuntimeError(
                f"symmetric dispatch overflowed its capacity of {self.layout.n_cap} receive rows on rank "
                f"{self.rank}: rows were dropped (their combine outputs are zero with copy_out=True, "
                f"stale with copy_out=False). Raise capacity= "
                f"(worst case W*T_max*min(K, E/W) = "
                f"{self.world_size * self.layout.max_tokens * min(self.layout.top_k, self.layout.num_experts // self.world_size)})")

    # ---- lifetime ----
    def _check_open(self) -> None:
        if self._mem is None:
            raise RuntimeError("SymmBuffers is closed")

    @property
    def closed(self) -> bool:
        return self._mem is None

    def close(self) -> None:
        """Releases the memory (collective for the cuda/nvshmem backends: every rank closes)."""
        self._mem = None
        self._handle = None
        self.peers = None

    def __repr__(self) -> str:
        L = self.layout
        return (f"SymmBuffers(rank={self.rank}/{self.world_size}, backend={self.backend}, T_max={L.max_tokens}, "
                f"D={L.hidden}, K={L.top_k}, E={L.num_experts}, dtype={L.dtype}, capacity={L.n_cap}, "
                f"bytes={L.nbytes})")

    # ---- emulated world ----
    @classmethod
    def emulated(cls, world_size: int, max_tokens: int, hidden: int, top_k: int, num_experts: int,
                 dtype: torch.dtype, *, capacity: Optional[int] = None, device=None) -> list["SymmBuffers"]:
        """W virtual ranks in this process: one zeroed allocation of W equal slices, one
        :class:`SymmBuffers` per virtual rank, each with its own peer table. ``device`` may be
        ``"cpu"`` for the Triton interpreter."""
        layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world_size, dtype, capacity)
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        mem = torch.zeros(world_size * layout.nbytes, dtype=torch.uint8, device=device)
        ptrs = [mem.data_ptr() + v * layout.nbytes for v in range(world_size)]
        out = []
        for v in range(world_size):
            b = cls.__new__(cls)
            b._init(layout, v, mem[v * layout.nbytes:(v + 1) * layout.nbytes], ptrs, list(range(world_size)),
                    "emulated", handle=None)
            b._world_mem = mem  # keeps the shared allocation alive
            out.append(b)
        return out
