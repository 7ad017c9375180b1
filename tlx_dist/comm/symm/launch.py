"""Launch wrappers of the exchange's phase kernels (``tlx/comm/exchange.py``): each checks nothing
the phase generators did not, builds the kernel's constexprs from the buffers' layout, picks its
launch shape (``tuning.py``) and form (``policy.py``) and launches it on the current stream."""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import tuning
from .buffers import SymmBuffers
from .handle import SymmHandle
from .policy import _recv_mode
from .tuning import (CE_SUM_PER_SM, ROUTE_SMALL_T, _comb_recv_shape, _grid, _next_pow2,
                     _num_programs, _recv_programs, _recv_tile, _shape)


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


def _comb_meta(bufs: SymmBuffers) -> dict:
    L = bufs.layout
    return dict(OFF_CBLK=L.off_cblk, CB=L.comb_block, NCB=L.comb_blocks)


def _blk_meta(bufs: SymmBuffers) -> dict:
    L = bufs.layout
    return dict(OFF_RBLK=L.off_rblk, RB=L.recv_block, NRB=L.recv_blocks)


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


_ROUTE_AGG_ONLY = False  # tests: force the route kernel's look-back through every aggregate
_ROUTE_BLOCK_T = 0  # tests: tokens per route block (a power of two; 0 = automatic) to span many blocks


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
    bt = _ROUTE_BLOCK_T or (tuning.LAUNCH_OVERRIDES.get("route") or {}).get("BLOCK_ROWS") \
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
        per_sm = (tuning.LAUNCH_OVERRIDES.get("ce") or {}).get("sum_per_sm", CE_SUM_PER_SM)
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
