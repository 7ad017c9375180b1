"""Expert-parallel dispatch/combine over symmetric memory: deduplicated token rows, peer stores,
device-side signals and bounded waits.

Legend: T tokens on this rank, D hidden, K top-k, E experts, W ranks, e = E/W, R = W * T_max
receive rows, N expanded (expert-major) rows of this rank.

    x_exp_ND, handle = dispatcher.dispatch(x_TD, idx_TK, gate_TK)
    y_exp_ND         = experts(x_exp_ND, handle.offsets_e)          # grouped GEMMs
    out_TD           = dispatcher.combine_weighted(y_exp_ND, handle, gate_TK)

**Dispatch.** A token row crosses to a destination rank once, however many of that rank's experts
it picked: row ``send_row_TW[t, d]`` of the source's block ``[s*T_max, (s+1)*T_max)`` of rank d's
receive buffer, with metadata (the expanded row of each k-slot that lives on d, the K gates, the
token id). The receiver expands the rows into the expert-major layout of :mod:`layout` (the same
rows, in the same order, as :class:`AllToAllDispatcher` and :class:`LocalDispatcher` produce).
**Combine.** The owning rank sums, per received token, ``gate * y`` over its own slots (products in
the activation dtype, as the per-token reference does, accumulated in fp32, rounded once) and sends
one row back per (token, rank); the source adds the partial sums of the ranks it sent t to (fp32,
one rounding). Backward mirrors both: combine's backward dispatches ``dout`` rows once per rank and
returns gate-scaled expert-row gradients plus the gate gradients ``<dout[t], y[t, k]>`` (computed
where ``y`` lives, sent back per slot); dispatch's backward is an ungated combine.

**Expanded rows** (``capacity``): ``"exact"`` reads this rank's row count on the host once per
dispatch (one sync, as the all-to-all path does) and allocates exactly; ``"worst"`` allocates the
worst case ``W*T_max*min(K, E/W)``; a float f allocates ``ceil(f*T_max*K)`` rows (f = 1 is a
perfectly balanced load) and a positive int that many rows -- static shapes, no host sync, CUDA-graph
capturable; rows past it are not computed, raise the device overflow flag and :meth:`check` raises.

No other host sync and no data-dependent shape: counts travel through the symmetric COUNTS region,
the layout is computed on the GPU, and signals use device-side epochs and counters, so a captured
CUDA graph replays correctly. Each op is a sequence of *phases* (Python generators that yield
between kernel launches, ``tlx/comm/exchange.py`` lists them): a real rank runs its generator
straight through; the emulated world (``emulated.py``) advances W ranks' generators in lockstep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Generator, Optional, Union

import torch
import torch.distributed as dist

from . import copy_engine
from .dispatcher import DispatchHandle, Dispatcher, check_dispatch_args
from .symm_buffers import SymmBuffers

__all__ = ["SymmDispatcher", "SymmHandle", "RowsOverlap", "ep_buffers", "expanded_rows", "dispatch_steps", "combine_steps",
           "dispatch_grad_steps", "combine_grad_steps", "combine_rows_steps", "combine_rows_grad_steps",
           "dispatch_rows_grad_steps", "run_steps"]

Capacity = Union[str, float, int]


@dataclass(frozen=True)
class SymmHandle(DispatchHandle):
    """What combine and the backward need. ``num_recv_rows`` is N (expanded rows).

    send_row_TW: ``[T, W]`` int32 row of token t within this rank's block on rank d (-1: not sent).
    rows_to_W: ``[W]`` int64 token rows sent to each rank. rows_from_W: ``[W]`` int64 received from each.
    pos_RK: ``[R, K]`` int32 expanded row of received row n's slot k (-1: that expert is elsewhere,
        or row n is empty); row n came from source ``n // T_max``.
    gate_RK: ``[R, K]`` gates of the received rows (activation dtype). tok_R: ``[R]`` int32 their source token ids.
    src_map_N: ``[N]`` int32 ``n*K + k`` of each expanded row (the gather index of a fused GEMM;
        undefined past ``offsets_e[-1]``).
    gate_TK: the gates given to dispatch (combine must get the same tensor).
    ``order_S`` / ``inverse_S`` are None: no slot sort happens (the layout kernels rank slots in place).
    """

    send_row_TW: torch.Tensor
    rows_to_W: torch.Tensor
    rows_from_W: torch.Tensor
    pos_RK: torch.Tensor
    gate_RK: torch.Tensor
    tok_R: torch.Tensor
    src_map_N: torch.Tensor
    gate_TK: Optional[torch.Tensor]
    buffers: SymmBuffers
    overlap: Optional["RowsOverlap"] = None
    dense: bool = False  # the copy-engine row form's dense layout (``_ce_mode``): receive row of token t = t


ENV_OVERLAP_SMS = "TLX_DIST_EP_OVERLAP_SMS"
# SMs the overlapped dispatch's row send keeps while the gate/up GEMM computes this rank's own rows
# on the others (the send's programs; the GEMM's first launch takes the rest).
OVERLAP_SMS = 32


def overlap_sms() -> int:
    """The SM budget of the overlapped send (``TLX_DIST_EP_OVERLAP_SMS``, default ``OVERLAP_SMS``)."""
    v = os.environ.get(ENV_OVERLAP_SMS)
    if v is None:
        return OVERLAP_SMS
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_OVERLAP_SMS}={v!r} must be a positive integer (SMs of the overlapped send)")
    return n


class RowsOverlap:
    """The receive plan of an overlapped row-form dispatch (``SymmDispatcher(overlap=True)``): the
    op ended once every peer's META and gates landed; the peers' token rows are still on their way
    into this rank's receive region, sent by a kernel on a side stream of each rank.

    ``offsets_V``: ``[3e]`` int32, each local expert's expert-major rows as three runs (sources
    before this rank | this rank's own rows, already present | sources after), cumulative ends:
    what the gate/up GEMM's first launch computes while the rows land
    (:func:`tlx_dist.fused.fused_experts_rows` ``overlap=``). ``side_sms``: the send's SM budget.
    :meth:`wait` enqueues the arrival wait (one program; bounded, an unarrived peer is reported by
    ``check()`` like every exchange wait) on the current stream; :meth:`finish` (the combine calls
    it) waits if nobody did and joins the side stream into the current one."""

    def __init__(self, handle: "SymmHandle", region: int, offsets_V: torch.Tensor, side_sms: int,
                 side_done: Optional[torch.cuda.Event]):
        bufs = handle.buffers
        self.buffers, self.region, self.rows_from_W = bufs, region, handle.rows_from_W
        self.offsets_V, self.side_sms, self.side_done = offsets_V, side_sms, side_done
        self.offsets_e = handle.offsets_e
        # What the combine's first kernel reads (send_partials): the handle without the caller's
        # gates (gate_TK carries the router's autograd graph: held here, and by the buffers until the
        # next dispatch into this region, it would keep that step's AccumulateGrad nodes, made on
        # another stream, alive into a later CUDA-graph capture, whose backward then fails) and
        # without the plan itself.
        self._handle = dataclasses.replace(handle, gate_TK=None, overlap=None)
        self.waited = False
        self.joined = False
        L = bufs.layout
        # the receive rows of this rank's own tokens (their partial rows never cross a link)
        self.own_rows = (bufs.rank * L.max_tokens, (bufs.rank + 1) * L.max_tokens)
        # data_ptr of the part_RD whose peers' rows went home early (send_partials); not the tensor,
        # which carries the autograd graph (held here, it would keep the graph's AccumulateGrad nodes,
        # and their streams, alive into the next step: a CUDA-graph capture then fails)
        self.partials_sent: Optional[int] = None

    def wait(self) -> None:
        if self.waited:
            return
        self.waited = True
        _rows_wait(self.buffers, self.region, self.rows_from_W)

    def check_rows(self, src_N, dst_N, offsets_E, num_dst: int, num_local: int) -> None:
        """What the overlapped forward assumes of the call it serves (checked before it launches
        anything): the row form of this dispatch -- each row's destination its receive row
        (``dst_N`` is ``src_N``), one output row per receive row, this dispatch's ``offsets_e``."""
        L = self.buffers.layout
        if dst_N is not src_N and (dst_N.data_ptr() != src_N.data_ptr() or dst_N.shape != src_N.shape):
            raise ValueError("an overlapped dispatch's rows go back to their receive rows: dst_N must be src_N")
        if num_dst != L.recv_rows:
            raise ValueError(f"num_dst={num_dst}: an overlapped dispatch's output has one row per receive row "
                             f"({L.recv_rows} = W*T_max)")
        if offsets_E.data_ptr() != self.offsets_e.data_ptr():
            raise ValueError("offsets_E must be this dispatch's handle.offsets_e (the overlap's runs cut them)")
        if num_local * 3 != self.offsets_V.shape[0]:
            raise ValueError(f"the weights hold {num_local} experts, the dispatch {self.offsets_V.shape[0] // 3}")

    def send_partials(self, part_RD: torch.Tensor) -> None:
        """The combine's first kernel (``_reduce_send``, row form) launched early: the peers'
        partial rows of ``part_RD`` are final (the down GEMM's peer runs are done), this rank's own
        are still being computed on the current stream. Real ranks: on the side stream, after what
        the current stream enqueued, ``side_sms`` programs; the combine (``combine_rows``, with this
        same ``part_RD``) then only joins and receives. The emulated world: in line."""
        if self.partials_sent is not None:
            raise RuntimeError("send_partials: this dispatch's partial rows were already sent")
        self.wait()
        bufs = self.buffers
        if self._handle.dense:  # copy-engine row form: the partial rows go by copy engines
            self.join()  # (the dispatch's copies) then: ready, and the copies on the side streams
            _ce_ready(bufs)
            done = _ce_send_partials(bufs, part_RD, self._handle)
        else:
            done = _on_side(bufs, lambda: _reduce_send(bufs, part_RD, self._handle, gated=False, rows=True,
                                                       programs=self.side_sms), part_RD)
        if done is not None:
            self.side_done = done
        self.partials_sent = part_RD.data_ptr()

    def join(self) -> None:
        """The current stream waits for what the side stream did so far (the rows' send)."""
        if self.side_done is not None:
            torch.cuda.current_stream(self.buffers.device).wait_event(self.side_done)

    def finish(self) -> None:
        self.wait()
        if not self.joined:
            self.joined = True
            self.join()


def _rcnt_off(L, region: int) -> int:
    return L.off_rcnt + region * L.world_size * 8


def _on_side(bufs: SymmBuffers, launch, *keep: torch.Tensor) -> Optional[torch.cuda.Event]:
    """Runs ``launch()`` after what the current stream has enqueued. Real ranks: on the buffers'
    side stream (``keep``: the tensors it reads, kept for the caching allocator until it is done);
    returns the event that :meth:`RowsOverlap.finish` joins. The emulated world and the
    interpreter, whose ranks run one after another: in line, None."""
    if bufs.device.type != "cuda" or bufs.backend in ("emulated", "local"):
        launch()
        return None
    if bufs._side_stream is None:
        bufs._side_stream = torch.cuda.Stream(device=bufs.device)
    side = bufs._side_stream
    side.wait_stream(torch.cuda.current_stream(bufs.device))
    with torch.cuda.stream(side):
        launch()
        done = torch.cuda.Event()
        done.record(side)
    for t in keep:
        t.record_stream(side)
    return done


def check_capacity(capacity: Capacity) -> Capacity:
    if isinstance(capacity, str):
        if capacity not in ("exact", "worst"):
            raise ValueError(f"capacity={capacity!r} must be 'exact', 'worst', a float factor > 0 or a positive int")
    elif isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not (0 < capacity < math.inf):
        raise ValueError(f"capacity={capacity!r} must be 'exact', 'worst', a float factor > 0 or a positive int")
    return capacity


def expanded_rows(capacity: Capacity, bufs: SymmBuffers) -> Optional[int]:
    """Static expanded rows for ``capacity`` (None for ``"exact"``)."""
    L = bufs.layout
    if capacity == "exact":
        return None
    if capacity == "worst":
        return L.worst_case_rows
    if isinstance(capacity, float):
        return max(1, min(L.worst_case_rows, math.ceil(capacity * L.max_tokens * L.top_k)))
    return capacity


# ---------------------------------------------------------------- launch helpers

@functools.lru_cache(maxsize=None)
def _num_programs(device_str: str, per_sm: int = 4) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM on CUDA."""
    if device_str.startswith("cuda"):
        return per_sm * torch.cuda.get_device_properties(torch.device(device_str)).multi_processor_count
    return 2  # Triton interpreter: a couple of programs still exercises the persistent loops


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _clock() -> int:
    """CLOCK constexpr of the waiting kernels (``tlx/comm/exchange.py``): poll count in the
    interpreter, %globaltimer on NVIDIA, s_memrealtime on AMD."""
    if _interpreting():
        return 0
    return 2 if torch.version.hip else 1


def _kernels(device: torch.device):
    """``tlx/comm/exchange.py`` (imported on first use). Triton fixes compiled vs interpreted when
    the kernels are decorated, from ``TRITON_INTERPRET``: CPU tensors need it set, CUDA ones unset."""
    if (device.type == "cpu") != _interpreting():
        raise ValueError(f"symmetric dispatch on {device.type} tensors needs TRITON_INTERPRET="
                         f"{'1' if device.type == 'cpu' else '0'} (it is {os.environ.get('TRITON_INTERPRET')!r})")
    from tlx.comm import exchange
    return exchange


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_WIDE_BELOW_BLOCKS = 256  # fewer row blocks than this (about 2 per H200 SM): wider, shorter tiles
_WIDEST = 2048


def _tiles(D: int, rows: Optional[int] = None, cols: int = 512) -> tuple[int, int]:
    """(BLOCK rows, BLOCK_D columns) of the row-moving kernels: ~4K-element tiles, 8 x 512 at the
    usual widths. Given the ``rows`` a launch walks, tiles get wider and shorter (up to 2 x 2048)
    while that leaves fewer than ``_WIDE_BELOW_BLOCKS`` row blocks: each program walks a row's
    column chunks one after another (load, then store to a peer), so at T = 128 rows and D = 7168 a
    8 x 512 tile gave 16 programs with 28 dependent copies each, and 2 x 2048 gives 64 with 8.
    ``cols``: the starting width (the send kernel starts at 1024, see ``_DEFAULT_SHAPES``)."""
    bd = min(cols, _next_pow2(D))
    br = max(1, 4096 // bd)
    if rows is not None:
        while br > 2 and bd < min(_WIDEST, _next_pow2(D)) and -(-rows // br) < _WIDE_BELOW_BLOCKS:
            bd, br = 2 * bd, br // 2
    return br, bd


def _grid(n_blocks: int, dev: torch.device, per_sm: int = 4) -> tuple[int]:
    return (max(1, min(n_blocks, _num_programs(str(dev), per_sm))),)


# Launch shapes of the row-moving kernels, for tuning sweeps (``bench/exchange_tiles.py``): kernel
# name ("send", "expand", "reduce_send", "reduce_recv") -> dict with any of BLOCK_ROWS, BLOCK_D
# (powers of two), num_warps, per_sm (programs per SM); "route" -> {"BLOCK_ROWS": tokens per route
# block}. Empty: the defaults
# (``_DEFAULT_SHAPES``, 4 warps). Every rank must set the same; set it between ops, not inside one.
LAUNCH_OVERRIDES: dict = {}


# Defaults per kernel (starting tile width, programs per SM), from the session-11 sweep on two H200s
# (bench/exchange_tiles.py, D=7168, graph-replayed, ranks aligned; bench/RESULTS.md): the send
# with 4 x 1024 tiles took 228.5 / 730.4 us at T=4096 / 16384 against 244.5 / 747.5 with 8 x 512;
# the reductions with 16 programs (64 warps) per SM combined in 230.1 / 876.9 against 247.3 / 931.7
# with 4. Small ops still widen their tiles (``_tiles``), so T=128 launches are unchanged.
_DEFAULT_SHAPES = {"send": (1024, 4), "reduce_send": (512, 16), "reduce_recv": (512, 16), "expand": (512, 4)}


def _shape(kind: str, D: int, rows: int, dev: torch.device) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK rows, BLOCK_D, num_warps, grid) of one launch of a row-moving kernel over ``rows``:
    ``_DEFAULT_SHAPES`` unless ``LAUNCH_OVERRIDES`` names the kernel."""
    cols, per_sm = _DEFAULT_SHAPES[kind]
    br, bd = _tiles(D, rows, cols)
    o = LAUNCH_OVERRIDES.get(kind) or {}
    br, bd = o.get("BLOCK_ROWS", br), o.get("BLOCK_D", bd)
    return br, bd, o.get("num_warps", 4), _grid(-(-rows // br), dev, o.get("per_sm", per_sm))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of sums over k, ranks and D: fp32 (fp64 for fp64 rows)."""
    return torch.promote_types(dtype, torch.float32)


def _send_launch(bufs: SymmBuffers, kernel, grid, *args, sends: bool = True, **meta) -> None:
    """Launches a kernel that may send to peers (``sends``: this launch does); when some peer is on
    another node, its USE_NVSHMEM variant, linked with NVSHMEM's device library (``nvshmem_meta``)."""
    kernel[grid](*args, **meta, **(bufs.nvshmem_meta(kernel) if sends else {}))


def _common(bufs: SymmBuffers) -> dict:
    import triton.language as tl
    L = bufs.layout
    return dict(W=L.world_size, OFF_STATE=L.off_state, OFF_ARRIVE=L.off_arrive, TIMEOUT_NS=bufs.timeout_ns,
                CLOCK=_clock(), ACC=tl.float64 if L.dtype == torch.float64 else tl.float32)


def _await_meta(bufs: SymmBuffers) -> dict:
    """Constexprs of a kernel that starts with ``_await`` (BARRIER=True): an op's first data kernel."""
    L = bufs.layout
    return dict(BARRIER=True, OFF_STATE=L.off_state, OFF_FLAGS=L.off_flags, TIMEOUT_NS=bufs.timeout_ns,
                CLOCK=_clock())


def _end_meta(bufs: SymmBuffers) -> dict:
    """Constexprs of an op's last kernel (END=True): its last CTA raises this rank's readiness for
    the next op (``_end_op``), which the next op's first kernel waits for on every peer."""
    L = bufs.layout
    return dict(END=True, WP3=_next_pow2(3 * L.world_size), OFF_FLAGS=L.off_flags)


def _route(bufs: SymmBuffers, idx_TK: torch.Tensor, dense: bool = False):
    """Source-side layout and the dispatch's signal in one launch (``_route_kernel``, a single-pass
    scan over token blocks): returns ``q_TK`` (rank of each slot among this rank's slots of its
    expert), ``send_row_TW``, ``counts_C`` = ``[slots per expert | token rows per rank]`` (int64)."""
    L, k = bufs.layout, _kernels(bufs.device)
    T, K = idx_TK.shape
    W, E, NC = L.world_size, L.num_experts, L.num_counts
    dev = idx_TK.device
    EP, KP, WP = _next_pow2(E), _next_pow2(K), _next_pow2(W)
    # ~1024 slots a block (sorted in the kernel), whatever E; no more tokens than the buffers take.
    # Small ops (T <= ROUTE_SMALL_T) take 32-token blocks: four programs instead of one at T=128, whose
    # dispatch went 48.6 -> 36.0 us on two H200s (x2_s20, graph-replayed, D=7168, E=64, K=8); at
    # T = 4096 and 16384 the block size moved nothing beyond the noise (0.98-1.03x).
    bt = _ROUTE_BLOCK_T or (LAUNCH_OVERRIDES.get("route") or {}).get("BLOCK_ROWS") \
        or (min(32, _next_pow2(L.max_tokens)) if T <= ROUTE_SMALL_T
            else max(1, min(1024 // KP, _next_pow2(L.max_tokens))))
    nb = max(1, -(-T // bt))
    nb_max = max(1, -(-L.max_tokens // bt))
    idx = idx_TK if idx_TK.is_contiguous() else idx_TK.contiguous()
    q_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    dest_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    send_row_TW = torch.empty(T, W, dtype=torch.int32, device=dev)
    counts_C = torch.empty(NC, dtype=torch.int64, device=dev)  # the last block writes all NC (zeros for T = 0)
    _send_launch(bufs, k._route_kernel, (nb,), idx, bufs.route_scratch(nb_max, EP + WP), q_TK, dest_TK, send_row_TW,
                 counts_C, T, nb_max, bufs.peers, bufs.rank, K=K, KP=KP, E=E, EP=EP, W=W, WP=WP, E_LOCAL=E // W,
                 NC=NC, NCP=_next_pow2(NC), BLOCK_T=bt, OFF_STATE=L.off_state,
                 OFF_FLAGS=L.off_flags, OFF_COUNTS=L.off_counts,
                 TIMEOUT_NS=bufs.timeout_ns, CLOCK=_clock(), **({"AGG_ONLY": True} if _ROUTE_AGG_ONLY else {}),
                 **({"DENSE": True} if dense else {}))
    return q_TK, send_row_TW, counts_C


ROUTE_SMALL_T = 1024  # tokens up to which the route kernel takes 32-token blocks
_ROUTE_AGG_ONLY = False  # tests: force the route kernel's look-back through every aggregate
_ROUTE_BLOCK_T = 0  # tests: tokens per route block (a power of two; 0 = automatic) to span many blocks


ENV_RECV_OVERLAP = "TLX_DIST_RECV_OVERLAP"
# The overlapped receive copy pays off from this many tokens per rank (the buffers' T_max) up.
# Two H200s, D=7168, E=64, K=8, graph-replayed dispatch (bench/RESULTS.md, session 10): T=4096
# 274 -> 310 us (the receiving programs slow the senders more than the copy they hide), T=16384
# 862 -> 758 us (272 -> 309 GB/s).
RECV_OVERLAP_MIN_TOKENS = 8192


def _recv_mode(bufs: SymmBuffers) -> str:
    """Where the row form copies the other sources' rows out of RECV (``tlx/comm/exchange.py``):
    ``"overlap"`` (real ranks over peer pointers with T_max >= ``RECV_OVERLAP_MIN_TOKENS``: extra
    programs of the send kernel, block by block as rows land), ``"blocks"`` (the emulated world,
    whose ranks launch one after another, and one rank: the same block-by-block copy, in the expand
    kernel) or ``"after"`` (the NVSHMEM route, and smaller real-rank buffers: the expand kernel,
    after the op's rows all arrived). ``TLX_DIST_RECV_OVERLAP=1`` / ``0`` forces overlap on / off
    for real ranks over peer pointers (default ``auto``: by T_max); like every ``TLX_DIST_*``
    setting it must be the same on every rank (senders and receivers must agree on the mode: a
    mismatch ends in a wait timeout or stale arrival counters). Resolved at a buffer set's first
    dispatch (checked before any signal) and kept for its life."""
    mode = getattr(bufs, "_recv_mode", None)
    if mode is not None:
        return mode
    if bufs.use_nvshmem:
        mode = "after"
    elif bufs.backend in ("emulated", "local") or bufs.world_size == 1:
        mode = "blocks"
    else:
        force = os.environ.get(ENV_RECV_OVERLAP, "auto")
        if force not in ("auto", "0", "1"):
            raise ValueError(f"{ENV_RECV_OVERLAP}={force!r}: expected auto, 0 or 1")
        if force == "auto":
            mode = "overlap" if bufs.layout.max_tokens >= RECV_OVERLAP_MIN_TOKENS else "after"
        else:
            mode = "overlap" if force == "1" else "after"
    bufs._recv_mode = mode
    return mode


ENV_COMB_OVERLAP = "TLX_DIST_COMB_OVERLAP"


def _comb_mode(bufs: SymmBuffers) -> str:
    """How a combine's source side sums the partial rows (``tlx/comm/exchange.py``, CBLK):
    ``"overlap"`` (real ranks over peer pointers on CUDA: for the row form of 16-bit rows -- the
    fused EP pipeline's combine -- the reduce-send launch's first programs sum each block of
    ``comb_block`` tokens as its partial rows land, overlapping the transfer, and the combine is one
    launch; the expanded form and 32/64-bit rows, whose reduce-send holds too many registers for
    programs to wait beside it, run as "after"), ``"blocks"`` (the emulated world, whose ranks
    launch one after another, and one rank: the same per-block counters, summed by the
    reduce-receive kernel after the sends) or ``"after"`` (the NVSHMEM route and ROCm: one ARRIVE
    count per rank, then the reduce-receive kernel).
    ``TLX_DIST_COMB_OVERLAP=0`` keeps real ranks over peer pointers on ``"after"`` (default ``auto``
    / ``1``: overlap); like every ``TLX_DIST_*`` setting it must be the same on every rank.
    Resolved at a buffer set's first combine and kept for its life."""
    mode = getattr(bufs, "_comb_mode", None)
    if mode is not None:
        return mode
    if bufs.use_nvshmem:
        mode = "after"
    elif bufs.backend in ("emulated", "local") or bufs.world_size == 1:
        mode = "blocks"
    elif torch.version.hip is not None:  # (waves per CU differ: the co-residency above is unchecked there)
        mode = "after"
    else:
        force = os.environ.get(ENV_COMB_OVERLAP, "auto")
        if force not in ("auto", "0", "1"):
            raise ValueError(f"{ENV_COMB_OVERLAP}={force!r}: expected auto, 0 or 1")
        mode = "after" if force == "0" else "overlap"
    bufs._comb_mode = mode
    return mode


def _comb_meta(bufs: SymmBuffers) -> dict:
    L = bufs.layout
    return dict(OFF_CBLK=L.off_cblk, CB=L.comb_block, NCB=L.comb_blocks)


def _recv_programs(bufs: SymmBuffers) -> int:
    """Receiving programs of an ``"overlap"`` send launch: one per SM (a quarter of the launch's
    programs; they are its last ones and wait only for peers' senders, who never wait for them),
    no more than there are RECV blocks. Session 9's first try used 33 with 8 x 512 tiles: ~8 GB/s
    each, the copy took longer than the transfer."""
    L = bufs.layout
    return max(1, min(_num_programs(str(bufs.device)) // 4, (L.world_size - 1) * L.recv_blocks))


def _recv_tile(bufs: SymmBuffers) -> dict:
    """The receiving programs' copy tile: a whole RECV block of rows (RB, as a power of two) by
    columns up to 16K elements a tile (32 KB of bf16 in flight per program)."""
    L = bufs.layout
    r = _next_pow2(L.recv_block)
    return dict(RCV_R=r, RCV_D=max(16, min(_next_pow2(L.hidden), 16384 // r)))


def _blk_meta(bufs: SymmBuffers) -> dict:
    L = bufs.layout
    return dict(OFF_RBLK=L.off_rblk, RB=L.recv_block, NRB=L.recv_blocks)


ENV_COPY_ENGINE = "TLX_DIST_COPY_ENGINE"
# "auto" turns the copy-engine row form on from this many tokens per rank (the buffers' T_max) ...
CE_MIN_TOKENS = 4096  # (two H200s, x2_s40: T=128 combined in 38-52 us by copy engines, 25 by SM stores)
# ... where a token reaches each peer with at least this probability under uniform routing
# (1 - C(E - E/W, K) / C(E, K): every token's row crosses to every peer in the dense layout, so the
# copy engines' ~7% more bandwidth pays only when nearly every row had to cross anyway; W=2, E=64,
# K=8: 0.995; W=4: 0.915; W=8: 0.68)
CE_MIN_DENSITY = 0.95
# The combine's copies: chunks of CE_CHUNK_ROWS rows, the last one cut in halves down to CE_TAIL_ROWS
# (H = 16384: 4096 x 3, 2048, 1024, 512, 512; H = 4096: 2048, 1024, 512, 512). The sum starts on a chunk
# as soon as its signal lands; each copy costs a gap of ~2.3 us on the copy engine and a slower start, so
# few large copies, and small ones last, so that the sum left after the last copy is a short one. Two
# H200s, D=7168, graph-replayed, ranks aligned (x2_s48), T=16384 / 4096 combined in: 2048-row chunks
# (the earlier default) 672.2-672.8 / 192.4-193.4 us; 4096 uncut 689.6-690.5 / 233.3-234.1; 3072
# 661.0-662.3 / 197.2-198.9; 4096 cut to 1024 648.0-648.8 / 189.1-190.1; 4096 cut to 512 645.5-647.2
# (362-363 GB/s) / 187.4-188.2.
CE_CHUNK_ROWS, CE_TAIL_ROWS = 4096, 512
# summing programs of the copy-engine combine per SM (at most 8: half of what an SM holds at 4 warps, so
# the chunks' signal kernels, which the summing programs wait for, always find room)
CE_SUM_PER_SM = 4


def _ce_density(L) -> float:
    e = L.num_experts // L.world_size
    return 1.0 - math.comb(L.num_experts - e, L.top_k) / math.comb(L.num_experts, L.top_k)


def _ce_mode(bufs: SymmBuffers) -> bool:
    """Whether the row form into a per-layer region (with a static capacity, W > 1) moves rows by copy
    engines (``tlx_dist/comm/copy_engine.py``, ``tlx/comm/copy_engine.py``) in the dense layout.
    The setting: ``SymmDispatcher(copy_engine=...)`` on the buffers, else ``TLX_DIST_COPY_ENGINE``
    (``auto`` / ``1`` / ``0``; like every ``TLX_DIST_*`` setting it must be the same on every rank).
    ``auto``: real ranks over peer pointers on CUDA with T_max >= ``CE_MIN_TOKENS`` and a uniform
    routing density >= ``CE_MIN_DENSITY``. On (``True`` / ``1``): wherever copies can be issued --
    real ranks over peer pointers on CUDA, and the emulated world (CPU: ``memmove``; one GPU:
    same-device copies), which runs the whole protocol; never on the NVSHMEM route or ROCm, which
    keep SM stores. Resolved at a buffer set's first use and kept for its life."""
    mode = getattr(bufs, "_ce_mode_v", None)
    if mode is None:
        mode = bufs._ce_mode_v = _ce_resolve(bufs, getattr(bufs, "copy_engine", None))
    return mode


def _ce_resolve(bufs: SymmBuffers, setting) -> bool:
    if setting is None:
        env = os.environ.get(ENV_COPY_ENGINE, "auto")
        if env not in ("auto", "0", "1"):
            raise ValueError(f"{ENV_COPY_ENGINE}={env!r}: expected auto, 0 or 1")
        setting = "auto" if env == "auto" else env == "1"
    L = bufs.layout
    emulated = bufs.backend in ("emulated", "local")
    if bufs.use_nvshmem or L.world_size == 1 or L.row_regions == 0 or torch.version.hip is not None:
        mode = False
    elif emulated:
        mode = setting is True and (bufs.device.type == "cpu" or copy_engine.available(bufs.device))
    elif not copy_engine.available(bufs.device):
        mode = False
    elif setting == "auto":
        mode = L.max_tokens >= CE_MIN_TOKENS and _ce_density(L) >= CE_MIN_DENSITY
    else:
        mode = bool(setting)
    return mode


def _set_copy_engine(bufs: SymmBuffers, setting: bool) -> None:
    """A dispatcher's ``copy_engine=True / False`` onto its buffer set (shared by every layer of the
    group, ``ep_buffers``). A set whose mode, fixed at its first op, differs from what this setting
    gives raises instead of ignoring the request."""
    prev = getattr(bufs, "copy_engine", None)
    if prev == setting:  # (every dispatch passes here: nothing to do)
        return
    if prev is not None:
        raise ValueError(f"copy_engine={setting}: another SymmDispatcher of this buffer set asked for "
                         f"copy_engine={prev}; every dispatcher that shares a buffer set must ask the same")
    mode = getattr(bufs, "_ce_mode_v", None)
    if mode is not None and _ce_resolve(bufs, setting) != mode:
        raise ValueError(f"copy_engine={setting}: this buffer set already runs with the copy-engine row form "
                         f"{'on' if mode else 'off'} (fixed at its first op): give every SymmDispatcher that shares "
                         "it the same copy_engine, or build it anew")
    bufs.copy_engine = setting


def _ce_ready(bufs: SymmBuffers) -> None:
    """On the op's stream, before its copies fork off it: waits for every peer's readiness."""
    L = bufs.layout
    _kernels(bufs.device)._ce_ready_kernel[(1,)](bufs.peers, bufs.rank, W=L.world_size, WP=_next_pow2(L.world_size),
                                                 OFF_STATE=L.off_state, OFF_FLAGS=L.off_flags,
                                                 TIMEOUT_NS=bufs.timeout_ns, CLOCK=_clock(), num_warps=1)


def _ce_send_rows(bufs: SymmBuffers, x_TD: torch.Tensor, region: int) -> None:
    """The copy-engine dispatch's rows (on the stream it is called on): this rank's T token rows,
    one copy per peer d, to rows ``[RANK*T_max, RANK*T_max + T)`` of d's region ``region``; then one
    program adds T to d's region counter RCNT[region, RANK] (``_rows_wait`` waits for it)."""
    L, r = bufs.layout, bufs.rank
    T, D, es = x_TD.shape[0], L.hidden, L.dtype.itemsize
    row0 = L.off_rows + region * L.rows_region_bytes + r * L.max_tokens * D * es
    for d in range(L.world_size):
        if d != r:
            copy_engine.copy_bytes(bufs.device, bufs.peer_ptrs[d] + row0, x_TD.data_ptr(), T * D * es)
    _kernels(bufs.device)._ce_signal_kernel[(1,)](bufs.peers, bufs.peers, r, 0, T, _rcnt_off(L, region),
                                                  W=L.world_size, MODE=0, num_warps=1)


def _ce_chunks(H: int, CB: int, rows: Optional[int] = None, tail: Optional[int] = None) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of the combine's copies over H rows: chunks of ``rows`` (default
    ``CE_CHUNK_ROWS``; ``LAUNCH_OVERRIDES["ce"]["chunk_rows"]``), the last one cut in halves, each
    half's second half again, down to ``tail`` rows (default ``CE_TAIL_ROWS``;
    ``LAUNCH_OVERRIDES["ce"]["tail_rows"]``, 0: not cut), so the sum that trails the last copy is a
    short one. Every bound but H is a multiple of CB (a chunk's signal counts whole token blocks but
    its first and last)."""
    if H <= 0:
        return []
    c = max(CB, (CE_CHUNK_ROWS if rows is None else rows) // CB * CB)
    tail = CE_TAIL_ROWS if tail is None else tail
    out = [(lo, min(H, lo + c)) for lo in range(0, H, c)]
    if tail:
        lo, hi = out.pop()
        while hi - lo > max(tail, CB) and (hi - lo) // 2 // CB > 0:
            mid = lo + (hi - lo) // 2 // CB * CB
            out.append((lo, mid))
            lo = mid
        out.append((lo, hi))
    return out


def _ce_send_partials(bufs: SymmBuffers, part_RD: torch.Tensor, h: SymmHandle) -> Optional[torch.cuda.Event]:
    """The copy-engine combine's transfer, after what the current stream enqueued: for every source
    s != RANK, the partial rows ``part_RD[s*T_max + t]`` of t < H (H = this rank's own token count:
    the host's estimate of s's, which it does not know without a sync) go to s's COMB[RANK, t] in
    chunks (``_ce_chunks``) on the side stream; each chunk's signal (``_ce_signal_kernel`` MODE 1) runs
    on a second stream as soon as its copy is done, so the copies never wait for a launch. A source
    with more than H tokens gets the rest by ``_ce_fixup_kernel`` (SM stores); rows past a source's
    count are copied and never read. Returns the event to join (None where it ran in line: the
    emulated world and the interpreter, whose ranks run one after another)."""
    L, r, dev = bufs.layout, bufs.rank, bufs.device
    W, T_max, D, es, CB = L.world_size, L.max_tokens, L.hidden, L.dtype.itemsize, L.comb_block
    k = _kernels(dev)
    H = min(h.num_tokens, T_max)
    o = LAUNCH_OVERRIDES.get("ce") or {}
    chunks = _ce_chunks(H, CB, o.get("chunk_rows"), o.get("tail_rows"))
    nbp = _next_pow2(max([hi - lo for lo, hi in chunks] + [1]) // CB + 2)
    inline = dev.type != "cuda" or bufs.backend in ("emulated", "local")
    side = sig = None
    if not inline:
        if bufs._side_stream is None:
            bufs._side_stream = torch.cuda.Stream(device=dev)
        if bufs._ce_sig_stream is None:
            bufs._ce_sig_stream = torch.cuda.Stream(device=dev)
        cur = torch.cuda.current_stream(dev)
        side, sig = bufs._side_stream, bufs._ce_sig_stream
        side.wait_stream(cur)
        sig.wait_stream(cur)
    on = (lambda stream: contextlib.nullcontext()) if inline else torch.cuda.stream
    part = part_RD.data_ptr()
    comb = L.off_comb + r * T_max * D * es

    for lo, hi in chunks:
        with on(side):
            for s in range(W):
                if s != r:
                    copy_engine.copy_bytes(dev, bufs.peer_ptrs[s] + comb + lo * D * es,
                                           part + (s * T_max + lo) * D * es, (hi - lo) * D * es)
        if not inline:
            ev = torch.cuda.Event()
            ev.record(side)
            sig.wait_event(ev)
        with on(sig):
            k._ce_signal_kernel[(1,)](h.rows_from_W, bufs.peers, r, lo, hi, 0, W=W, MODE=1, OFF_CBLK=L.off_cblk,
                                      CB=CB, NCB=L.comb_blocks, NBP=nbp, num_warps=1)
    if H < T_max:
        with on(sig):
            k._ce_fixup_kernel[(L.comb_blocks - H // CB,)](part_RD, h.rows_from_W, bufs.peers, r, H, W=W,
                                                             T_MAX=T_max, D=D, OFF_COMB=L.off_comb,
                                                             OFF_CBLK=L.off_cblk, CB=CB, NCB=L.comb_blocks,
                                                             BLOCK_D=min(256, _next_pow2(D)), CBP=_next_pow2(CB))
    if inline:
        return None
    sig.wait_stream(side)
    done = torch.cuda.Event()
    done.record(sig)
    for t in (part_RD, h.rows_from_W):
        t.record_stream(side)
        t.record_stream(sig)
    return done


def _rows_wait(bufs: SymmBuffers, region: int, rows_from_W: torch.Tensor) -> None:
    L = bufs.layout
    _kernels(bufs.device)._rows_wait_kernel[(1,)](rows_from_W, bufs.peers, bufs.rank, _rcnt_off(L, region),
                                                  W=L.world_size, OFF_STATE=L.off_state, TIMEOUT_NS=bufs.timeout_ns,
                                                  CLOCK=_clock(), num_warps=1)


def _send_tokens(bufs, x_TD, send_row_TW, idx_TK, q_TK, lay, gate_TK, with_meta: bool, offs=None,
                 offs_cap: Optional[int] = None, own_rows: Optional[torch.Tensor] = None, skip_own: bool = False,
                 raw_meta: bool = False, rows_from: Optional[torch.Tensor] = None, region: Optional[int] = None,
                 split: int = 0, programs: Optional[int] = None, dense: bool = False):
    """The op's phase 2: waits for every peer's signal (and with meta computes this rank's layout
    into ``lay`` / ``offs``, the latter capped at ``offs_cap`` expanded rows when given), then
    sends the token rows (gates cast to the activation dtype here). ``own_rows`` (the row form's
    ``[W*T_max, D]`` output): this rank's own rows are stored there directly, not in the shared
    region (the expand kernel then copies only the other sources' rows); ``skip_own``: they are not
    copied at all, the expand kernel reads them from ``x_TD`` (which must be row-contiguous).
    ``raw_meta``: wait only for the peers' readiness, not their counts, and send raw slot codes
    (``lay`` / ``offs`` are then left to ``_expand(layout=...)``).
    With ``own_rows``, the other sources' rows reach it block by block (``_recv_mode``): in
    ``"overlap"`` mode this launch's last programs copy them as they land; ``rows_from`` (int64
    ``[W]``, rows from each source) is then where they read how many to expect. ``region``: the
    rows go to every destination's per-layer receive region ``region`` (``own_rows`` must be this
    rank's view of it) and stay there: no receive-side copy in any mode. ``split=1`` (with
    ``region``): the overlapped dispatch's first half -- META, gates and the own rows only; ``split=2``
    (with ``region``, no meta, ``programs`` programs): its second half, the peers' rows and their
    region-counter adds, outside the op (no barrier; :func:`_send_rows_side`)."""
    L, k = bufs.layout, _kernels(bufs.device)
    T, D = x_TD.shape
    if x_TD.stride(-1) != 1:
        if skip_own:
            raise ValueError("skip_own needs row-contiguous x_TD (the expand kernel reads this rank's rows there)")
        x_TD = x_TD.contiguous()
    bt, bd, warps, grid = _shape("send", D, T, bufs.device)
    dummy = send_row_TW
    E = L.num_experts
    rows_meta = {}
    if own_rows is not None and region is not None:
        rows_meta = dict(OWN_ADDR=own_rows.data_ptr(), LOCAL_ROWS=True, ROWS_REGION=True,
                         ROWS_OFF=L.off_rows + region * L.rows_region_bytes, **({"SPLIT": split} if split else {}))
        if split == 2:
            rows_meta["RCNT_OFF"] = _rcnt_off(L, region)
            grid = (max(1, min(-(-T // bt), programs)),)
    elif own_rows is not None:
        rows_meta = dict(OWN_ADDR=own_rows.data_ptr(), LOCAL_ROWS=True)
        mode = _recv_mode(bufs)
        if mode != "after":
            rows_meta.update(BLK_SIGNAL=True, **_blk_meta(bufs))
        if mode == "overlap":
            if rows_from is None:
                raise ValueError("the overlapped receive copy needs rows_from (rows from each source)")
            n_recv = _recv_programs(bufs)
            n_send = max(1, min(-(-T // bt), _num_programs(str(bufs.device)) - n_recv))
            rows_meta.update(RECV_ROLE=True, N_SEND=n_send, rows_from_ptr=rows_from, **_recv_tile(bufs))
            grid = (n_send + n_recv,)
    _send_launch(
        bufs, k._send_tokens_kernel, grid,
        x_TD, x_TD.stride(0), T, send_row_TW, idx_TK if with_meta else dummy, q_TK if with_meta else dummy,
        lay if with_meta else dummy, gate_TK if with_meta else dummy, bufs.peers, bufs.rank,
        W=L.world_size, WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k),
        E_LOCAL=E // L.world_size, D=D, T_MAX=L.max_tokens,
        META_W=L.meta_words, OFF_ARRIVE=L.off_arrive, OFF_META=L.off_meta, OFF_GATES=L.off_gates,
        OFF_RECV=L.off_recv, WITH_META=with_meta, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps,
        offs_ptr=offs if with_meta else dummy, E=E, EP=_next_pow2(E), NC=L.num_counts, OFF_COUNTS=L.off_counts,
        OFFS_CAP=-1 if offs_cap is None else offs_cap,
        **rows_meta, **({"LOCAL_X": True} if skip_own else {}), **({"RAW_META": True} if raw_meta else {}),
        **({"DENSE": True} if dense else {}),
        **({} if split == 2 else _await_meta(bufs)))


def _send_rows_side(bufs: SymmBuffers, x_TD: torch.Tensor, send_row_TW: torch.Tensor, own_rows: torch.Tensor,
                    region: int, side_sms: int) -> Optional[torch.cuda.Event]:
    """The overlapped dispatch's second half (``_send_tokens`` ``split=2``): every peer's token rows
    into its region ``region``, each of ``side_sms`` programs (one an SM) adding its rows to the
    destination's region counter when done; on the side stream (``_on_side``)."""
    return _on_side(bufs, lambda: _send_tokens(bufs, x_TD, send_row_TW, None, None, None, None, with_meta=False,
                                               own_rows=own_rows, region=region, split=2, programs=side_sms),
                    x_TD, send_row_TW)


def _expand(bufs, out_ND, src_map_N, pos_RK, gate_RK, tok_R, rows_from_W, y_ND, from_meta: bool, gate_grad: bool,
            n_exp: Optional[int] = None, gate_N: Optional[torch.Tensor] = None, copy: bool = True,
            dgate_given: bool = False, wait_rows: bool = True, end: bool = False, recv_copy: bool = False,
            src_row_N: Optional[torch.Tensor] = None,
            x_own: Optional[torch.Tensor] = None, layout: Optional[tuple] = None):
    """``_expand_kernel``. ``copy=False`` (with ``n_exp`` expanded rows) is the fused-EP form: only
    the index maps (and ``gate_N``, or given gate gradients ``y_ND``) move, and ``out_ND`` is written
    only with ``recv_copy`` (the other sources' receive rows into ``[W*T_max, D]``, whose own-rank
    rows ``_send_tokens(own_rows=out_ND)`` stored); ``x_own``: the rows this rank
    sent with ``_send_tokens(skip_own=True)``, read there for its own tokens; ``end``: the op's last kernel;
    ``layout`` = ``(lay, offs, offs_cap)`` after a ``raw_meta`` send: this kernel waits for the
    counts, computes ``lay`` and ``offs`` (``rows_from_W`` must be ``lay[E+e:]``) and decodes META;
    returns then the ``[W, e]`` int64 first expanded row of each (source, local expert), else None."""
    L, k = bufs.layout, _kernels(bufs.device)
    br, bd, warps, grid = _shape("expand", L.hidden, L.recv_rows, bufs.device)
    c = _common(bufs)
    extra = {}
    if gate_N is not None:
        extra.update(gate_n_ptr=gate_N, GATE_N=True)
    if not copy:
        extra.update(COPY=False)
    if dgate_given:
        extra.update(DGATE_GIVEN=True)
    if not wait_rows:
        extra.update(WAIT_ROWS=False)
    if end:
        extra.update(_end_meta(bufs))
    mode = _recv_mode(bufs)
    if recv_copy and mode != "overlap":  # "overlap": the send kernel copied them
        extra.update(RECV_COPY=True)
        if mode == "blocks":
            extra.update(BLK=True, **_blk_meta(bufs))
    if src_row_N is not None:
        extra.update(src_row_ptr=src_row_N, SRC_ROW=True)
    if x_own is not None:
        extra.update(x_ptr=x_own, stride_x=x_own.stride(0), LOCAL_X=True)
    if layout is not None:
        lay, offs, cap = layout
        E, W = L.num_experts, L.world_size
        starts = torch.empty(W * (E // W), dtype=torch.int64, device=lay.device)
        extra.update(LAYOUT=True, lay_ptr=lay, offs_ptr=offs, starts_ptr=starts, E=E, EP=_next_pow2(E),
                     E_LOCAL=E // W, NC=L.num_counts, OFF_COUNTS=L.off_counts, OFF_FLAGS=L.off_flags,
                     OFFS_CAP=-1 if cap is None else cap)
    _send_launch(
        bufs, k._expand_kernel, grid,
        out_ND, src_map_N, pos_RK, gate_RK, tok_R, rows_from_W, y_ND if gate_grad else out_ND, bufs.peers,
        bufs.rank, out_ND.shape[0] if n_exp is None else n_exp, WP=_next_pow2(L.world_size), K=L.top_k,
        KP=_next_pow2(L.top_k),
        D=L.hidden, T_MAX=L.max_tokens, META_W=L.meta_words, OFF_META=L.off_meta, OFF_GATES=L.off_gates,
        OFF_RECV=L.off_recv, OFF_DGATE=L.off_dgate, FROM_META=from_meta, GATE_GRAD=gate_grad, BLOCK_R=br,
        BLOCK_D=bd, num_warps=warps, sends=gate_grad or end, **c, **extra)
    return extra.get("starts_ptr")


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


def dispatch_steps(bufs: SymmBuffers, x_TD: torch.Tensor, idx_TK: torch.Tensor,
                   gate_TK: Optional[torch.Tensor] = None, capacity: Capacity = "worst",
                   rows: bool = False, region: Optional[int] = None, overlap: bool = False) -> Steps:
    """Phases of one dispatch on rank ``bufs.rank``; returns ``(x_exp_ND, SymmHandle)``.

    ``rows=True`` (the fused EP pipeline) skips the expert-major copy and returns ``(recv_RD, src_N,
    gate_N, SymmHandle)``: a copy of the receive rows ``[W*T_max, D]`` (row ``s*T_max + i`` is
    source s's i-th token row; rows past ``rows_from_W[s]`` are unspecified and never indexed), the
    receive row each expanded row reads (``src_map_N // K``, int32) and its fp32 gate. With
    ``region`` (row form over peer pointers) ``recv_RD`` is instead this rank's per-layer receive
    region ``region`` itself (``SymmBuffers.rows_region``), where the peers' rows land: no copy,
    valid until the next dispatch into that region. The NVSHMEM route ignores ``region`` (its puts
    target RECV). ``overlap`` (with ``region`` and a static capacity; ignored otherwise): the send
    splits in two -- META, gates and the own rows in the op, the peers' rows after it on a side
    stream (``_send_rows_side``) -- and the op ends without waiting for the rows: the handle's
    ``overlap`` (:class:`RowsOverlap`) says how to wait for them."""
    L = bufs.layout
    T, K = idx_TK.shape
    _check_bufs(bufs, x_TD, K, L.num_experts)
    _recv_mode(bufs)  # a bad TLX_DIST_RECV_OVERLAP raises here, before this op signals any peer
    # ... and a region the buffers do not have (ValueError naming it; the NVSHMEM route reserves none)
    region_RD = None
    if region is not None and not (bufs.use_nvshmem and L.row_regions == 0):
        region_RD = bufs.rows_region(region)
    if region is not None and (not rows or bufs.use_nvshmem):
        region, region_RD = None, None
    W, r, E, dev = L.world_size, bufs.rank, L.num_experts, x_TD.device
    e = E // W
    idx = idx_TK if idx_TK.is_contiguous() else idx_TK.contiguous()
    if x_TD.stride(-1) != 1:  # held here until the expand kernel has read this rank's own rows
        x_TD = x_TD.contiguous()
    n = expanded_rows(capacity, bufs)  # static, or None for "exact"
    raw = n is not None
    # the copy-engine row form: the dense layout, this rank's rows leave by copy engines on a side
    # stream as soon as every peer is ready (beside the route, META and expand kernels of the op)
    ce = rows and region is not None and raw and W > 1 and _ce_mode(bufs)
    ce_done = None
    if ce:
        _ce_ready(bufs)
        _finish_abandoned(bufs, region)
        x_ce = x_TD.contiguous()
        ce_done = _on_side(bufs, lambda: _ce_send_rows(bufs, x_ce, region), x_ce)
    q_TK, send_row_TW, counts_C = _route(bufs, idx, dense=ce)  # + the signal
    yield
    lay = torch.empty(E + e + W, dtype=torch.int64, device=dev)
    offsets_e = torch.empty(e, dtype=torch.int32, device=dev)
    start_E, recv_counts_e, rows_from_W = lay[:E], lay[E:E + e], lay[E + e:]
    # Gates travel in the activation dtype (the kernel casts them): the owner forms gate * y as the
    # reference does.
    gates = (torch.ones(T, K, dtype=L.dtype, device=dev) if gate_TK is None
             else gate_TK.detach() if gate_TK.is_contiguous() else gate_TK.detach().contiguous())
    # Row form: the receive rows' copy, which this rank's own rows reach straight from the send kernel
    if rows and region is not None:
        recv_RD = region_RD
        # this dispatch overwrites the region: rows saved from the last one are stale now
        torch.autograd.graph.increment_version(recv_RD)
    else:
        recv_RD = torch.empty(L.recv_rows, L.hidden, dtype=L.dtype, device=dev) if rows else None
    # offsets_e come out capped at n (the grouped GEMMs' offsets; overflow is flagged by expand).
    # Static capacity: the rows leave without waiting for the peers' counts (raw slot codes in META),
    # and the expand kernel, which waits for them, computes the layout; "exact" needs the layout on
    # the host before expand, so there the send waits for the counts and computes it.
    ovl = bool(overlap) and rows and region is not None and raw and W > 1
    if region is not None and not ce:  # (with ce: done above, before the copies)
        _finish_abandoned(bufs, region)
    _send_tokens(bufs, x_TD, send_row_TW, idx, q_TK, lay, gates, with_meta=True, offs=offsets_e, offs_cap=n,
                 own_rows=recv_RD, skip_own=not rows, raw_meta=raw, rows_from=rows_from_W, region=region,
                 split=1 if ovl or ce else 0, dense=ce)
    side_sms = overlap_sms() if ovl else 0
    if ce:
        side_done = ce_done
    else:
        side_done = _send_rows_side(bufs, x_TD, send_row_TW, recv_RD, region, side_sms) if ovl else None
    layout = (lay, offsets_e, n) if raw else None
    yield
    if n is None:
        n = int(offsets_e[-1]) if e else 0  # capacity="exact": the one host sync of this op
    src_map = torch.empty(n, dtype=torch.int32, device=dev)
    R = L.recv_rows
    pos_RK = torch.empty(R, K, dtype=torch.int32, device=dev)
    gate_RK = torch.empty(R, K, dtype=L.dtype, device=dev)
    tok_R = torch.empty(R, dtype=torch.int32, device=dev)
    if rows:
        # the other sources' receive rows, copied out by the kernel before it ends the op (a peer's
        # next op may overwrite the region as soon as it has)
        x_exp = recv_RD
        gate_N = torch.empty(n, dtype=_acc_dtype(L.dtype), device=dev)
        src_N = torch.empty(n, dtype=torch.int32, device=dev)
        starts = _expand(bufs, x_exp, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True,
                         gate_grad=False, n_exp=n, gate_N=gate_N, copy=False, end=True, recv_copy=region is None,
                         src_row_N=src_N, layout=layout)
    else:
        x_exp = torch.empty(n, L.hidden, dtype=L.dtype, device=dev)
        _expand(bufs, x_exp, src_map, pos_RK, gate_RK, tok_R, rows_from_W, None, from_meta=True, gate_grad=False,
                end=True, x_own=x_TD, layout=layout)
    handle = SymmHandle(
        num_tokens=T, top_k=K, num_recv_rows=n,
        offsets_e=offsets_e,
        recv_counts_e=recv_counts_e, tokens_per_expert_E=counts_C[:E],
        order_S=None, inverse_S=None, send_row_TW=send_row_TW, rows_to_W=counts_C[E:],
        rows_from_W=rows_from_W, pos_RK=pos_RK, gate_RK=gate_RK, tok_R=tok_R, src_map_N=src_map,
        gate_TK=gate_TK, buffers=bufs, dense=ce)
    if ce and not ovl:  # the rows are this op's result: wait for them here
        _rows_wait(bufs, region, rows_from_W)
        if side_done is not None:
            torch.cuda.current_stream(bufs.device).wait_event(side_done)
    if rows and ovl:
        handle = dataclasses.replace(handle, overlap=_rows_overlap(handle, region, starts, lay, n, side_sms,
                                                                   side_done))
        bufs._overlap_plans[region] = handle.overlap
    if rows:
        return x_exp, src_N, gate_N, handle
    return x_exp, handle


def _finish_abandoned(bufs: SymmBuffers, region: int) -> None:
    """An overlapped dispatch into this region whose rows were never waited for (its forward was
    abandoned before the GEMMs): take its rows off the region counters now, or the next dispatch's
    wait would count them as its own. (The counters are additive and each wait subtracts exactly its
    dispatch's rows, so the order of the two waits does not matter.)"""
    prev = bufs._overlap_plans.pop(region, None)
    if prev is not None and not prev.joined:
        prev.finish()


def _rows_overlap(h: SymmHandle, region: int, starts: torch.Tensor, lay: torch.Tensor, cap: int, side_sms: int,
                  side_done) -> RowsOverlap:
    """The overlapped dispatch's :class:`RowsOverlap`: ``offsets_V`` from the layout the expand
    kernel computed (one launch of ``_phase_offsets_kernel``)."""
    bufs = h.buffers
    L = bufs.layout
    E, W = L.num_experts, L.world_size
    e = E // W
    offsets_V = torch.empty(3 * e, dtype=torch.int32, device=bufs.device)
    _kernels(bufs.device)._phase_offsets_kernel[(1,)](starts, lay[E:E + e], h.offsets_e, offsets_V, bufs.rank, cap,
                                                      W=W, E_LOCAL=e, EP=_next_pow2(e), num_warps=1)
    return RowsOverlap(h, region, offsets_V, side_sms, side_done)


def _reduce_send(bufs: SymmBuffers, y: torch.Tensor, h: SymmHandle, gated: bool, rows: bool = False,
                 programs: Optional[int] = None, blk: bool = False, recv: bool = False):
    """The first kernel of a reducing op: waits for every peer's readiness, then sends partial rows.
    Row form: rows of this rank's own tokens stay in ``y``, which is returned for ``_reduce_recv``
    to read them there (the caller keeps it alive until then). ``programs``: at most that many
    (the overlapped combine's SM budget). ``blk``: count the rows into their sources' CBLK
    (``_comb_mode`` "blocks" / "overlap") instead of one ARRIVE add per source. ``recv`` (with
    ``blk``, real ranks over peer pointers): this launch also sums this rank's tokens as their
    partial rows land and ends the op -- the whole combine in one launch; returns ``out_TD``."""
    L, k = bufs.layout, _kernels(bufs.device)
    y = y if y.is_contiguous() else y.contiguous()
    br, bd, warps, grid = _shape("reduce_send", L.hidden, L.recv_rows, bufs.device)
    if programs is not None:
        grid = (max(1, min(grid[0], programs)),)
    extra, out = {}, None
    if blk:
        extra.update(CBLK_SIGNAL=True, **_comb_meta(bufs))
    if recv:
        T = h.num_tokens
        n_send, n_recv, rr_t, rr_d = _comb_recv_shape(bufs, T)
        out = torch.empty(T, L.hidden, dtype=L.dtype, device=bufs.device)
        extra.update(RECV_ROLE=True, N_RECV=n_recv, out_ptr=out, send_row_ptr=h.send_row_TW, T=T,
                     RR_T=rr_t, RR_D=rr_d, END=True, WP3=_end_meta(bufs)["WP3"],  # (OFF_FLAGS: _await_meta's)
                     **({"PART_ADDR": y.data_ptr()} if rows else {}))
        grid = (min(grid[0], n_send) + n_recv,)
    _send_launch(bufs, k._reduce_send_kernel, grid,
        y, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, bufs.peers, bufs.rank, h.num_recv_rows,
        W=L.world_size, WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k), D=L.hidden, T_MAX=L.max_tokens,
        OFF_ARRIVE=L.off_arrive, OFF_COMB=L.off_comb, GATED=gated, ACC=_common(bufs)["ACC"],
        BLOCK_R=br, BLOCK_D=bd, num_warps=warps, **({"ROWS": True} if rows else {}),
        **_await_meta(bufs), **extra)
    return out if recv else y


# The one-launch combine (``_comb_mode`` "overlap"): summing programs per SM and sending programs
# per SM (LAUNCH_OVERRIDES["comb_recv"] = dict(per_sm=..., send_per_sm=...) for sweeps). The
# launch's programs should all be resident at once (<= 64 registers a thread: 8 CTAs of 4 warps
# an SM), so the sum runs beside the transfer instead of after the senders retire. Two H200s,
# W=2, D=7168, E=64, K=8, graph-replayed (bench/exchange_tiles.py, session 16): 4 x 2 combined in
# 207.9 / 744.5 us at T=4096 / 16384 against 230.9 / 891.7 with two launches; 4 x 4 219.0 / 789.1,
# 2 x 4 284.4 / 915.4, 1 x 4 352.2 / 1164.0 (too few summing programs: the sum trails the transfer).
COMB_RECV_PER_SM = 4
COMB_SEND_PER_SM = 2


def _comb_recv_shape(bufs: SymmBuffers, T: int) -> tuple[int, int, int, int]:
    """(sending programs at most, summing programs, summing tile rows, columns) of a one-launch
    combine. A summing tile holds ~4096 / W elements per rank (W partial chunks in flight at ~64
    registers a thread); its work units are (COMB_BLOCK tokens, one column tile)."""
    L = bufs.layout
    o = LAUNCH_OVERRIDES.get("comb_recv") or {}
    sms = _num_programs(str(bufs.device), 1)
    rr_d = min(512, _next_pow2(L.hidden))
    rr_t = max(1, (4096 // max(2, L.world_size)) // rr_d)
    rr_t = 1 << (rr_t.bit_length() - 1)  # a power of two (W = 3, 6, ... would not give one)
    units = -(-max(T, 1) // L.comb_block) * -(-L.hidden // rr_d)
    # at most half the CTAs an SM holds: with the row form's reduce-send at <= 64 registers a thread
    # (tests/test_symm_compile.py) 32 / warps CTAs fit an SM (8 at 4 warps), so senders always find
    # room beside the summing programs, which wait for them
    warps = (LAUNCH_OVERRIDES.get("reduce_send") or {}).get("num_warps", 4)
    cap = max(1, min(4, 16 // warps))
    n_recv = max(1, min(units, min(cap, o.get("per_sm", COMB_RECV_PER_SM)) * sms))
    return o.get("send_per_sm", COMB_SEND_PER_SM) * sms, n_recv, rr_t, rr_d


def _reduce_recv(bufs: SymmBuffers, h: SymmHandle, end: bool = True, part: Optional[torch.Tensor] = None,
                 blk: bool = False, dense: bool = False) -> torch.Tensor:
    """The last kernel of a reducing op: the per-rank partial rows of each token, summed. ``part``:
    the row form's ``[W*T_max, D]`` partial rows, where this rank's own ones are read. ``blk``: the
    reduce-send counted its rows into CBLK (wait per token block, not for ARRIVE). ``dense``: the
    copy-engine row form, whose counts come from one-program signal kernels on another stream: the
    summing programs, which wait for them, leave room for them on every SM (``CE_SUM_PER_SM``)."""
    L, k = bufs.layout, _kernels(bufs.device)
    T = h.num_tokens
    br, bd, warps, grid = _shape("reduce_recv", L.hidden, T, bufs.device)
    if blk:  # a work unit is one counter's tokens by one column tile: no taller tile than that
        br = min(br, _next_pow2(L.comb_block))
    if dense:  # (16 programs an SM, the default, filled every SM at T=16384 and starved the signals: x2_s39)
        if br * bd > 1024 * warps:  # (x2_s46: a 16 x 512 tile at 4 warps took every register and hung)
            raise ValueError(f"LAUNCH_OVERRIDES['reduce_recv']: a {br} x {bd} tile at {warps} warps is too large for "
                             "the copy-engine combine, whose summing programs must leave room on every SM for the "
                             "signal kernels they wait for (at most 1024 elements a warp)")
        per_sm = (LAUNCH_OVERRIDES.get("ce") or {}).get("sum_per_sm", CE_SUM_PER_SM)
        grid = (max(1, min(grid[0], _num_programs(str(bufs.device), min(per_sm, 8)))),)
    out = torch.empty(T, L.hidden, dtype=L.dtype, device=bufs.device)
    _send_launch(bufs, k._reduce_recv_kernel, grid,
        out, h.send_row_TW, h.rows_to_W, bufs.peers, bufs.rank, T, WP=_next_pow2(L.world_size), D=L.hidden,
        OFF_COMB=L.off_comb,
        BLOCK_T=br, BLOCK_D=bd, num_warps=warps, sends=end, **_common(bufs), **(_end_meta(bufs) if end else {}),
        **(dict(PART_ADDR=part.data_ptr(), LOCAL_ROWS=True) if part is not None else {}),
        T_MAX=L.max_tokens,  # (COMB rows are [W, T_max])
        **(dict(BLK=True, **_comb_meta(bufs)) if blk else {}), **({"DENSE": True} if dense else {}))
    return out


def _gate_grad_recv(bufs: SymmBuffers, h: SymmHandle, end: bool = True) -> torch.Tensor:
    L, k = bufs.layout, _kernels(bufs.device)
    S = h.num_tokens * h.top_k
    g_gate = torch.empty(S, dtype=_acc_dtype(L.dtype), device=bufs.device)
    _send_launch(bufs, k._gate_grad_recv_kernel, _grid(-(-S // 1024), bufs.device),
        g_gate, h.rows_to_W, bufs.peers, bufs.rank, S, W=L.world_size, OFF_STATE=L.off_state,
        OFF_ARRIVE=L.off_arrive, OFF_DGATE=L.off_dgate, TIMEOUT_NS=bufs.timeout_ns, CLOCK=_clock(),
        BLOCK=1024, sends=end, **(_end_meta(bufs) if end else {}))
    return g_gate.view(h.num_tokens, h.top_k)


def _reduce_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: SymmHandle, gated: bool, rows: bool = False) -> Steps:
    mode = _comb_mode(bufs)
    if mode == "overlap" and rows and bufs.layout.dtype.itemsize == 2:  # one launch: sends, sums as the
        # partial rows land, ends the op
        return _reduce_send(bufs, y_ND, h, gated, rows, blk=True, recv=True)
    # (the expanded form's reduce-send sums K slots a row: ~170-180 registers a thread, 2 CTAs an SM;
    # summing programs beside it could hold every slot and starve its senders, so it keeps two launches;
    # so do fp32 / fp64 rows: 96 / 128 registers a thread, 5 / 4 CTAs an SM)
    blk = mode == "blocks"
    y = _reduce_send(bufs, y_ND, h, gated, rows, blk=blk)  # waits for every peer's readiness first
    yield
    return _reduce_recv(bufs, h, part=y if rows else None, blk=blk)


def combine_steps(bufs: SymmBuffers, y_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Phases of one combine; returns ``out_TD = sum_k gate[t, k] * y[t, k]``."""
    return (yield from _reduce_steps(bufs, y_ND, h, gated=True))


def combine_grad_steps(bufs: SymmBuffers, g_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of dispatch: ``g_TD[t] = sum_k g_ND[row of (t, k)]`` (an ungated combine)."""
    return (yield from _reduce_steps(bufs, g_ND, h, gated=False))


def dispatch_grad_steps(bufs: SymmBuffers, g_TD: torch.Tensor, y_ND: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of combine: returns ``(g_y_ND, g_gate_TK)``: ``g_y[row of (t, k)] = gate[t, k] *
    g_TD[t]`` and ``g_gate[t, k] = <g_TD[t], y[row of (t, k)]>`` (fp32; fp64 for fp64 rows)."""
    L = bufs.layout
    g_TD = g_TD if g_TD.stride(-1) == 1 else g_TD.contiguous()
    # waits first; this rank's own rows stay in g_TD, where the expand kernel reads them
    _send_tokens(bufs, g_TD, h.send_row_TW, None, None, None, None, with_meta=False, skip_own=True)
    yield
    n = h.num_recv_rows
    g_y = torch.empty(n, L.hidden, dtype=L.dtype, device=bufs.device)
    scratch = torch.empty(n, dtype=torch.int32, device=bufs.device)
    y = y_ND if y_ND.is_contiguous() else y_ND.contiguous()
    _expand(bufs, g_y, scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, y, from_meta=False, gate_grad=True,
            x_own=g_TD)
    yield
    return g_y, _gate_grad_recv(bufs, h)


def combine_rows_steps(bufs: SymmBuffers, part_RD: torch.Tensor, h: SymmHandle) -> Steps:
    """Fused-EP combine: row r of ``part_RD`` (``[W*T_max, D]``, the gate-weighted sum over this
    rank's experts of receive row r) goes home; returns ``out_TD[t] = sum over ranks`` (fp32, one
    rounding). After an overlapped dispatch, first the rows' wait if the GEMMs did not enqueue it,
    and the join of the side stream that sent them (``RowsOverlap.finish``)."""
    ov = h.overlap
    if ov is not None and ov.partials_sent is not None:  # the fused forward sent the peers' rows already
        if ov.partials_sent != part_RD.data_ptr():
            raise ValueError("combine_rows after an overlapped fused forward must get that forward's output as it "
                             "is: its peers' partial rows went home from there")
        ov.finish()
        yield
        return _reduce_recv(bufs, h, part=part_RD, blk=h.dense, dense=h.dense)
    if ov is not None:
        ov.finish()
    if h.dense:  # the copy-engine row form: partial rows by copy engines, summed block by block as they land
        _ce_ready(bufs)
        done = _ce_send_partials(bufs, part_RD, h)
        yield
        out = _reduce_recv(bufs, h, part=part_RD, blk=True, dense=True)
        if done is not None:
            torch.cuda.current_stream(bufs.device).wait_event(done)
        return out
    return (yield from _reduce_steps(bufs, part_RD, h, gated=False, rows=True))


def combine_rows_grad_steps(bufs: SymmBuffers, g_TD: torch.Tensor, h: SymmHandle) -> Steps:
    """Backward of :func:`combine_rows_steps`: ``g_part[r] = g_TD[token of r]`` on every rank r
    went to: the token rows travel as in dispatch; returns ``g_part_RD`` (a copy of the receive rows)."""
    L = bufs.layout
    g_part = torch.empty(L.recv_rows, L.hidden, dtype=L.dtype, device=bufs.device)
    # waits first; this rank's own rows go straight to g_part
    _send_tokens(bufs, g_TD, h.send_row_TW, None, None, None, None, with_meta=False, own_rows=g_part,
                 rows_from=h.rows_from_W, dense=h.dense)
    yield
    scratch = torch.empty(max(1, h.num_recv_rows), dtype=torch.int32, device=bufs.device)
    # waits for every row, copies the other sources' out, then ends the op (indices go to scratch)
    _expand(bufs, g_part, scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, None, from_meta=False,
            gate_grad=False, n_exp=h.num_recv_rows, copy=False, end=True, recv_copy=True)
    return g_part


def dispatch_rows_grad_steps(bufs: SymmBuffers, g_RD: torch.Tensor, g_gate_N: Optional[torch.Tensor],
                             h: SymmHandle) -> Steps:
    """Backward of ``dispatch_steps(rows=True)``: ``g_TD[t] = sum over ranks of g_RD[row of t]``
    and, with ``g_gate_N``, ``g_gate[t, k] = g_gate_N[expanded row of (t, k)]`` (fp32) sent home;
    returns ``(g_TD, g_gate_TK or None)``."""
    g_RD = _reduce_send(bufs, g_RD, h, gated=False, rows=True)  # waits for every peer's readiness first
    if g_gate_N is not None:
        scratch = torch.empty(max(1, h.num_recv_rows), dtype=torch.int32, device=bufs.device)
        g = g_gate_N.to(_acc_dtype(bufs.layout.dtype)).contiguous()
        _expand(bufs, bufs.recv_rows(), scratch, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, g, from_meta=False,
                gate_grad=True, n_exp=h.num_recv_rows, copy=False, dgate_given=True, wait_rows=False)
    yield
    g_TD = _reduce_recv(bufs, h, end=g_gate_N is None, part=g_RD)
    return g_TD, (_gate_grad_recv(bufs, h) if g_gate_N is not None else None)


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
    def forward(ctx, x_TD, idx_TK, gate_TK, bufs, capacity):
        x_exp, h = run_steps(dispatch_steps(bufs, x_TD, idx_TK, gate_TK, capacity))
        ctx.h = h
        return x_exp, h

    @staticmethod
    def backward(ctx, g_exp, _g_handle):
        h = ctx.h
        return run_steps(combine_grad_steps(h.buffers, g_exp, h)), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, gate_TK, h):
        ctx.h = h
        ctx.gate_dtype = gate_TK.dtype if gate_TK is not None else None
        ctx.save_for_backward(y_ND)
        return run_steps(combine_steps(h.buffers, y_ND, h))

    @staticmethod
    def backward(ctx, g_TD):
        (y_ND,) = ctx.saved_tensors
        h = ctx.h
        g_y, g_gate = run_steps(dispatch_grad_steps(h.buffers, g_TD.contiguous(), y_ND, h))
        return g_y, (g_gate.to(ctx.gate_dtype) if ctx.gate_dtype is not None else None), None


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, gate_TK, idx_TK, bufs, capacity, region=None, overlap=False):
        recv_RD, src_N, gate_N, h = run_steps(dispatch_steps(bufs, x_TD, idx_TK, gate_TK, capacity, rows=True,
                                                             region=region, overlap=overlap))
        ctx.h, ctx.gate_dtype = h, gate_TK.dtype
        ctx.mark_non_differentiable(src_N)
        return recv_RD, src_N, gate_N, h

    @staticmethod
    def backward(ctx, g_RD, _g_src, g_gate_N, _g_handle):
        h = ctx.h
        if g_RD is None:
            g_RD = torch.zeros(h.buffers.layout.recv_rows, h.buffers.layout.hidden, dtype=h.buffers.layout.dtype,
                               device=h.buffers.device)
        g_TD, g_gate = run_steps(dispatch_rows_grad_steps(h.buffers, g_RD, g_gate_N, h))
        return g_TD, (g_gate.to(ctx.gate_dtype) if g_gate is not None else None), None, None, None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part_RD, h):
        ctx.h = h
        return run_steps(combine_rows_steps(h.buffers, part_RD, h))

    @staticmethod
    def backward(ctx, g_TD):
        h = ctx.h
        return run_steps(combine_rows_grad_steps(h.buffers, g_TD.contiguous(), h)), None


_EP_BUFFERS: dict = {}


def ep_buffers(group: Optional[dist.ProcessGroup], max_tokens: int, hidden: int, top_k: int, num_experts: int,
               dtype: torch.dtype, device=None, timeout_s: Optional[float] = None,
               row_regions: int = 0) -> SymmBuffers:
    """The one :class:`SymmBuffers` of an EP group for these sizes: built (collectively) on the
    first call, returned from a cache afterwards, so every layer of a model shares it. Every rank
    of ``group`` must call it with the same arguments. ``close()`` on the result frees it (the
    next call builds a new set)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    key = (id(group), max_tokens, hidden, top_k, num_experts, dtype, str(device), timeout_s, row_regions)
    bufs = _EP_BUFFERS.get(key)
    if bufs is None or bufs.closed:
        bufs = SymmBuffers(max_tokens, hidden, top_k, num_experts, dtype, group, device=device, timeout_s=timeout_s,
                           row_regions=row_regions)
        _EP_BUFFERS[key] = bufs
    return bufs


class SymmDispatcher(Dispatcher):
    """Deduplicated dispatch/combine through symmetric memory (see the module docstring).

    Args:
        num_experts: E.
        group: the EP process group (``None``: one rank).
        buffers: the group's :class:`SymmBuffers` (:func:`ep_buffers`); when omitted they are taken
            from :func:`ep_buffers` on the first dispatch, sized by ``max_tokens`` (or the largest
            first T over the group: one host sync, once).
        capacity: expanded rows per rank: ``"exact"`` (default; one host sync per dispatch),
            ``"worst"``, a float factor of ``T_max*K``, or an int (see the module docstring).
        timeout_s: how long a wait spins before it records an error (default 30 s).
        validate: check expert ids (syncs the host).
        row_regions: per-layer receive regions for the row form (default 0: none): each layer that
            claims one (:meth:`claim_rows_region`; ``MoELayer`` does at construction) gets its
            dispatched rows left where they land, read there by its fused GEMMs (no receive-side
            copy, no per-step ``[W*T_max, D]`` allocation). Peers may overwrite a region once this
            rank has ended the op before the next dispatch into it, so every reader of a layer's
            rows must be enqueued before that op ends: true in a forward/backward step (each
            layer's backward ends with the dispatch's backward op, after its weight gradients), with
            gradient accumulation and with recomputation; not for a layer whose forward runs twice
            before its backward (pipeline-parallel micro-batches in flight) -- that raises in the
            backward (each dispatch bumps the region's autograd version). Peer pointers only (the
            NVSHMEM route copies as before and reserves none). Costs ``row_regions * W*T_max*D``
            elements of symmetric memory per rank; every rank must claim the same regions (checked
            once, at the first dispatch).
        overlap: the arrival-driven overlap of the fused EP pipeline (peer pointers, a layer with a
            receive region, a static ``capacity``; elsewhere it does nothing): a row-form dispatch
            ends once every peer's META and gates landed; the peers' rows follow on a side stream
            (``TLX_DIST_EP_OVERLAP_SMS`` SMs, default 32) while the gate/up GEMM computes this
            rank's own rows on the other SMs, then waits for them (``RowsOverlap``).
        copy_engine: the copy-engine row form (``"auto"``, default; ``True``; ``False``): a row-form
            dispatch into a receive region with a static ``capacity`` and its combine move the rows
            by the GPU's copy engines (``cuMemcpyAsync`` into the peer's region) in the dense
            layout -- every token's row goes to every peer, the routing rides in META -- instead of
            SM stores: ~380-391 GB/s per direction on two H200s against 363-366, and no SM busy
            with the transfer. ``"auto"``: on over peer pointers on CUDA when ``max_tokens >= 4096``
            and a token reaches each peer with probability >= 0.95 under uniform routing (W=2 at
            E=64, K=8); ``True``: wherever copies can be issued (also the emulated world); never on
            the NVSHMEM route or ROCm. Set on the buffer set (``TLX_DIST_COPY_ENGINE`` where left
            ``"auto"``); every rank must agree.
    """

    def __init__(self, num_experts: int, group: Optional[dist.ProcessGroup] = None, *,
                 buffers: Optional[SymmBuffers] = None, max_tokens: Optional[int] = None,
                 capacity: Capacity = "exact", timeout_s: Optional[float] = None, validate: bool = True,
                 row_regions: int = 0, overlap: bool = False, copy_engine: Union[str, bool] = "auto", **removed):
        if "bulk_send" in removed:
            raise TypeError("SymmDispatcher(bulk_send=...) was removed: the bulk-copy send moved rows no faster than "
                            "the register copy (docs/decisions.md); drop the argument")
        if removed:
            raise TypeError(f"SymmDispatcher() got unexpected keyword argument(s) {sorted(removed)}")
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
        if isinstance(row_regions, bool) or not isinstance(row_regions, int) or row_regions < 0:
            raise ValueError(f"row_regions={row_regions!r} must be a non-negative int")
        if buffers is not None and buffers.layout.row_regions < row_regions:
            raise ValueError(f"buffers hold {buffers.layout.row_regions} row regions, fewer than row_regions="
                             f"{row_regions}: build them with SymmBuffers(row_regions=...) / ep_buffers(row_regions=...)")
        self.group = group
        self.buffers = buffers
        self.max_tokens = max_tokens
        self.capacity = check_capacity(capacity)
        self.timeout_s = timeout_s
        self.row_regions = row_regions
        self._claimed_regions = 0
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap={overlap!r} must be a bool")
        self.overlap = overlap
        if copy_engine not in ("auto", True, False) or (not isinstance(copy_engine, (str, bool))):
            raise ValueError(f"copy_engine={copy_engine!r} must be 'auto', True or False")
        self.copy_engine = copy_engine
        if buffers is not None and copy_engine != "auto":
            _set_copy_engine(buffers, copy_engine)

    def claim_rows_region(self) -> Optional[int]:
        """The next free per-layer receive region (``row_regions``), or None when none is left (the
        layer then gets copies). Claims are made in model-construction order, the same on every rank."""
        if self._claimed_regions >= self.row_regions:
            return None
        self._claimed_regions += 1
        return self._claimed_regions - 1

    def _check_claims(self) -> None:
        """Every rank must have handed out the same regions (the senders store a layer's rows at
        its region's offset on the receiver): one collective when the buffers are first needed."""
        if self.row_regions == 0 or self.group is None or dist.get_world_size(self.group) == 1:
            return
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([self._claimed_regions, -self._claimed_regions], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            raise RuntimeError(f"ranks claimed different numbers of receive regions ({lo} to {hi}; this rank "
                               f"{self._claimed_regions}): every rank must build the same MoE layers in the same order")

    def _buffers_for(self, x_TD: torch.Tensor, K: int) -> SymmBuffers:
        if self.buffers is None:
            self._check_claims()
            T = self.max_tokens
            if T is None:
                t = torch.tensor([max(1, x_TD.shape[0])], device=x_TD.device)
                if self.group is not None:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                T = int(t.item())  # one-time setup sync
            self.buffers = ep_buffers(self.group, T, x_TD.shape[1], K, self.num_experts, x_TD.dtype,
                                      device=x_TD.device, timeout_s=self.timeout_s, row_regions=self.row_regions)
        if self.copy_engine != "auto":
            _set_copy_engine(self.buffers, self.copy_engine)
        return self.buffers

    def dispatch(self, x_TD, idx_TK, gate_TK=None):
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        if gate_TK is not None and (not isinstance(gate_TK, torch.Tensor) or gate_TK.shape != idx_TK.shape):
            raise ValueError(f"gate_TK must be a tensor of idx_TK's shape {tuple(idx_TK.shape)}, "
                             f"got {getattr(gate_TK, 'shape', type(gate_TK))}")
        bufs = self._buffers_for(x_TD, idx_TK.shape[1])
        return _Dispatch.apply(x_TD, idx_TK, gate_TK, bufs, self.capacity)

    def dispatch_rows(self, x_TD, idx_TK, gate_TK, region: Optional[int] = None):
        """The fused EP pipeline's dispatch: the token rows cross once per destination rank and
        stay as received (no expert-major copy). Returns ``(recv_RD, src_N, gate_N, handle)``:
        ``recv_RD`` ``[W*T_max, D]`` receive rows, ``src_N`` ``[N]`` int32 receive row of each
        expanded (expert-major) row, ``gate_N`` ``[N]`` fp32 its gate, differentiable back to
        ``x_TD`` and ``gate_TK``; ``handle.offsets_e`` are the local experts' end rows. Feed them to
        :func:`tlx_dist.fused.fused_experts_rows` with ``dst_N = src_N`` and
        ``num_dst = recv_RD.shape[0]``, then :meth:`combine_rows`. ``region`` (from
        :meth:`claim_rows_region`): ``recv_RD`` is that per-layer receive region, where the rows
        landed (no copy; valid until the next dispatch into it). With ``overlap`` (and a region, a
        static capacity, peer pointers) the peers' rows may still be landing on return: pass
        ``handle.overlap`` to ``fused_experts_rows(overlap=...)`` (or call ``handle.overlap.wait()``
        before reading ``recv_RD``); :meth:`combine_rows` must follow (it joins the side stream)."""
        check_dispatch_args(x_TD, idx_TK, self.num_experts, self.validate)
        if not isinstance(gate_TK, torch.Tensor) or gate_TK.shape != idx_TK.shape or not gate_TK.is_floating_point():
            raise ValueError(f"gate_TK must be a float tensor of idx_TK's shape {tuple(idx_TK.shape)}, "
                             f"got {getattr(gate_TK, 'shape', type(gate_TK))}")
        bufs = self._buffers_for(x_TD, idx_TK.shape[1])
        return _DispatchRows.apply(x_TD, gate_TK, idx_TK, bufs, self.capacity, region, self.overlap)

    def combine_rows(self, part_RD, handle):
        """``out_TD[t] = sum over the ranks t went to of part_RD[row of t there]`` (fp32, one
        rounding); differentiable in ``part_RD``. ``part_RD``: ``[W*T_max, D]``, row r the
        gate-weighted sum of this rank's experts for receive row r."""
        if not isinstance(handle, SymmHandle):
            raise TypeError(f"handle must come from SymmDispatcher.dispatch_rows, got {type(handle).__name__}")
        L = handle.buffers.layout
        if not isinstance(part_RD, torch.Tensor) or part_RD.shape != (L.recv_rows, L.hidden) or part_RD.dtype != L.dtype:
            raise ValueError(f"part_RD must be [{L.recv_rows}, {L.hidden}] {L.dtype}, got "
                             f"{tuple(getattr(part_RD, 'shape', ()))} {getattr(part_RD, 'dtype', type(part_RD))}")
        return _CombineRows.apply(part_RD, handle)

    def combine(self, y_ND, handle):
        raise NotImplementedError("SymmDispatcher returns one row per token (the gate-weighted sum over its "
                                  "experts, summed where they live): use combine_weighted(y_ND, handle, gate_TK)")

    def combine_weighted(self, y_ND, handle, gate_TK):
        self._check_combine(y_ND, handle)
        if not isinstance(handle, SymmHandle):
            raise TypeError(f"handle must come from SymmDispatcher.dispatch, got {type(handle).__name__}")
        L = handle.buffers.layout
        if y_ND.dtype != L.dtype or y_ND.shape[1] != L.hidden:
            raise ValueError(f"y_ND must be [N, {L.hidden}] {L.dtype}, got {tuple(y_ND.shape)} {y_ND.dtype}")
        if gate_TK is not handle.gate_TK:
            raise ValueError("gate_TK must be the tensor given to dispatch: its gates travelled with the tokens "
                             "and are applied where the experts live")
        return _Combine.apply(y_ND, gate_TK, handle)

    def check(self, capacity_hint: str = "the dispatcher's capacity") -> None:
        """Raises if a wait gave up or expanded rows overflowed (host sync; see SymmBuffers.check)."""
        if self.buffers is not None:
            self.buffers.check(capacity_hint)

    def extra_repr(self) -> Optional[str]:
        return f"{super().extra_repr()}, capacity={self.capacity!r}, buffers={self.buffers!r}"
