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
  ``"nvshmem"``  torch symmetric memory on its NVSHMEM backend, for groups that span nodes: peer
                 pointers for ranks on this node, 0 for the others, which the sending kernels
                 reach with NVSHMEM puts and signals (``USE_NVSHMEM``, PEs = global ranks) from
                 staging regions of this rank's own allocation. Only those kernels link
                 ``libnvshmem_device.bc`` and get NVSHMEM module init (:meth:`SymmBuffers.nvshmem_meta`).
                 Compiled in CI, never run yet (no multi-node machine).
  ``"local"``    W = 1 without a process group: a plain device allocation.
  ``"emulated"`` W virtual ranks in one process (:meth:`SymmBuffers.emulated`): slices of one
                 allocation, each with its own peer table; tier T4 tests and single-GPU benchmarks.
``"auto"`` picks ``"cuda"`` inside a node and ``"nvshmem"`` for a group that spans nodes.

Failures are reported, never hung on: every wait in the kernels gives up after ``timeout_s``
and records the op and the peer; :meth:`check` raises them, and overflow of the expanded rows.

A buffer set carries the :class:`~tlx_dist.comm.symm.ExchangeConfig` its ops run with (``config``)
and the modes resolved from it at their first use (``modes``, ``policy.py``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..topology import Topology, exchange_ranks_per_node
from .config import ExchangeConfig
from .hier_layout import HierLayout, HierState

__all__ = ["SymmLayout", "SymmBuffers", "ExchangeError", "DEFAULT_TIMEOUT_S", "nvshmem_device_library"]

_ALIGN = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEFAULT_TIMEOUT_S = 30.0
_OPS = {1: "barrier (op start)", 2: "token rows of a dispatch", 3: "combine partial rows",
        4: "gate gradients of combine's backward",
        # the hierarchical exchange's relays (tlx/comm/hier.py OP_RELAY_ROWS / OP_RELAY_PARTIALS)
        6: "node count and inter-node rows of a dispatch (at their relay)",
        7: "node's partial rows of a combine (at the relay)"}


_OP_ROUTE = 5  # a block of the dispatch's route kernel waiting for an earlier block (look-back)


class ExchangeError(RuntimeError):
    """A symmetric-memory wait gave up: the op, this rank and the peer it waited for."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return v


# Receive rows per arrival counter of the row form (RBLK in tlx/comm/exchange.py): the receive-side
# copy moves rows in runs of this many as they land. The same on every rank (it sizes the layout).
RECV_BLOCK = 64
# Source tokens per combine arrival counter (CBLK in tlx/comm/exchange.py): the combine's source side
# sums its tokens in blocks of this many as their partial rows land. The same on every rank.
COMB_BLOCK = 32


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
    off_rblk: int
    nbytes: int
    staging: bool = False
    off_srows: int = 0
    off_smeta: int = 0
    off_sgates: int = 0
    off_scomb: int = 0
    off_sdgate: int = 0
    recv_block: int = 64  # RECV_BLOCK when built
    row_regions: int = 0
    off_rows: int = 0
    off_rcnt: int = 0  # RCNT [row_regions, W] int64: the overlapped row form's rows landed per source
    off_cblk: int = 0  # CBLK [W + 1, comb_blocks] int64: partial rows from rank d landed per source token block
    # (rows 0..W-1), then the block's summed work units (row W)
    comb_block: int = 32  # COMB_BLOCK when built

    @property
    def rows_region_bytes(self) -> int:
        """Bytes of one per-layer receive region (``[W*T_max, D]`` rows; see ``build``)."""
        return _align(self.recv_rows * self.hidden * self.dtype.itemsize)

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
    def recv_blocks(self) -> int:
        """Arrival counters per source (RBLK): one per RECV_BLOCK receive rows of its T_max."""
        return -(-self.max_tokens // self.recv_block)

    @property
    def comb_blocks(self) -> int:
        """Combine arrival counters per rank (CBLK): one per COMB_BLOCK tokens of T_max."""
        return -(-self.max_tokens // self.comb_block)

    @property
    def worst_case_rows(self) -> int:
        """Expanded (expert-major) rows one rank can get: W * T_max * min(K, E/W)."""
        return self.recv_rows * min(self.top_k, self.num_experts // self.world_size)

    @classmethod
    def build(cls, max_tokens: int, hidden: int, top_k: int, num_experts: int, world_size: int,
              dtype: torch.dtype, staging: bool = False, row_regions: int = 0) -> "SymmLayout":
        """``staging``: append the NVSHMEM staging regions (SROWS, SMETA, SGATES, SCOMB, SDGATE of
        ``tlx/comm/exchange.py``; about ``(1 + W) * T_max`` rows more); the other offsets do not move.
        ``row_regions``: append that many per-layer receive regions (ROWS, ``[W*T_max, D]`` each):
        a row-form dispatch into region k leaves its rows there, where the fused GEMMs read them,
        instead of in the shared RECV region and a copy (``SymmDispatcher(row_regions=...)``)."""
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
        if max_tokens * (num_experts // world_size) >= 2**31:  # META's raw slot codes q * e + j (int32)
            raise ValueError(f"max_tokens*num_experts/world_size={max_tokens * (num_experts // world_size)} must be "
                             "< 2**31")
        if world_size * max_tokens * top_k >= 2**31:
            raise ValueError(f"world_size*max_tokens*top_k={world_size * max_tokens * top_k} must be < 2**31")
        W, row = world_size, hidden * dtype.itemsize
        off, offs = 0, {}
        for name, size in (("state", 64), ("flags", 16 * W), ("arrive", 24 * W),
                           ("counts", 16 * W * (num_experts + W)),
                           ("meta", 4 * W * max_tokens * (top_k + 1)),
                           ("gates", dtype.itemsize * W * max_tokens * top_k), ("recv", row * W * max_tokens),
                           ("comb", row * max_tokens * W), ("dgate", 8 * max_tokens * top_k),
                           ("rblk", 8 * W * -(-max_tokens // RECV_BLOCK)),
                           ("cblk", 8 * (W + 1) * -(-max_tokens // COMB_BLOCK))):
            offs[name] = off
            off = _align(off + size)
        if staging:  # sources of NVSHMEM puts (symmetric): token rows, their META/gates, partials, dgates
            for name, size in (("srows", row * max_tokens), ("smeta", 4 * max_tokens * W * (top_k + 1)),
                               ("sgates", dtype.itemsize * max_tokens * top_k), ("scomb", row * W * max_tokens),
                               ("sdgate", 8 * W * max_tokens * top_k)):
                offs[name] = off
                off = _align(off + size)
        st = {f"off_{n}": offs[n] for n in ("srows", "smeta", "sgates", "scomb", "sdgate")} if staging else {}
        if not isinstance(row_regions, int) or isinstance(row_regions, bool) or row_regions < 0:
            raise ValueError(f"row_regions={row_regions!r} must be a non-negative int")
        off_rows = off
        off = off + row_regions * _align(row * W * max_tokens)
        off_rcnt = off  # per region, per source: rows of an overlapped dispatch landed (never zeroed by an op end)
        off = off + _align(8 * W * row_regions)
        return cls(world_size, num_experts, max_tokens, hidden, top_k, dtype,
                   offs["state"], offs["flags"], offs["arrive"], offs["counts"], offs["meta"],
                   offs["gates"], offs["recv"], offs["comb"], offs["dgate"], offs["rblk"], off, staging=staging,
                   recv_block=RECV_BLOCK, row_regions=row_regions, off_rows=off_rows if row_regions else 0,
                   off_rcnt=off_rcnt if row_regions else 0, off_cblk=offs["cblk"], comb_block=COMB_BLOCK, **st)


def _start_protocol(mem: torch.Tensor, layout: SymmLayout) -> None:
    """A zeroed region's protocol start (``tlx/comm/exchange.py``): STATE[0] = 1 (the first op is
    epoch 1) and FLAGS[s] = 1 for every s (every peer is ready for op 1: nothing ran before)."""
    W = layout.world_size
    mem[layout.off_state: layout.off_state + 8].view(torch.int64).fill_(1)
    mem[layout.off_flags: layout.off_flags + 8 * W].view(torch.int64).fill_(1)


ENV_TIMEOUT_S = "TLX_DIST_EXCHANGE_TIMEOUT_S"  # debug: the waits' timeout where no config sets one


def _timeout_s(timeout_s: Optional[float], config: Optional[ExchangeConfig] = None) -> float:
    """The waits' timeout: ``timeout_s``, else ``config.timeout_s``, else ``TLX_DIST_EXCHANGE_TIMEOUT_S``,
    else ``DEFAULT_TIMEOUT_S``; the two arguments may not disagree."""
    if config is not None and config.timeout_s is not None:
        if timeout_s is not None and float(timeout_s) != float(config.timeout_s):
            raise ValueError(f"timeout_s={timeout_s!r} differs from config.timeout_s={config.timeout_s!r}: give one")
        timeout_s = config.timeout_s
    if timeout_s is None:
        env = os.environ.get(ENV_TIMEOUT_S)
        try:
            timeout_s = float(env) if env is not None else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{ENV_TIMEOUT_S}={env!r} must be a number of seconds") from None
        if not 0 < timeout_s < 1e6:
            raise ValueError(f"{ENV_TIMEOUT_S}={env!r} must be a number of seconds in (0, 1e6)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < 1e6):
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds in (0, 1e6)")
    return float(timeout_s)


def _config(config: Optional[ExchangeConfig], timeout: float) -> ExchangeConfig:
    if config is not None and not isinstance(config, ExchangeConfig):
        raise TypeError(f"config must be an ExchangeConfig, got {type(config).__name__}")
    return dataclasses.replace(config if config is not None else ExchangeConfig(), timeout_s=timeout)


class SymmBuffers:
    """Symmetric buffers of one rank of an EP group; build once (:func:`ep_buffers`), share
    across layers and steps.

    Args:
        max_tokens: T_max, the most tokens any rank dispatches in one call.
        hidden: D. top_k: K. num_experts: E. dtype: the rows' dtype.
        group: the EP process group (``None``: one rank, ``backend="local"``).
        backend: ``"auto"`` (cuda inside a node, nvshmem across nodes), ``"cuda"``, ``"nvshmem"``,
            ``"local"``.
        device: CUDA device (default: the current one).
        timeout_s: how long any wait in the exchange kernels spins before it gives up and records
            an error (default ``config.timeout_s``, else ``TLX_DIST_EXCHANGE_TIMEOUT_S``, else 30 s).
        row_regions: per-layer receive regions of the row form (``SymmLayout.build``; default 0).
        config: the :class:`ExchangeConfig` every op on this set runs with (default
            ``ExchangeConfig()``, which the first dispatcher that asks for another may replace;
            given here, every dispatcher must ask for this one: ``policy.adopt``).
    """

    def __init__(self, max_tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                 group=None, *, backend: str = "auto", device=None, timeout_s: Optional[float] = None,
                 row_regions: int = 0, config: Optional[ExchangeConfig] = None):
        import torch.distributed as dist

        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if backend not in ("auto", "cuda", "nvshmem", "local"):
            raise ValueError(f"backend={backend!r} is not one of 'auto', 'cuda', 'nvshmem', 'local'")
        timeout = _timeout_s(timeout_s, config)
        cfg = (_config(config, timeout), config is not None)
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if group is None:
            if backend not in ("auto", "local"):
                raise ValueError(f"backend={backend!r} needs a process group")
            layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world, dtype, row_regions=row_regions)
            mem = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
            _start_protocol(mem, layout)
            self._init(layout, rank, mem, [mem.data_ptr()], [0], "local", None, timeout, cfg)
            return
        topo = Topology.from_group(group)
        if backend == "auto":
            backend = "cuda" if topo.single_node else "nvshmem"
        if backend == "cuda" and not topo.single_node:
            raise ValueError("backend='cuda' reaches only ranks on this node, and the EP group spans nodes: "
                             "use backend='nvshmem' (or 'auto'), or dispatcher='all_to_all'")
        # Every rank of a group that spans nodes has a peer on another node, so every rank of it
        # builds the same layout (staging regions included) from the backend alone.
        # The NVSHMEM route's puts target RECV: no per-layer regions there (every rank of a group
        # spanning nodes takes this route, so the layout stays the same on every rank).
        layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world, dtype,
                                  staging=backend == "nvshmem", row_regions=0 if backend == "nvshmem" else row_regions)
        # the hierarchical exchange (every rank resolves the same from the same config and topology)
        layout, hier = _with_hier(layout, exchange_ranks_per_node(cfg[0].topology, topo.nodes), backend == "nvshmem")
        from torch.distributed import _symmetric_memory as symm_mem

        if backend == "nvshmem":
            _use_nvshmem_backend(symm_mem, device)
        mem = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=device)
        mem.zero_()
        _start_protocol(mem, layout)
        # Every rank's region must be initialised before any rank's first op runs: a peer that
        # returned from the rendezvous may send at once (it finds my FLAGS "ready for op 1").
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(mem, group)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        if backend == "nvshmem":
            # Ranks on other nodes get 0: the kernels reach them with NVSHMEM puts to this rank's own
            # symmetric addresses on PE ``pes[d]`` (torch's NVSHMEM PEs are global ranks).
            ptrs = [p if topo.same_node(d) else 0 for d, p in enumerate(ptrs)]
            ptrs[rank] = mem.data_ptr()
            if any(p == 0 for d, p in enumerate(ptrs) if topo.same_node(d)):
                raise RuntimeError(f"torch symmetric memory (NVSHMEM) gave no peer pointer for a rank on this node "
                                   f"(peers {ptrs}): the GPUs of one node must reach each other (NVLink or P2P)")
        self._init(layout, rank, mem, ptrs, list(topo.global_ranks), backend, handle, timeout, cfg)
        self.nodes = topo.nodes
        self.hier = HierState(hier, device) if hier is not None else None
        handle.barrier(channel=0)  # every rank's region is zeroed before anyone signals into it
        torch.cuda.synchronize(device)

    def _init(self, layout, rank, mem, ptrs, pes, backend, handle, timeout_s, cfg=None):
        cfg = cfg if cfg is not None else (_config(None, timeout_s), False)
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._mem = mem
        self._rows_regions = {}  # per-layer receive region k -> its tensor (rows_region)
        self._handle = handle
        self.device = mem.device
        # The kernels declare every region start 16-byte aligned (tl.multiple_of: rows move as 16-byte
        # vectors); the layout aligns offsets to 256 bytes, so the bases must be aligned too.
        odd = [(d, hex(p)) for d, p in enumerate(ptrs) if p % 16]
        if odd:
            raise RuntimeError(f"symmetric regions must start 16-byte aligned; (rank, base) {odd} do not")
        self.peers = torch.tensor(ptrs, dtype=torch.int64, device=mem.device)
        self.peer_ptrs = [int(p) for p in ptrs]  # the same, on the host (the copy-engine row form's copies)
        self.pes = torch.tensor(pes, dtype=torch.int32, device=mem.device)
        # The NVSHMEM variants of the sending kernels run only when a peer has no pointer.
        self.use_nvshmem = 0 in ptrs
        if self.use_nvshmem and not layout.staging:
            raise ValueError("peers without a pointer need the NVSHMEM staging regions (SymmLayout staging=True)")
        self._nvshmem_lib = None
        self.config, self._config_claimed = cfg  # (claimed: given explicitly, see policy.adopt)
        self.modes = {}  # mode name -> its resolved form (policy.py), each fixed at its first use
        self._side_stream = None  # the overlapped and copy-engine row forms' side stream (launch.on_side)
        self._overlap_plans = {}  # region -> the last overlapped dispatch's RowsOverlap there
        self._ce_sig_stream = None  # the copy-engine combine's signal kernels' stream (ce_transport)
        self.nodes = (0,) * layout.world_size  # the node of each rank (the hierarchy's topology)
        self.hier = None  # the hierarchical exchange's part (HierState), where the topology asks for it

    def nvshmem_meta(self, kernel) -> dict:
        """Extra launch arguments of a kernel that sends to peers (``tlx/comm/exchange.py``): ``{}``
        unless some peer is on another node; then the PE table, the staging offsets this kernel
        takes, ``USE_NVSHMEM=True`` and ``libnvshmem_device`` to link, and the post-compile hook
        that initialises exactly the modules linked with it for NVSHMEM is installed."""
        if not self.use_nvshmem:
            return {}
        names = set(kernel.arg_names)
        if "USE_NVSHMEM" not in names:
            raise TypeError(f"{kernel.fn.__name__} has no USE_NVSHMEM parameter: it does not send to peers")
        L = self.layout
        meta = dict(pes_ptr=self.pes, USE_NVSHMEM=True, OFF_SROWS=L.off_srows, OFF_SMETA=L.off_smeta,
                    OFF_SGATES=L.off_sgates, OFF_SCOMB=L.off_scomb, OFF_SDGATE=L.off_sdgate)
        out = {k: v for k, v in meta.items() if k in names}
        if os.environ.get("TRITON_INTERPRET", "0") == "1":  # tlx/comm/nvshmem.py emulates the calls
            return out
        if self._nvshmem_lib is None:
            cap = torch.cuda.get_device_capability(self.device)
            self._nvshmem_lib = nvshmem_device_library(cap[0] * 10 + cap[1])
        _install_nvshmem_hook()
        out["extern_libs"] = {_NVSHMEM_LIB: self._nvshmem_lib}
        return out

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def reconfigure(self, config: ExchangeConfig) -> None:
        """Runs the ops from now on with ``config`` (its modes resolved again at their next use).
        Between ops, and on every rank of the group alike (benchmarks and tests sweep settings on
        one buffer set this way); CUDA graphs captured before keep what they captured. The
        timeout is fixed when the set is built."""
        if not isinstance(config, ExchangeConfig):
            raise TypeError(f"config must be an ExchangeConfig, got {type(config).__name__}")
        if config.timeout_s is not None and float(config.timeout_s) != self.timeout_s:
            raise ValueError(f"config.timeout_s={config.timeout_s!r}: this buffer set waits {self.timeout_s:g} s "
                             "(fixed when it was built)")
        if config.topology != self.config.topology:
            self.check_topology(config)
        self.config = dataclasses.replace(config, timeout_s=self.timeout_s)
        self._config_claimed = True
        self.modes.clear()

    def check_topology(self, config: ExchangeConfig) -> None:
        """ValueError unless ``config.topology`` gives the exchange this set was built for (its
        regions depend on it: flat, or hierarchical over nodes of L ranks)."""
        want = exchange_ranks_per_node(config.topology, self.nodes) if self.world_size > 1 else 0
        have = self.hier.layout.ranks_per_node if self.hier is not None else 0
        if want != have:
            name = lambda L: f"hierarchical exchange over nodes of {L}" if L else "flat exchange"  # noqa: E731
            raise ValueError(f"topology={config.topology!r} asks for the {name(want)}; this buffer set was built "
                             f"for the {name(have)}: build the buffers with that config")

    # ---- sizing ----
    @staticmethod
    def size_hint(max_tokens: int, hidden: int, top_k: int, num_experts: int, world_size: int,
                  dtype: torch.dtype, row_regions: int = 0) -> int:
        """Bytes of symmetric memory one rank allocates for these sizes."""
        return SymmLayout.build(max_tokens, hidden, top_k, num_experts, world_size, dtype,
                                row_regions=row_regions).nbytes

    # ---- views of the regions (this rank's) ----
    def _region(self, off: int, nbytes: int) -> torch.Tensor:
        self._check_open()
        return self._mem[off: off + nbytes]

    def route_scratch(self, n_blocks: int, row_words: int) -> torch.Tensor:
        """The route kernel's look-back scratch (``tlx/comm/route.py`` ``_route_kernel``): int64
        ``[n_blocks * (1 + 2 * row_words)]``, this rank's own (not symmetric), zeroed once and kept:
        its status words carry the op's epoch, so no later dispatch resets it. One per layout
        (``n_blocks``, ``row_words``): with another route block size (``ExchangeConfig.route_block``)
        the status words would sit where an earlier layout left prefix counts, which a look-back
        would read as "ready"; kept for the buffers' life (a captured graph holds its address)."""
        key = (n_blocks, row_words)
        cache = self.__dict__.setdefault("_route_scratches", {})
        s = cache.get(key)
        if s is None:
            s = cache[key] = torch.zeros(n_blocks * (1 + 2 * row_words), dtype=torch.int64, device=self.device)
        return s

    def recv_rows(self) -> torch.Tensor:
        """``[W*T_max, D]`` view of this rank's receive region: block s holds source s's token rows
        (the first ``rows_from[s]`` of ``T_max`` are valid after a dispatch) for every s but this
        rank, whose own rows never pass through it. Overwritten by the next op: clone what must
        outlive it."""
        L = self.layout
        return self._region(L.off_recv, L.recv_rows * L.hidden * L.dtype.itemsize).view(L.dtype).view(
            L.recv_rows, L.hidden)

    def rows_region(self, k: int) -> torch.Tensor:
        """``[W*T_max, D]`` tensor over this rank's per-layer receive region ``k`` (laid out as
        :meth:`recv_rows`): a row-form dispatch into it leaves its rows there. Each region is its
        own tensor (same storage, its own autograd version counter; each call returns a new view of
        it), and every dispatch into it bumps that counter, so a backward that reads rows saved from an earlier dispatch into the
        same region (a layer's forward run twice before its backward) raises instead of reading
        the newer rows."""
        L = self.layout
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < L.row_regions:
            raise ValueError(f"row region {k!r} is not in [0, {L.row_regions}) (SymmBuffers(row_regions=...))")
        self._check_open()
        t = self._rows_regions.get(k)
        if t is None:
            isz = L.dtype.itemsize
            off = self._mem.storage_offset() + L.off_rows + k * L.rows_region_bytes  # bytes (uint8 storage)
            t = torch.empty(0, dtype=L.dtype, device=self._mem.device).set_(
                self._mem.untyped_storage(), off // isz, (L.recv_rows, L.hidden), (L.hidden, 1))
            self._rows_regions[k] = t
        # a new view per call: the caller's autograd history lives on the view, never on the region
        # (views share the region's version counter)
        return t.view(L.recv_rows, L.hidden)

    def region_counters(self) -> torch.Tensor:
        """``[row_regions, W]`` int64 view of RCNT: row k, column s counts source s's rows of an
        overlapped dispatch into region k landed here and not yet waited for (``rows_wait``)."""
        L = self.layout
        return self._region(L.off_rcnt, 8 * L.world_size * L.row_regions).view(torch.int64).view(
            L.row_regions, L.world_size)

    def comb_block_counters(self) -> torch.Tensor:
        """``[W + 1, comb_blocks]`` int64 view of CBLK: row d counts rank d's combine partial rows
        landed per ``comb_block`` tokens of this rank in the op under way, row W the block's work
        units summed so far (all zeroed when the block's last unit is summed)."""
        L = self.layout
        return self._region(L.off_cblk, 8 * (L.world_size + 1) * L.comb_blocks).view(torch.int64).view(
            L.world_size + 1, L.comb_blocks)

    def recv_block_counters(self) -> torch.Tensor:
        """``[W, recv_blocks]`` int64 view of RBLK: row s counts source s's row-form rows landed per
        ``recv_block`` receive rows in the op under way (zeroed as each block is copied out)."""
        L = self.layout
        return self._region(L.off_rblk, 8 * L.world_size * L.recv_blocks).view(torch.int64).view(
            L.world_size, L.recv_blocks)

    def state(self) -> torch.Tensor:
        """``[3]`` int64: the current op (epoch, from 1), overflow flag, error word (``op << 16 | peer``)."""
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
            if op == _OP_ROUTE:
                raise ExchangeError(
                    f"symmetric exchange: on rank {self.rank} a block of the dispatch's route kernel waited "
                    f"{self.timeout_s:g} s for block {peer} of the same launch (look-back); thread blocks did not "
                    f"make progress in index order on this device. The exchange state is inconsistent; restart.")
            raise ExchangeError(
                f"symmetric exchange: rank {self.rank} waited {self.timeout_s:g} s for the "
                f"{_OPS.get(op, f'op {op}')} from rank {peer}, which never arrived (a rank skipped, "
                f"repeated or died in an op). The exchange state is inconsistent; restart the job. "
                f"(timeout: ExchangeConfig.timeout_s, or {ENV_TIMEOUT_S} where it is None)")
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
        """Releases the memory (collective for the cuda/nvshmem backends: every rank closes)."""
        self._mem = None
        self._rows_regions = None
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
                 dtype: torch.dtype, *, device=None, timeout_s: Optional[float] = None,
                 ranks_per_node: Optional[int] = None, row_regions: int = 0,
                 config: Optional[ExchangeConfig] = None, nvshmem: Optional[bool] = None) -> list["SymmBuffers"]:
        """W virtual ranks in this process: one zeroed allocation of W equal slices, one
        :class:`SymmBuffers` per virtual rank, each with its own peer table. ``device`` may be
        ``"cpu"`` for the Triton interpreter. ``ranks_per_node``: virtual ranks ``v // ranks_per_node``
        form a node. The flat exchange across them (interpreter only): a rank sees the other nodes'
        slices as peer pointers 0 and reaches them through the NVSHMEM route, whose calls
        ``tlx/comm/nvshmem.py`` emulates. The hierarchical one (``config.topology``; ``"auto"``
        with more than one rank a node): the same in the interpreter; on a GPU every rank keeps its
        pointers and the inter-node leg is plain stores (same rows, relays and counters).
        ``nvshmem=False`` (the hierarchical exchange): pointer stores in the interpreter too (the
        one-GPU form, on CPU)."""
        nodes = ranks_per_node is not None and ranks_per_node < world_size
        if ranks_per_node is not None:
            _pos_int("ranks_per_node", ranks_per_node)
        timeout = _timeout_s(timeout_s, config)
        cfg = (_config(config, timeout), config is not None)
        node_of = tuple(v // ranks_per_node if ranks_per_node else 0 for v in range(world_size))
        L_hier = exchange_ranks_per_node(cfg[0].topology, node_of)
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if nodes and device.type != "cpu" and not L_hier:
            raise ValueError(f"ranks_per_node={ranks_per_node} emulates NVSHMEM, which only the Triton interpreter "
                             f"(device='cpu', TRITON_INTERPRET=1) can; on {device} use a real multi-node group, or "
                             "the hierarchical exchange (ExchangeConfig(topology='hierarchical'))")
        if nvshmem is not None and not nvshmem and not L_hier and nodes:
            raise ValueError("nvshmem=False: the flat exchange reaches other nodes only through the NVSHMEM route")
        if nvshmem and device.type != "cpu":
            raise ValueError("nvshmem=True emulates NVSHMEM, which only the Triton interpreter (device='cpu') can")
        far = nodes and device.type == "cpu" and nvshmem is not False  # other nodes by the (emulated) NVSHMEM route
        layout = SymmLayout.build(max_tokens, hidden, top_k, num_experts, world_size, dtype, staging=far,
                                  row_regions=row_regions)
        layout, hier = _with_hier(layout, L_hier, far)
        mem = torch.zeros(world_size * layout.nbytes, dtype=torch.uint8, device=device)
        for v in range(world_size):
            _start_protocol(mem[v * layout.nbytes:(v + 1) * layout.nbytes], layout)
        ptrs = [mem.data_ptr() + v * layout.nbytes for v in range(world_size)]
        if far:
            from tlx.comm.nvshmem import emulate_heaps
            emulate_heaps([(p, layout.nbytes) for p in ptrs])
        out = []
        for v in range(world_size):
            b = cls.__new__(cls)
            seen = [p if not far or node_of[d] == node_of[v] else 0 for d, p in enumerate(ptrs)]
            b._init(layout, v, mem[v * layout.nbytes:(v + 1) * layout.nbytes], seen, list(range(world_size)),
                    "emulated", None, timeout, cfg)
            b._world_mem = mem  # keeps the shared allocation alive
            b.nodes = node_of
            b.hier = HierState(hier, device) if hier is not None else None
            out.append(b)
        return out


def _with_hier(layout: SymmLayout, ranks_per_node: int, staging: bool):
    """``(layout, HierLayout or None)``: with ``ranks_per_node`` > 0 the hierarchical exchange's regions
    follow the flat ones (the flat offsets do not move; ``nbytes`` grows)."""
    if not ranks_per_node:
        return layout, None
    hier = HierLayout.build(layout.nbytes, layout.world_size, layout.max_tokens, layout.top_k, layout.hidden,
                            layout.dtype.itemsize, ranks_per_node, staging)
    return dataclasses.replace(layout, nbytes=hier.nbytes), hier


# ---------------------------------------------------------------- NVSHMEM (peers on other nodes)

_NVSHMEM_LIB = "libnvshmem_device"
_NVSHMEM_STATE = b"nvshmemi_device_state_d"  # the device symbol nvshmemx_cumodule_init fills
_PREV_HOOK = None


def _use_nvshmem_backend(symm_mem, device) -> None:
    if not symm_mem.is_nvshmem_available():
        raise RuntimeError("backend='nvshmem' (an EP group that spans nodes) needs a CUDA build of torch with "
                           "NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available() is False); "
                           "use dispatcher='all_to_all' across nodes")
    if symm_mem.get_backend(device) == "NVSHMEM":  # an earlier SymmBuffers of this process chose it
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as err:  # fixed by the first symmetric allocation of the process
        raise RuntimeError(f"cannot switch torch symmetric memory to its NVSHMEM backend ({err}): build the "
                           f"cross-node buffers before any other symmetric memory of this process") from err


def nvshmem_device_library(capability: int) -> str:
    """Path of NVSHMEM's device bitcode for compute capability ``capability`` (90: sm_90): the
    directory ``NVSHMEM_LIB_DIR``, else the ``nvidia-nvshmem-cu1x`` wheel (or where torch's
    ``NvshmemLibFinder`` looks). Wheels up to 3.6 ship one ``libnvshmem_device.bc``; 3.7 and
    later one ``libnvshmem_device_sm_<cc>.bc`` per architecture."""
    names = (f"libnvshmem_device_sm_{capability}.bc", "libnvshmem_device.bc")
    dirs = []
    if os.environ.get("NVSHMEM_LIB_DIR"):
        dirs.append(os.environ["NVSHMEM_LIB_DIR"])
    try:
        import nvidia.nvshmem as _wheel  # the nvidia-nvshmem-cu1x wheel (a namespace package)
        dirs += [os.path.join(p, "lib") for p in _wheel.__path__]
    except ImportError:
        pass
    dirs += ["/usr/local/lib", "/usr/lib", "/opt/nvidia/nvshmem/lib"]
    for d in dirs:
        for n in names:
            if os.path.isfile(os.path.join(d, n)):
                return os.path.join(d, n)
    try:  # torch's own search (also the RPATH of libtorch_nvshmem.so)
        from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder
        return NvshmemLibFinder.find_device_library()
    except (ImportError, RuntimeError):
        pass
    found = [os.path.basename(f) for d in dirs for f in glob.glob(os.path.join(d, "libnvshmem_device*.bc"))]
    raise RuntimeError(f"NVSHMEM device bitcode for sm_{capability} not found in {dirs} (found {found}): "
                       f"install the nvidia-nvshmem-cu1x wheel that matches torch, or set NVSHMEM_LIB_DIR")


def _cumodule_init(module) -> None:
    from torch._C._distributed_c10d import _nvshmemx_cumodule_init
    _nvshmemx_cumodule_init(module)


def _nvshmem_module_init_hook(*args, **kwargs):
    """Triton post-compile hook: initialises for NVSHMEM exactly the CUDA modules that were compiled
    with ``libnvshmem_device`` and hold NVSHMEM's device state (the USE_NVSHMEM kernel variants;
    torch's ``requires_nvshmem`` kernels too). A module without NVSHMEM code is never initialised
    (``nvshmemx_cumodule_init`` fails on it); compiles without the library go to the hook that was
    installed before."""
    comp = kwargs["compile"]
    if _NVSHMEM_LIB not in dict(comp.get("extern_libs") or ()):
        return _PREV_HOOK(*args, **kwargs) if _PREV_HOOK is not None else None
    jit = kwargs["fn"].jit_function
    kernel = jit.device_caches[comp["device"]][0].get(kwargs["key"])
    if kernel is None:
        raise RuntimeError(f"Triton compiled {jit.fn.__name__} but has no kernel for it: cannot initialise "
                           f"its module for NVSHMEM")
    if _NVSHMEM_STATE in kernel.asm["cubin"]:
        kernel.run  # noqa: B018 -- loads the module (Triton loads lazily)
        _cumodule_init(kernel.module)
    return None


def _install_nvshmem_hook() -> None:
    """Makes :func:`_nvshmem_module_init_hook` Triton's post-compile hook (chaining whatever hook
    was there, e.g. torch's ``requires_nvshmem`` one); again before every NVSHMEM launch, in case
    another library replaced it since."""
    global _PREV_HOOK
    import triton

    cur = triton.knobs.runtime.jit_post_compile_hook
    if cur is not _nvshmem_module_init_hook:
        _PREV_HOOK = cur
        triton.knobs.runtime.jit_post_compile_hook = _nvshmem_module_init_hook
