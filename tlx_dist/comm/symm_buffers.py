"""Symmetric buffers for one expert-parallel group: allocation, peer table, sizing, checks.

Legend: T_max max tokens per rank, D hidden, K top-k, E experts, W ranks, e = E/W.

One allocation per rank, the same byte layout on every rank (the regions are listed in
``tlx/comm/exchange.py``). Sized by what can arrive once token rows are deduplicated: at most
``W * T_max`` token rows (a token crosses to a rank once), ``T_max * W`` combine partial rows and
``T_max * K`` gate gradients -- nothing proportional to K x the rows. The expert-major rows the
grouped GEMMs read are ordinary tensors of the dispatcher (see ``SymmDispatcher``'s capacity).

Build one set per EP group with :func:`tlx_dist.comm.ep_buffers` and share it across every layer
and step: ops on it are stream-ordered and each one opens with a barrier.

Backends:
  ``"cuda"``     torch symmetric memory (CUDA backend): peer pointers over NVLink, one node.
  ``"local"``    W = 1 without a process group: a plain device allocation.
  ``"emulated"`` W virtual ranks in one process (:meth:`SymmBuffers.emulated`): slices of one
                 allocation, each with its own peer table; tier T4 tests and single-GPU benchmarks.
Groups that span nodes are refused here (``make_dispatcher("auto")`` uses the all-to-all path
for them): the NVSHMEM route is being rebuilt for the deduplicated exchange.

Failures are reported, never hung on: every wait in the kernels gives up after ``timeout_s``
and records the op and the peer; :meth:`check` raises them, and overflow of the expanded rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .topology import Topology

__all__ = ["SymmLayout", "SymmBuffers", "ExchangeError", "DEFAULT_TIMEOUT_S"]

_ALIGN = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEFAULT_TIMEOUT_S = 30.0
_OPS = {1: "barrier (op start)", 2: "token rows of a dispatch", 3: "combine partial rows",
        4: "gate gradients of combine's backward"}


class ExchangeError(RuntimeError):
    """A symmetric-memory wait gave up: the op, this rank and the peer it waited for."""


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
    off_state: int
    off_flags: int
    off_arrive: int
    off_counts: int
    off_meta: int
    off_gates: int
    off_recv: int
    off_comb: int
    off_dgate: int
    nbytes: int

    @property
    def recv_rows(self) -> int:
        """R = W * T_max token rows: the most a rank can receive once rows are deduplicated."""
        return self.world_size * self.max_tokens

    @property
    def meta_words(self) -> int:
        return self.top_k + 1

    @property
    def num_counts(self) -> int:
        return self.num_experts + self.world_size

    @property
    def worst_case_rows(self) -> int:
        """Expanded (expert-major) rows one rank can get: W * T_max * min(K, E/W)."""
        return self.recv_rows * min(self.top_k, self.num_experts // self.world_size)

    @classmethod
    def build(cls, max_tokens: int, hidden: int, top_k: int, num_experts: int, world_size: int,
              dtype: torch.dtype) -> "SymmLayout":
        _pos_int("max_tokens", max_tokens)
        _pos_int("hidden", hidden)
        _pos_int("top_k", top_k)
        _pos_int("num_experts", num_experts)
        _pos_int("world_size", world_size)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise TypeError(f"dtype={dtype!r} must be one of {_DTYPES}")
        if num_experts % world_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size}")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} is larger than num_experts={num_experts}")
        if world_size * max_tokens * top_k >= 2**31:
            raise ValueError(f"world_size*max_tokens*top_k={world_size * max_tokens * top_k} must be < 2**31")
        W, row = world_size, hidden * dtype.itemsize
        off, offs = 0, {}
        for name, size in (("state", 64), ("flags", 8 * W), ("arrive", 24 * W),
                           ("counts", 16 * W * (num_experts + W)),
                           ("meta", 4 * W * max_tokens * (top_k + 1)),
                           ("gates", dtype.itemsize * W * max_tokens * top_k), ("recv", row * W * max_tokens),
                           ("comb", row * max_tokens * W), ("dgate", 8 * max_tokens * top_k)):
            offs[name] = off
            off = _align(off + size)
        return cls(world_size, num_experts, max_tokens, hidden, top_k, dtype,
                   offs["state"], offs["flags"], offs["arrive"], offs["counts"], offs["meta"],
                   offs["gates"], offs["recv"], offs["comb"], offs["dgate"], off)


def _timeout_s(timeout_s: Optional[float]) -> float:
    if timeout_s is None:
        timeout_s = float(os.environ.get("TLX_DIST_EXCHANGE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < 1e6):
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds in (0, 1e6)")
    return float(timeout_s)


class SymmBuffers:
    """Symmetric buffers of one rank of an EP group; build once (:func:`ep_buffers`), share
    across layers and steps.

    Args:
        max_tokens: T_max, the most tokens any rank dispatches in one call.
        hidden: D. top_k: K. num_experts: E. dtype: the rows' dtype.
        group: the EP process group (``None``: one rank, ``backend="local"``).
        backend: ``"auto"`` (cuda: one node), ``"cuda"``, ``"local"``.
        device: CUDA device (default: the current one).
        timeout_s: how long any wait in the exchange kernels spins before it gives up and records
            an error (default 30 s, or ``TLX_DIST_EXCHANGE_TIMEOUT_S``).
    """

    def __init__(self, max_tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                 group=None, *, backend: str = "auto", device=None, timeout_s: Optional[float] = None):
        import torch.distributed as dist

        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world, dtype)
        timeout = _timeout_s(timeout_s)
        if backend not in ("auto", "cuda", "local"):
            raise ValueError(f"backend={backend!r} is not one of 'auto', 'cuda', 'local'")
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if group is None:
            if backend not in ("auto", "local"):
                raise ValueError(f"backend={backend!r} needs a process group")
            mem = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
            self._init(layout, rank, mem, [mem.data_ptr()], "local", None, timeout)
            return
        topo = Topology.from_group(group)
        if not topo.single_node:
            raise ValueError("the EP group spans nodes: symmetric-memory peer pointers reach only this node "
                             "(use dispatcher='all_to_all' across nodes; the NVSHMEM route is not available yet)")
        from torch.distributed import _symmetric_memory as symm_mem

        mem = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=device)
        mem.zero_()
        handle = symm_mem.rendezvous(mem, group)
        self._init(layout, rank, mem, [int(p) for p in handle.buffer_ptrs], "cuda", handle, timeout)
        handle.barrier(channel=0)  # every rank's region is zeroed before anyone signals into it
        torch.cuda.synchronize(device)

    def _init(self, layout, rank, mem, ptrs, backend, handle, timeout_s):
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._mem = mem
        self._handle = handle
        self.device = mem.device
        self.peers = torch.tensor(ptrs, dtype=torch.int64, device=mem.device)

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    # ---- sizing ----
    @staticmethod
    def size_hint(max_tokens: int, hidden: int, top_k: int, num_experts: int, world_size: int,
                  dtype: torch.dtype) -> int:
        """Bytes of symmetric memory one rank allocates for these sizes."""
        return SymmLayout.build(max_tokens, hidden, top_k, num_experts, world_size, dtype).nbytes

    # ---- views of the regions (this rank's) ----
    def _region(self, off: int, nbytes: int) -> torch.Tensor:
        self._check_open()
        return self._mem[off: off + nbytes]

    def state(self) -> torch.Tensor:
        """``[3]`` int64: ops started (epoch), overflow flag, error word (``op << 16 | peer``)."""
        return self._region(self.layout.off_state, 24).view(torch.int64)

    # ---- checks ----
    def check(self, capacity_hint: str = "the dispatcher's capacity") -> None:
        """Raises :class:`ExchangeError` if a wait gave up (naming the op, this rank and the peer),
        or RuntimeError if expanded rows overflowed a capacity since the last check. Syncs with
        the host: call it at a logging step, not per layer. ``capacity_hint`` names the setting
        to raise in the overflow message (e.g. a training-config key)."""
        st = self.state()
        overflow, err = (int(v) for v in st[1:3].tolist())
        if err:
            op, peer = err >> 16, err & 0xFFFF
            raise ExchangeError(
                f"symmetric exchange: rank {self.rank} waited {self.timeout_s:g} s for the "
                f"{_OPS.get(op, f'op {op}')} from rank {peer}, which never arrived (a rank skipped, "
                f"repeated or died in an op). The exchange state is inconsistent; restart the job. "
                f"(timeout: TLX_DIST_EXCHANGE_TIMEOUT_S / timeout_s)")
        if overflow:
            st[1].zero_()
            raise RuntimeError(
                f"symmetric dispatch on rank {self.rank} received more expert rows than {capacity_hint} "
                f"allows: the extra rows were not computed (their outputs count as zero). Raise "
                f"{capacity_hint} (worst case {self.layout.worst_case_rows} rows = W*T_max*min(K, E/W)), "
                f"or use capacity='exact'.")

    # ---- lifetime ----
    def _check_open(self) -> None:
        if self._mem is None:
            raise RuntimeError("SymmBuffers is closed")

    @property
    def closed(self) -> bool:
        return self._mem is None

    def close(self) -> None:
        """Releases the memory (collective for the cuda backend: every rank closes)."""
        self._mem = None
        self._handle = None
        self.peers = None

    def __repr__(self) -> str:
        L = self.layout
        return (f"SymmBuffers(rank={self.rank}/{self.world_size}, backend={self.backend}, T_max={L.max_tokens}, "
                f"D={L.hidden}, K={L.top_k}, E={L.num_experts}, dtype={L.dtype}, bytes={L.nbytes}, "
                f"timeout_s={self.timeout_s:g})")

    # ---- emulated world ----
    @classmethod
    def emulated(cls, world_size: int, max_tokens: int, hidden: int, top_k: int, num_experts: int,
                 dtype: torch.dtype, *, device=None, timeout_s: Optional[float] = None) -> list["SymmBuffers"]:
        """W virtual ranks in this process: one zeroed allocation of W equal slices, one
        :class:`SymmBuffers` per virtual rank, each with its own peer table. ``device`` may be
        ``"cpu"`` for the Triton interpreter."""
        layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world_size, dtype)
        timeout = _timeout_s(timeout_s)
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        mem = torch.zeros(world_size * layout.nbytes, dtype=torch.uint8, device=device)
        ptrs = [mem.data_ptr() + v * layout.nbytes for v in range(world_size)]
        out = []
        for v in range(world_size):
            b = cls.__new__(cls)
            b._init(layout, v, mem[v * layout.nbytes:(v + 1) * layout.nbytes], ptrs, "emulated", None, timeout)
            b._world_mem = mem  # keeps the shared allocation alive
            out.append(b)
        return out
