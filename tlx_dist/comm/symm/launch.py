"""Launch wrappers of the exchange's phase kernels (``tlx/comm/exchange.py``): each builds its kernel's
constexprs from the buffers' layout (the bundles below: one per part of the symmetric region a
kernel touches), takes its launch shape from ``tuning.py`` and its form from ``policy.py``, and
launches on the current stream. They know one rank and its peer table, never the world's shape
beyond W: a peer is a pointer (or, on the NVSHMEM route, a PE), whatever node it sits on.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .buffers import SymmBuffers, SymmLayout
from .handle import SymmHandle
from .policy import recv_mode
from .tuning import (_grid, _next_pow2, comb_recv_shape, launch_shape, recv_role_grid, recv_tile, reduce_recv_shape,
                     route_block)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def clock() -> int:
    """CLOCK constexpr of the waiting kernels (``tlx/comm/protocol.py``): poll count in the
    interpreter, %globaltimer on NVIDIA, s_memrealtime on AMD."""
    if _interpreting():
        return 0
    return 2 if torch.version.hip else 1


def kernels(device: torch.device):
    """``tlx/comm/exchange.py`` (imported on first use). Triton fixes compiled vs interpreted when
    the kernels are decorated, from ``TRITON_INTERPRET``: CPU tensors need it set, CUDA ones unset."""
    if (device.type == "cpu") != _interpreting():
        raise ValueError(f"symmetric dispatch on {device.type} tensors needs TRITON_INTERPRET="
                         f"{'1' if device.type == 'cpu' else '0'} (it is {os.environ.get('TRITON_INTERPRET')!r})")
    from tlx.comm import exchange
    return exchange


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of sums over k, ranks and D: fp32 (fp64 for fp64 rows)."""
    return torch.promote_types(dtype, torch.float32)


def _send_launch(bufs: SymmBuffers, kernel, grid, *args, sends: bool = True, **meta) -> None:
    """Launches a kernel that may send to peers (``sends``: this launch does); when some peer is on
    another node, its USE_NVSHMEM variant, linked with NVSHMEM's device library (``nvshmem_meta``)."""
    kernel[grid](*args, **meta, **(bufs.nvshmem_meta(kernel) if sends else {}))


# ---------------------------------------------------------------- constexpr bundles

def _wait(bufs: SymmBuffers) -> dict:
    """Every bounded wait: the error word's STATE, the timeout, the clock."""
    return dict(OFF_STATE=bufs.layout.off_state, TIMEOUT_NS=bufs.timeout_ns, CLOCK=clock())


def _common(bufs: SymmBuffers) -> dict:
    """Kernels that wait for ARRIVE counts and accumulate (expand, reduce-receive)."""
    import triton.language as tl
    L = bufs.layout
    return dict(W=L.world_size, OFF_ARRIVE=L.off_arrive, ACC=tl.float64 if L.dtype == torch.float64 else tl.float32,
                **_wait(bufs))


def _await_meta(bufs: SymmBuffers) -> dict:
    """A kernel that starts with ``_await`` (BARRIER=True): an op's first data kernel."""
    return dict(BARRIER=True, OFF_FLAGS=bufs.layout.off_flags, **_wait(bufs))


def _end_meta(bufs: SymmBuffers) -> dict:
    """An op's last kernel (END=True): its last CTA raises this rank's readiness for the next op
    (``_end_op``), which the next op's first kernel waits for on every peer."""
    L = bufs.layout
    return dict(END=True, WP3=_next_pow2(3 * L.world_size), OFF_FLAGS=L.off_flags)


def _counts(L: SymmLayout) -> dict:
    """COUNTS (the per-source count vectors) and the expert layout read from them."""
    return dict(E=L.num_experts, EP=_next_pow2(L.num_experts), NC=L.num_counts, OFF_COUNTS=L.off_counts)


def _rows(L: SymmLayout) -> dict:
    """The token rows' regions: RECV and its META / GATES, at K slots a row."""
    return dict(WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k), D=L.hidden, T_MAX=L.max_tokens,
                META_W=L.meta_words, OFF_META=L.off_meta, OFF_GATES=L.off_gates, OFF_RECV=L.off_recv)


def _comb_blocks(L: SymmLayout) -> dict:
    """CBLK: the combine's per-token-block arrival counters."""
    return dict(OFF_CBLK=L.off_cblk, CB=L.comb_block, NCB=L.comb_blocks)


def _recv_blocks(L: SymmLayout) -> dict:
    """RBLK: the row form's per-receive-block arrival counters."""
    return dict(OFF_RBLK=L.off_rblk, RB=L.recv_block, NRB=L.recv_blocks)


def rcnt_off(L: SymmLayout, region: int) -> int:
    """Byte offset of RCNT[region, 0] (the overlapped and copy-engine row forms' region counters)."""
    return L.off_rcnt + region * L.world_size * 8


def on_side(bufs: SymmBuffers, launch, *keep: torch.Tensor) -> Optional[torch.cuda.Event]:
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


# ---------------------------------------------------------------- the phase kernels

def route(bufs: SymmBuffers, idx_TK: torch.Tensor, dense: bool = False):
    """Source-side layout and the dispatch's signal in one launch (``_route_kernel``, a single-pass
    scan over token blocks): returns ``q_TK`` (rank of each slot among this rank's slots of its
    expert), ``send_row_TW``, ``counts_C`` = ``[slots per expert | token rows per rank]`` (int64)."""
    L, k = bufs.layout, kernels(bufs.device)
    T, K = idx_TK.shape
    W, E, NC = L.world_size, L.num_experts, L.num_counts
    dev = idx_TK.device
    EP, KP, WP = _next_pow2(E), _next_pow2(K), _next_pow2(W)
    bt = route_block(bufs, T, KP)
    nb = max(1, -(-T // bt))
    nb_max = max(1, -(-L.max_tokens // bt))
    idx = idx_TK if idx_TK.is_contiguous() else idx_TK.contiguous()
    q_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    dest_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    send_row_TW = torch.empty(T, W, dtype=torch.int32, device=dev)
    counts_C = torch.empty(NC, dtype=torch.int64, device=dev)  # the last block writes all NC (zeros for T = 0)
    _send_launch(bufs, k._route_kernel, (nb,), idx, bufs.route_scratch(nb_max, EP + WP), q_TK, dest_TK, send_row_TW,
                 counts_C, T, nb_max, bufs.peers, bufs.rank, K=K, KP=KP, W=W, WP=WP, E_LOCAL=E // W,
                 NCP=_next_pow2(NC), BLOCK_T=bt, OFF_FLAGS=L.off_flags, **_counts(L), **_wait(bufs),
                 **({"AGG_ONLY": True} if bufs.config.route_agg_only else {}), **({"DENSE": True} if dense else {}))
    return q_TK, send_row_TW, counts_C


def rows_wait(bufs: SymmBuffers, region: int, rows_from_W: torch.Tensor) -> None:
    """The overlapped and copy-engine row forms' arrival wait for region ``region`` (one program, on
    the current stream): every peer's rows landed, then taken off the region counters."""
    L = bufs.layout
    kernels(bufs.device)._rows_wait_kernel[(1,)](rows_from_W, bufs.peers, bufs.rank, rcnt_off(L, region),
                                                 W=L.world_size, num_warps=1, **_wait(bufs))


def _send_rows_meta(bufs: SymmBuffers, T: int, bt: int, grid, own_rows, region, split, programs, rows_from):
    """The send's row-form constexprs and grid. A receive region: the rows go to every
    destination's region and stay there (SPLIT: the overlapped form's halves; the second, outside
    the op, on ``programs`` programs with region-counter adds). Else the row form's receive copy
    (``recv_mode``): block signals, and in "overlap" mode this launch's last programs copy the
    other sources' rows as they land (``rows_from``: how many to expect from each)."""
    L = bufs.layout
    if own_rows is None:
        return {}, grid
    meta = dict(OWN_ADDR=own_rows.data_ptr(), LOCAL_ROWS=True)
    if region is not None:
        meta.update(ROWS_REGION=True, ROWS_OFF=L.off_rows + region * L.rows_region_bytes,
                    **({"SPLIT": split} if split else {}))
        if split == 2:
            meta["RCNT_OFF"] = rcnt_off(L, region)
            grid = (max(1, min(-(-T // bt), programs)),)
        return meta, grid
    mode = recv_mode(bufs)
    if mode != "after":
        meta.update(BLK_SIGNAL=True, **_recv_blocks(L))
    if mode == "overlap":
        if rows_from is None:
            raise ValueError("the overlapped receive copy needs rows_from (rows from each source)")
        n_send, n_recv = recv_role_grid(bufs, T, bt)
        meta.update(RECV_ROLE=True, N_SEND=n_send, rows_from_ptr=rows_from, **recv_tile(bufs))
        grid = (n_send + n_recv,)
    return meta, grid


def send_tokens(bufs, x_TD, send_row_TW, idx_TK, q_TK, lay, gate_TK, with_meta: bool, offs=None,
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
    (``lay`` / ``offs`` are then left to ``expand(layout=...)``). ``rows_from``, ``region``,
    ``split``, ``programs``: the row form's receive side (``_send_rows_meta``); ``dense``: the
    copy-engine row form's dense layout."""
    L, k = bufs.layout, kernels(bufs.device)
    T, D = x_TD.shape
    if x_TD.stride(-1) != 1:
        if skip_own:
            raise ValueError("skip_own needs row-contiguous x_TD (the expand kernel reads this rank's rows there)")
        x_TD = x_TD.contiguous()
    bt, bd, warps, grid = launch_shape(bufs.config.send, D, T, bufs.device)
    rows_meta, grid = _send_rows_meta(bufs, T, bt, grid, own_rows, region, split, programs, rows_from)
    dummy = send_row_TW
    meta = dict(W=L.world_size, E_LOCAL=L.num_experts // L.world_size, OFF_ARRIVE=L.off_arrive, **_rows(L),
                **_counts(L), WITH_META=with_meta, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps,
                offs_ptr=offs if with_meta else dummy, OFFS_CAP=-1 if offs_cap is None else offs_cap, **rows_meta)
    meta.update(**({"LOCAL_X": True} if skip_own else {}), **({"RAW_META": True} if raw_meta else {}),
                **({"DENSE": True} if dense else {}), **({} if split == 2 else _await_meta(bufs)))
    _send_launch(bufs, k._send_tokens_kernel, grid,
                 x_TD, x_TD.stride(0), T, send_row_TW, idx_TK if with_meta else dummy, q_TK if with_meta else dummy,
                 lay if with_meta else dummy, gate_TK if with_meta else dummy, bufs.peers, bufs.rank, **meta)


def expand(bufs, out_ND, src_map_N, pos_RK, gate_RK, tok_R, rows_from_W, y_ND, from_meta: bool, gate_grad: bool,
           n_exp: Optional[int] = None, gate_N: Optional[torch.Tensor] = None, copy: bool = True,
           dgate_given: bool = False, wait_rows: bool = True, end: bool = False, recv_copy: bool = False,
           src_row_N: Optional[torch.Tensor] = None,
           x_own: Optional[torch.Tensor] = None, layout: Optional[tuple] = None):
    """``_expand_kernel``. ``copy=False`` (with ``n_exp`` expanded rows) is the fused-EP form: only
    the index maps (and ``gate_N``, or given gate gradients ``y_ND``) move, and ``out_ND`` is written
    only with ``recv_copy`` (the other sources' receive rows into ``[W*T_max, D]``, whose own-rank
    rows ``send_tokens(own_rows=out_ND)`` stored); ``x_own``: the rows this rank
    sent with ``send_tokens(skip_own=True)``, read there for its own tokens; ``end``: the op's last kernel;
    ``layout`` = ``(lay, offs, offs_cap)`` after a ``raw_meta`` send: this kernel waits for the
    counts, computes ``lay`` and ``offs`` (``rows_from_W`` must be ``lay[E+e:]``) and decodes META;
    returns then the ``[W, e]`` int64 first expanded row of each (source, local expert), else None."""
    L, k = bufs.layout, kernels(bufs.device)
    br, bd, warps, grid = launch_shape(bufs.config.expand, L.hidden, L.recv_rows, bufs.device)
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
    mode = recv_mode(bufs)
    if recv_copy and mode != "overlap":  # "overlap": the send kernel copied them
        extra.update(RECV_COPY=True)
        if mode == "blocks":
            extra.update(BLK=True, **_recv_blocks(L))
    if src_row_N is not None:
        extra.update(src_row_ptr=src_row_N, SRC_ROW=True)
    if x_own is not None:
        extra.update(x_ptr=x_own, stride_x=x_own.stride(0), LOCAL_X=True)
    if layout is not None:
        lay, offs, cap = layout
        E, W = L.num_experts, L.world_size
        starts = torch.empty(W * (E // W), dtype=torch.int64, device=lay.device)
        extra.update(LAYOUT=True, lay_ptr=lay, offs_ptr=offs, starts_ptr=starts, E_LOCAL=E // W, OFF_FLAGS=L.off_flags,
                     OFFS_CAP=-1 if cap is None else cap, **_counts(L))
    _send_launch(
        bufs, k._expand_kernel, grid,
        out_ND, src_map_N, pos_RK, gate_RK, tok_R, rows_from_W, y_ND if gate_grad else out_ND, bufs.peers,
        bufs.rank, out_ND.shape[0] if n_exp is None else n_exp, **_rows(L), OFF_DGATE=L.off_dgate,
        FROM_META=from_meta, GATE_GRAD=gate_grad, BLOCK_R=br, BLOCK_D=bd, num_warps=warps, sends=gate_grad or end,
        **_common(bufs), **extra)
    return extra.get("starts_ptr")


def reduce_send(bufs: SymmBuffers, y: torch.Tensor, h: SymmHandle, gated: bool, rows: bool = False,
                programs: Optional[int] = None, blk: bool = False, recv: bool = False):
    """The first kernel of a reducing op: waits for every peer's readiness, then sends partial rows.
    Row form: rows of this rank's own tokens stay in ``y``, which is returned for ``reduce_recv``
    to read them there (the caller keeps it alive until then). ``programs``: at most that many
    (the overlapped combine's SM budget). ``blk``: count the rows into their sources' CBLK
    (``comb_mode`` "blocks" / "overlap") instead of one ARRIVE add per source. ``recv`` (with
    ``blk``, real ranks over peer pointers): this launch also sums this rank's tokens as their
    partial rows land and ends the op -- the whole combine in one launch; returns ``out_TD``."""
    L, k = bufs.layout, kernels(bufs.device)
    y = y if y.is_contiguous() else y.contiguous()
    br, bd, warps, grid = launch_shape(bufs.config.reduce_send, L.hidden, L.recv_rows, bufs.device)
    if programs is not None:
        grid = (max(1, min(grid[0], programs)),)
    extra, out = {}, None
    if blk:
        extra.update(CBLK_SIGNAL=True, **_comb_blocks(L))
    if recv:
        T = h.num_tokens
        n_send, n_recv, rr_t, rr_d = comb_recv_shape(bufs, T)
        out = torch.empty(T, L.hidden, dtype=L.dtype, device=bufs.device)
        extra.update(RECV_ROLE=True, N_RECV=n_recv, out_ptr=out, send_row_ptr=h.send_row_TW, T=T,
                     RR_T=rr_t, RR_D=rr_d, END=True, WP3=_end_meta(bufs)["WP3"],  # (OFF_FLAGS: _await_meta's)
                     **({"PART_ADDR": y.data_ptr()} if rows else {}))
        grid = (min(grid[0], n_send) + n_recv,)
    _send_launch(bufs, k._reduce_send_kernel, grid,
                 y, h.pos_RK, h.gate_RK, h.tok_R, h.rows_from_W, bufs.peers, bufs.rank, h.num_recv_rows,
                 W=L.world_size, WP=_next_pow2(L.world_size), K=L.top_k, KP=_next_pow2(L.top_k), D=L.hidden,
                 T_MAX=L.max_tokens, OFF_ARRIVE=L.off_arrive, OFF_COMB=L.off_comb, GATED=gated,
                 ACC=_common(bufs)["ACC"], BLOCK_R=br, BLOCK_D=bd, num_warps=warps, **({"ROWS": True} if rows else {}),
                 **_await_meta(bufs), **extra)
    return out if recv else y


def reduce_recv(bufs: SymmBuffers, h: SymmHandle, end: bool = True, part: Optional[torch.Tensor] = None,
                blk: bool = False, dense: bool = False) -> torch.Tensor:
    """The last kernel of a reducing op: the per-rank partial rows of each token, summed. ``part``:
    the row form's ``[W*T_max, D]`` partial rows, where this rank's own ones are read. ``blk``: the
    reduce-send counted its rows into CBLK (wait per token block, not for ARRIVE). ``dense``: the
    copy-engine row form, whose counts come from one-program signal kernels on another stream
    (``tuning.reduce_recv_shape``)."""
    L, k = bufs.layout, kernels(bufs.device)
    T = h.num_tokens
    br, bd, warps, grid = reduce_recv_shape(bufs, T, blk, dense)
    out = torch.empty(T, L.hidden, dtype=L.dtype, device=bufs.device)
    _send_launch(bufs, k._reduce_recv_kernel, grid,
                 out, h.send_row_TW, h.rows_to_W, bufs.peers, bufs.rank, T, WP=_next_pow2(L.world_size), D=L.hidden,
                 OFF_COMB=L.off_comb, BLOCK_T=br, BLOCK_D=bd, num_warps=warps, sends=end, **_common(bufs),
                 **(_end_meta(bufs) if end else {}),
                 **(dict(PART_ADDR=part.data_ptr(), LOCAL_ROWS=True) if part is not None else {}),
                 T_MAX=L.max_tokens,  # (COMB rows are [W, T_max])
                 **(dict(BLK=True, **_comb_blocks(L)) if blk else {}), **({"DENSE": True} if dense else {}))
    return out


def gate_grad_recv(bufs: SymmBuffers, h: SymmHandle, end: bool = True) -> torch.Tensor:
    """The last kernel of combine's backward: the gate gradients every rank answered, ``[T, K]``
    fp32 (fp64 for fp64 rows)."""
    L, k = bufs.layout, kernels(bufs.device)
    S = h.num_tokens * h.top_k
    g_gate = torch.empty(S, dtype=acc_dtype(L.dtype), device=bufs.device)
    _send_launch(bufs, k._gate_grad_recv_kernel, _grid(-(-S // 1024), bufs.device),
                 g_gate, h.rows_to_W, bufs.peers, bufs.rank, S, W=L.world_size, OFF_ARRIVE=L.off_arrive,
                 OFF_DGATE=L.off_dgate, BLOCK=1024, sends=end, **_wait(bufs), **(_end_meta(bufs) if end else {}))
    return g_gate.view(h.num_tokens, h.top_k)
