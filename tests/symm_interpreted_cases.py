"""Symmetric-memory dispatch/combine on CPU: the real tlx/comm kernels under TRITON_INTERPRET=1
in an emulated world of W virtual ranks (tier T4 logic on CPU), against a brute-force oracle and
against AllToAllDispatcher on gloo; plus sizing, capacity overflow, topology and bad input.

Dispatch moves bits, so its rows are compared exactly (torch.equal). Combine sums a token's slots
per owning rank and then over ranks, an order the brute-force formulas do not share: fp64 results
are compared at rtol 1e-12 (a few ulps of a sum of <= K terms), lower precisions with the bf16
k-sum rule of tlx_dist.testing."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from _dist import run_world  # noqa: E402
from test_dispatch import _brute_force_receive, _routing  # noqa: E402
from tlx_dist.comm import AllToAllDispatcher, LocalDispatcher  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch  # noqa: E402
from tlx_dist.comm.symm import ExchangeConfig, SymmDispatcher, SymmHandle, Tile  # noqa: E402
from tlx_dist.comm.symm.buffers import ExchangeError, SymmBuffers, SymmLayout  # noqa: E402
from tlx_dist.comm.topology import Topology  # noqa: E402

# Triton fixes interpret-or-compile per kernel when it is decorated, for the whole process, so this
# module runs in a child pytest with TRITON_INTERPRET=1, started by tests/test_symm_interpreted.py
# (its name keeps pytest from collecting it in the parent, which stays on the real compiler).
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


def _kind_routing(seed, T, K, E, W, kind):
    g = torch.Generator().manual_seed(seed)
    if kind == "zero_token_experts":  # only even experts are ever chosen: odd experts get 0 rows
        idx = torch.stack([torch.randperm(E // 2, generator=g)[:K] * 2 for _ in range(T)])
    elif kind == "heavy_imbalance":  # every token sends all K slots to rank 0's experts
        idx = torch.stack([torch.randperm(E // W, generator=g)[:K] for _ in range(T)])
    else:
        idx = _routing(seed, T, K, E, kind)
    return idx.long()


def _close(a, b, what):
    if a.dtype == torch.float64:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=what)
    else:  # one rounding of an fp32 sum vs the formula's: a couple of ulps of the dtype
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[a.dtype]
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=what)


def _owner_scaled(x, idx, e, dtype):
    """``y[t, k] = x[t] * (1 + owner rank of slot (t, k))``: what each rank's "experts" return below."""
    return x[:, None, :] * (1 + idx // e)[..., None].to(dtype)


def _check_world(W, E, K, Ts, D, kind, dtype=torch.float64, config=None):
    """Dispatch, combine and both gradient ops of an emulated world (``config``: its ExchangeConfig)
    vs the oracles."""
    world = EmulatedWorld(W, max(max(Ts), 1), D, K, E, dtype, device="cpu", config=config)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(T, D, generator=gen).to(dtype) for T in Ts]
    idxs = [_kind_routing(10 + s, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
            for s, T in enumerate(Ts)]
    gates = [torch.rand(T, K, generator=gen).to(dtype) for T in Ts]
    res = world.dispatch(xs, idxs, gates)
    ref = reference_dispatch(xs, idxs, E)
    small = sum(Ts) * K <= 200
    brute = _brute_force_receive(xs, idxs, E, W) if small else None
    e = E // W
    for d, (x_exp, h) in enumerate(res):
        rows, cnt = ref[d]
        n = rows.shape[0]
        assert isinstance(h, SymmHandle) and h.num_recv_rows == x_exp.shape[0] == world.buffers[d].layout.worst_case_rows
        assert h.offsets_e.dtype == torch.int32 and h.offsets_e.tolist() == cnt.cumsum(0).tolist(), f"{kind} rank {d}"
        assert torch.equal(x_exp[:n], rows), f"{kind}: rank {d} expanded the wrong rows"
        if brute is not None:
            assert torch.equal(x_exp[:n], brute[d])
        # Deduplicated: a token crosses to rank d once, however many of d's experts it picked.
        distinct = [int((idx // e == d).any(1).sum()) for idx in idxs]
        assert h.rows_from_W.tolist() == distinct, f"{kind}: rank {d} received {h.rows_from_W.tolist()} rows"
        # src_map inverts pos: expanded row p came from received row n's slot k with pos[n, k] = p.
        m = h.src_map_N[:n].long()
        assert torch.equal(h.pos_RK.reshape(-1)[m].long(), torch.arange(n)), f"{kind}: src_map on rank {d}"
    for s, (_, h) in enumerate(res):
        assert h.rows_to_W.tolist() == [int((idxs[s] // e == d).any(1).sum()) for d in range(W)]
    # combine: rank d's "experts" return x * (1 + d); the source gets sum_k gate * that.
    ys = [x_exp * (1 + d) for d, (x_exp, _) in enumerate(res)]
    outs = world.combine(ys, [h for _, h in res])
    for s, (x, idx) in enumerate(zip(xs, idxs)):
        expect = (gates[s][..., None] * _owner_scaled(x, idx, e, dtype)).to(dtype).sum(1)
        assert outs[s].shape == x.shape
        _close(outs[s], expect, f"{kind}: combine on rank {s}")
    # combine backward: g_y at each slot's row = gate * g[t]; g_gate = <g[t], y[t, k]>.
    gs = [torch.randn(x.shape[0], D, generator=gen).to(dtype) for x in xs]
    back = world.dispatch_grad(gs, ys, [h for _, h in res])
    slot_rows = reference_dispatch([(gates[s][..., None] * gs[s][:, None, :]).reshape(-1, D) for s in range(W)],
                                   [i.reshape(-1, 1) for i in idxs], E)
    for d, (g_y, _) in enumerate(back):
        n = slot_rows[d][0].shape[0]
        _close(g_y[:n], slot_rows[d][0].to(dtype), f"{kind}: combine backward rows on rank {d}")
    for s, (x, idx) in enumerate(zip(xs, idxs)):
        expect = (gs[s][:, None, :].to(torch.float64) * _owner_scaled(x, idx, e, dtype).to(torch.float64)).sum(-1)
        torch.testing.assert_close(back[s][1].to(torch.float64), expect, rtol=1e-5 if dtype != torch.float64 else 1e-12,
                                   atol=1e-5 if dtype != torch.float64 else 1e-12)
    # dispatch backward: an ungated combine of the expert-row gradients, summed over k.
    g_TD = world.combine_grad([g_y * (1 + d) for d, (g_y, _) in enumerate(back)], [h for _, h in res])
    for s, (x, idx) in enumerate(zip(xs, idxs)):
        expect = (gates[s][..., None] * gs[s][:, None, :] * (1 + idx // e)[..., None].to(dtype)).sum(1)
        _close(g_TD[s], expect, f"{kind}: dispatch backward on rank {s}")
    world.check()
    return world, xs, idxs


_KINDS = ["random", "one_expert", "zero_token_experts", "heavy_imbalance"]


# W = 8 runs two kinds here (the interpreter takes seconds per W = 8 world); the GPU tests run all.
# W = 12: more ranks than the kernels unroll (their W > 8 loops) and not a power of two (WP = 16 masks).
# The W >= 8 worlds are the release tier's (the slowest cases under the interpreter).
@pytest.mark.parametrize("W,kind", [(w, k) for w in (2, 4) for k in _KINDS]
                         + [pytest.param(w, k, marks=pytest.mark.release)
                            for w, k in ((8, "random"), (8, "heavy_imbalance"), (12, "random"))])
def test_emulated_world_matches_oracles(W, kind):
    """Kinds: random top-K; every token's first choice is the last expert (one expert holds a row of
    every token of the world); only even experts used (zero-token experts on every rank);
    everything to rank 0 (the other ranks receive nothing, rank 0 receives W*T*K rows)."""
    E, K, D = 4 * W, 3, 6
    Ts = [3 + 2 * s for s in range(W)]  # unequal T per rank
    _check_world(W, E, K, Ts, D, kind)


def test_emulated_world_more_slots_than_unrolled():
    """K = 10 > 8: the kernels' slot loops stay loops past K = 8 (unrolled below); K close to E."""
    _check_world(2, 12, 10, [5, 4], 6, "random")


def test_emulated_edge_shapes():
    """A rank with zero tokens beside ranks with one; K = e = 1 (one slot per token, one expert per
    rank); odd D in fp32 and bf16; K = E with prime e = 3 < K (a token sends 3 slots to a rank, once)."""
    _check_world(2, 2, 1, [0, 1], 3, "random", torch.float32)
    _check_world(3, 3, 1, [1, 4, 2], 5, "random", torch.bfloat16)
    _check_world(2, 6, 6, [5, 3], 7, "random", torch.float16)


def test_tiles_widen_only_for_few_rows():
    """A sized-per-launch tile (``tuning._tiles``): 8 x 512 at the usual widths once there are enough
    row blocks; wider and shorter tiles (down to 2 x 2048) for few rows; never wider than the row
    needs."""
    from tlx_dist.comm.symm.tuning import _tiles
    assert _tiles(7168) == (8, 512) and _tiles(7168, 2 * 16384) == (8, 512) and _tiles(7168, 2048) == (8, 512)
    assert _tiles(7168, 1024) == (4, 1024)
    assert _tiles(7168, 128) == _tiles(7168, 1) == (2, 2048)
    assert _tiles(2048, 128) == (2, 2048) and _tiles(1024, 128) == (4, 1024)
    assert _tiles(6, 3) == (512, 8) and _tiles(256, 3) == (16, 256)
    # the send kernel starts at 1024 columns (ExchangeConfig().send); small ops widen to the same tiles
    assert _tiles(7168, 2 * 16384, 1024) == (4, 1024) and _tiles(7168, 128, 1024) == (2, 2048)


# release tier, both (minutes of interpreted programs); the row form's short-wide tiles stay fast
# (symm_rows_interpreted_cases.py)
@pytest.mark.release
@pytest.mark.parametrize("tiles", [(2, 16), (1, 32)], ids=["2x16", "1x32"])
def test_emulated_world_short_wide_tiles(monkeypatch, tiles):
    """The row-moving kernels with 2-row, 1-row and multi-chunk tiles whose last column chunk is
    ragged (what tuning._tiles picks for few rows at large D, here forced at a small D)."""
    from tlx_dist.comm.symm import tuning
    monkeypatch.setattr(tuning, "_tiles", lambda D, rows=None, cols=512, t=tiles: t)
    _check_world(2, 8, 3, [5, 4], 40, "random")
    _check_world(4, 8, 2, [3, 0, 4, 2], 40, "heavy_imbalance", torch.bfloat16)


def test_expanded_form_reads_own_rows_from_x(monkeypatch):
    """In the expanded form a rank's own token rows are not copied into its receive region: the
    expand kernel reads them from x (dispatch) and from g (combine's backward). The region's own
    block is poisoned with NaN when the world is built; every result must still match the oracles
    (_check_world) and the block must still be NaN after all four ops."""
    blocks = []
    real_init = EmulatedWorld.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        for d, b in enumerate(self.buffers):
            own = b.recv_rows()[d * b.layout.max_tokens:(d + 1) * b.layout.max_tokens]
            own.fill_(float("nan"))
            blocks.append((d, own))

    monkeypatch.setattr(EmulatedWorld, "__init__", init)
    world, _, _ = _check_world(2, 8, 3, [5, 4], 40, "random")
    world4, _, _ = _check_world(4, 8, 2, [3, 0, 4, 2], 6, "heavy_imbalance")
    world4.close()
    for d, own in blocks:
        assert torch.isnan(own).all(), f"rank {d}: its own rows went through RECV"
    world.close()


@pytest.mark.release  # the look-back over aggregates stays fast (test_route_lookback_through_aggregates)
def test_emulated_many_route_blocks():
    """E = 64, K = 8 at 32 tokens per route block: T = 100 / 70 spans 4 / 3 blocks with a ragged
    last one -- the look-back must carry every block's slots into the next, and a second dispatch
    on the same buffers must not read the first one's block status as ready."""
    cfg = ExchangeConfig(route_block=32)
    world, xs, _ = _check_world(2, 64, 8, [100, 70], 4, "random", config=cfg)
    _check_world(2, 64, 8, [97, 33], 4, "heavy_imbalance", config=cfg)
    for seed in (40, 41):  # later dispatches on the same buffers (their look-back scratch is reused)
        idxs = [_kind_routing(seed + s, x.shape[0], 8, 64, 2, "random") for s, x in enumerate(xs)]
        gates = [torch.rand(x.shape[0], 8, dtype=torch.float64) for x in xs]
        res = world.dispatch(xs, idxs, gates)
        ref = reference_dispatch(xs, idxs, 64)
        for d, (x_exp, h) in enumerate(res):
            rows, cnt = ref[d]
            assert h.offsets_e.tolist() == cnt.cumsum(0).tolist()
            assert torch.equal(x_exp[:rows.shape[0]], rows)
        world.combine([x for x, _ in res], [h for _, h in res])
    world.check()


def test_emulated_world_narrow_chunks_and_route_override():
    """The copying form with a launch shape of its config: the send at a column chunk that does not
    divide D, and 4 tokens per route block, against the oracles."""
    cfg = ExchangeConfig(send=Tile(rows=2, cols=4), route_block=4)
    _check_world(2, 8, 3, [9, 5], 6, "random", config=cfg)
    _check_world(4, 16, 3, [3, 5, 7, 9], 6, "heavy_imbalance", config=cfg)


def test_route_scratch_is_per_layout():
    """The route kernel's look-back scratch: the same layout (blocks, row words) gets the same
    zeroed-once tensor back; another layout (a route block override) gets its own zeroed one, and
    the earlier stays alive (a captured graph may hold its address) -- a reused one would put status
    words where an earlier layout left prefix counts."""
    world = EmulatedWorld(2, 64, 4, 2, 8, torch.float64, device="cpu")
    b = world.buffers[0]
    a1 = b.route_scratch(4, 10)
    a1[:3] = 77
    assert b.route_scratch(4, 10) is a1
    c = b.route_scratch(64, 10)
    assert c is not a1 and int(c.abs().sum()) == 0 and c.numel() == 64 * 21
    assert b.route_scratch(4, 10) is a1 and int(a1[0]) == 77
    world.close()


def test_route_lookback_through_aggregates():
    """The look-back path of concurrent blocks (a predecessor has published only its aggregate), which
    in-order interpretation never takes by itself: forced for every block (``route_agg_only``), the
    layout still equals the oracle's -- and a wrong sum along that path fails here."""
    cfg = ExchangeConfig(route_agg_only=True, route_block=16)  # 7 / 5 blocks
    _check_world(2, 64, 8, [100, 70], 4, "random", config=cfg)
    cfg = ExchangeConfig(route_agg_only=True, route_block=4)  # E = 256, K = 8: 8 / 5 blocks of 32 slots
    _check_world(2, 256, 8, [29, 17], 4, "random", config=cfg)


def test_repeated_ops_reuse_buffers():
    """Several layers share one world: back-to-back dispatches without a combine in between
    (double-buffered counts, epochs, each handle keeps its own copy of the metadata), then the
    combines in reverse order; the epoch counts ops."""
    W, E, K, D, T = 4, 8, 2, 4, 6
    world = EmulatedWorld(W, T, D, K, E, torch.float64, device="cpu")
    layers = []
    for layer in range(3):
        xs = [torch.randn(T, D, dtype=torch.float64) for _ in range(W)]
        idxs = [_routing(layer * 10 + s, T, K, E, "random") for s in range(W)]
        layers.append((xs, idxs, world.dispatch(xs, idxs)))
    for xs, idxs, res in reversed(layers):
        ref = reference_dispatch(xs, idxs, E)
        for d, (recv, h) in enumerate(res):
            assert torch.equal(recv[: ref[d][0].shape[0]], ref[d][0])
        outs = world.combine([r for r, _ in res], [h for _, h in res])
        for s in range(W):
            _close(outs[s], xs[s] * K, "gates default to 1")
    assert [int(b.state()[0]) for b in world.buffers] == [7] * W  # the next op: 1 + the 6 done
    world.check()  # no overflow, no timeout


def test_capacity_overflow_is_detected_not_silent():
    """A capacity below what rank 0 receives: expanded rows past it are not stored, the ops still
    finish, combine counts exactly the dropped slots as zero, and check() raises on rank 0 (once;
    the flag then clears)."""
    W, E, K, D, T, cap = 2, 4, 2, 4, 5, 6
    world = EmulatedWorld(W, T, D, K, E, torch.float64, capacity=cap, device="cpu")
    xs = [torch.randn(T, D, dtype=torch.float64) for _ in range(W)]
    idxs = [_kind_routing(s, T, K, E, W, "heavy_imbalance") for s in range(W)]  # 20 slots to rank 0
    res = world.dispatch(xs, idxs)
    ref = reference_dispatch(xs, idxs, E)
    recv0, h0 = res[0]
    assert recv0.shape[0] == cap and torch.equal(recv0, ref[0][0][:cap])
    assert int(h0.offsets_e[-1]) == cap  # clamped: the grouped GEMM stays inside the buffer
    outs = world.combine([r for r, _ in res], [h for _, h in res])
    e = E // W
    for s in range(W):
        # expanded row of each slot on rank 0: expert-major, then source, then slot order
        kept_rows = []
        for src in range(W):
            for t in range(T):
                for k in range(K):
                    kept_rows.append((int(idxs[src][t, k]), src, t, k))
        order = sorted(kept_rows)  # (expert, source, token, k): the expert-major layout
        kept = torch.zeros(T, K, dtype=torch.bool)
        for row, (g, src, t, k) in enumerate(order):
            if src == s and g // e == 0 and row < cap:
                kept[t, k] = True
        _close(outs[s], (xs[s][:, None, :] * kept[..., None]).sum(1), f"rank {s}")
        assert 0 < int(kept.sum()) < T * K or s == 1
    with pytest.raises(RuntimeError, match="rank 0 received more expert rows than"):
        world.buffers[0].check()
    world.check()  # the flag clears once reported; rank 1 never overflowed


def test_bounded_wait_names_the_op_rank_and_peer():
    """One virtual rank skips a dispatch: the others give up after timeout_s (no hang), record the
    op and the peer, fail fast in later waits, and check() raises ExchangeError naming them."""
    W, E, K, D, T = 3, 6, 2, 4, 4
    world = EmulatedWorld(W, T, D, K, E, torch.float64, device="cpu", timeout_s=0.002)
    xs = [torch.randn(T, D, dtype=torch.float64) for _ in range(W)]
    idxs = [_routing(s, T, K, E, "random") for s in range(W)]
    from tlx_dist.comm.emulated import run_lockstep
    from tlx_dist.comm.symm import dispatch_steps
    run_lockstep([dispatch_steps(world.buffers[r], xs[r], idxs[r]) for r in (0, 2)])  # rank 1 skips
    for r in (0, 2):
        with pytest.raises(ExchangeError, match=rf"rank {r} waited 0.002 s for the barrier \(op start\) from rank 1"):
            world.buffers[r].check()
    world.buffers[1].check()  # the rank that skipped saw nothing wrong


def test_single_rank_dispatcher_autograd_matches_local():
    """W = 1 without a process group ("local" buffers): SymmDispatcher's autograd vs
    LocalDispatcher + the reference weighted k-sum, forward and every gradient (x, y, gates), fp64."""
    E, K, D, T = 5, 2, 6, 9
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    gate = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    gate2 = gate.detach().clone().requires_grad_(True)
    idx = _routing(3, T, K, E, "random")
    sd = SymmDispatcher(E, max_tokens=16, capacity="worst")
    recv, h = sd.dispatch(x, idx, gate)
    lrecv, lh = LocalDispatcher(E).dispatch(x2, idx, gate2)
    assert recv.shape[0] == 16 * min(K, E) == h.num_recv_rows
    assert torch.equal(recv[: T * K], lrecv)
    assert torch.equal(h.offsets_e, lh.offsets_e) and torch.equal(h.recv_counts_e, lh.recv_counts_e)
    assert torch.equal(h.tokens_per_expert_E, lh.tokens_per_expert_E)
    w = torch.randn(D, D, dtype=torch.float64)
    y = sd.combine_weighted(recv @ w, h, gate)
    ly = LocalDispatcher(E).combine_weighted(lrecv @ w, lh, gate2)
    _close(y, ly, "combine")
    g = torch.randn(T, D, dtype=torch.float64)
    (y * g).sum().backward()
    (ly * g).sum().backward()
    _close(x.grad, x2.grad, "dx")
    _close(gate.grad, gate2.grad, "dgate")
    assert sd.buffers.backend == "local"
    with pytest.raises(NotImplementedError, match="combine_weighted"):
        sd.combine(recv, h)
    with pytest.raises(ValueError, match="gate_TK must be the tensor given to dispatch"):
        sd.combine_weighted(recv, h, gate2)


def test_exact_capacity_sizes_expanded_rows_exactly():
    """capacity="exact": one host read per dispatch, expanded rows = rows this rank computes."""
    E, K, D, T = 4, 2, 3, 6
    sd = SymmDispatcher(E, max_tokens=8)
    x = torch.randn(T, D, dtype=torch.float64)
    recv, h = sd.dispatch(x, _routing(1, T, K, E, "random"))
    assert recv.shape[0] == h.num_recv_rows == T * K


def _gloo_a2a_worker(rank, world, T, K, E, D):
    import torch.distributed as dist
    d = AllToAllDispatcher(E, dist.group.WORLD)
    x = torch.randn(T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    gate = torch.rand(T, K, dtype=torch.float64, generator=torch.Generator().manual_seed(9 + rank)).requires_grad_(True)
    idx = _kind_routing(rank, T, K, E, world, "random" if rank else "heavy_imbalance")
    recv, h = d.dispatch(x, idx, gate)
    y = d.combine_weighted(recv * (2 + rank), h, gate)
    g = torch.randn(T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + rank))
    (y * g).sum().backward()
    return dict(x=x.detach(), idx=idx, gate=gate.detach(), g=g, recv=recv.detach(), offsets=h.offsets_e,
                y=y.detach(), dx=x.grad, dgate=gate.grad)


def test_emulated_matches_all_to_all_on_gloo():
    """The reference backend on 2 gloo ranks and the emulated symmetric world on the same inputs
    give the same receive rows, offsets, combine output and gradients (x and gates)."""
    W, T, K, E, D = 2, 6, 2, 4, 5
    ref = run_world(_gloo_a2a_worker, W, T, K, E, D)
    world = EmulatedWorld(W, T, D, K, E, torch.float64, device="cpu")
    res = world.dispatch([r["x"] for r in ref], [r["idx"] for r in ref], [r["gate"] for r in ref])
    for d, (recv, h) in enumerate(res):
        n = ref[d]["recv"].shape[0]
        assert torch.equal(recv[:n], ref[d]["recv"]) and torch.equal(h.offsets_e, ref[d]["offsets"])
    ys = [r * (2 + d) for d, (r, _) in enumerate(res)]
    outs = world.combine(ys, [h for _, h in res])
    back = world.dispatch_grad([r["g"] for r in ref], ys, [h for _, h in res])
    dx = world.combine_grad([g_y * (2 + d) for d, (g_y, _) in enumerate(back)], [h for _, h in res])
    for s in range(W):
        _close(outs[s], ref[s]["y"], "combine")
        _close(dx[s], ref[s]["dx"], "dx")
        _close(back[s][1], ref[s]["dgate"], "dgate")


def test_size_hint_scales_with_tokens_not_slots():
    L = SymmLayout.build(128, 64, 8, 16, 4, torch.bfloat16)
    assert L.recv_rows == 4 * 128 and L.worst_case_rows == 4 * 128 * min(8, 4)
    hint = SymmBuffers.size_hint(128, 64, 8, 16, 4, torch.bfloat16)
    row = 64 * 2
    # token rows in (W*T_max) + partial sums back (T_max*W): no K-fold row term.
    assert hint == L.nbytes and 2 * 4 * 128 * row <= hint < 2 * 4 * 128 * row + 4 * 128 * 8 * 16 + 65536
    assert SymmBuffers.size_hint(128, 64, 8, 16, 4, torch.bfloat16) < SymmBuffers.size_hint(128, 64, 8, 16, 4, torch.float32)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(max_tokens=0), ValueError, "max_tokens=0"),
    (dict(hidden=-1), ValueError, "hidden=-1"),
    (dict(top_k=1.5), ValueError, "top_k=1.5"),
    (dict(num_experts=6, world_size=4), ValueError, "num_experts=6 is not divisible by world_size=4"),
    (dict(dtype=torch.int32), TypeError, "dtype="),
    (dict(top_k=5), ValueError, "top_k=5 is larger than num_experts=4"),
    # META's raw slot codes q * e + j are int32: T_max * (E / W) must stay below 2**31
    (dict(max_tokens=2**25, num_experts=256, world_size=2, top_k=1), ValueError,
     r"max_tokens\*num_experts/world_size=4294967296 must be < 2\*\*31"),
])
def test_layout_bad_input(kw, err, msg):
    args = dict(max_tokens=8, hidden=4, top_k=2, num_experts=4, world_size=2, dtype=torch.float32)
    args.update(kw)
    with pytest.raises(err, match=msg):
        SymmLayout.build(**args)


def test_dispatch_bad_input():
    world = EmulatedWorld(1, 4, 6, 2, 4, torch.float32, device="cpu")
    sd = SymmDispatcher(4, buffers=world.buffers[0])
    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="x_TD.dtype=torch.float64 differs"):
        sd.dispatch(torch.zeros(4, 6, dtype=torch.float64), idx)
    with pytest.raises(ValueError, match="T=5 tokens, more than the buffers' max_tokens=4"):
        sd.dispatch(torch.zeros(5, 6), torch.zeros(5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="D=7 but the symmetric buffers were built for hidden=6"):
        sd.dispatch(torch.zeros(4, 7), idx)
    with pytest.raises(ValueError, match="K=3 but the symmetric buffers were built for top_k=2"):
        sd.dispatch(torch.zeros(4, 6), torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        sd.dispatch(torch.zeros(4, 6), idx + 4)
    with pytest.raises(ValueError, match="gate_TK must be a tensor of idx_TK's shape"):
        sd.dispatch(torch.zeros(4, 6), idx, torch.zeros(4, 3))
    with pytest.raises(TypeError, match="buffers must be a SymmBuffers"):
        SymmDispatcher(4, buffers="nope")
    with pytest.raises(ValueError, match="buffers were built for num_experts=4, not 8"):
        SymmDispatcher(8, buffers=world.buffers[0])
    for bad in ("most", 0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="capacity="):
            SymmDispatcher(4, buffers=world.buffers[0], capacity=bad)
    with pytest.raises(ValueError, match="timeout_s="):
        EmulatedWorld(1, 4, 6, 2, 4, torch.float32, device="cpu", timeout_s=0)
    recv, h = sd.dispatch(torch.zeros(4, 6), idx)
    with pytest.raises(ValueError, match=f"y_ND has 3 rows"):
        sd.combine_weighted(recv[:3], h, None)
    with pytest.raises(TypeError, match="handle must come from SymmDispatcher"):
        sd.combine_weighted(recv, LocalDispatcher(4).dispatch(torch.zeros(4, 6), idx)[1], None)
    sd.combine_weighted(recv, h, None)
    world.close()
    with pytest.raises(RuntimeError, match="closed"):
        sd.dispatch(torch.zeros(4, 6), idx)
    with pytest.raises(ValueError, match="xs_TD must hold one tensor per virtual rank"):
        EmulatedWorld(2, 4, 6, 2, 4, torch.float32, device="cpu").dispatch([torch.zeros(4, 6)], [idx])


def test_topology_from_torchrun_env():
    # 2 nodes x 4 ranks; an EP group of global ranks {2, 3, 4, 5} seen from group rank 1 (global 3).
    t = Topology.from_ranks([2, 3, 4, 5], 1, env={"LOCAL_WORLD_SIZE": "4"})
    assert [t.node_of(d) for d in range(4)] == [0, 0, 1, 1]
    assert [t.same_node(d) for d in range(4)] == [True, True, False, False] and not t.single_node
    assert Topology.from_ranks([0, 1, 2, 3], 0, env={"LOCAL_WORLD_SIZE": "4"}).single_node
    assert Topology.from_ranks([0, 1], 1, env={}).single_node  # no torchrun env: one node
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x' is not an integer"):
        Topology.from_ranks([0, 1], 0, env={"LOCAL_WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="rank=2 is outside the group of 2 ranks"):
        Topology.from_ranks([0, 1], 2, env={})


def test_moe_layer_with_symm_dispatcher_matches_local():
    """MoELayer(dispatcher="symm") on one rank: same output and gradients as the local dispatcher
    (fp64; the padding rows of the expanded buffer stay out of every sum)."""
    import dataclasses

    from _util import make_cfg
    from tlx_dist import MoELayer

    torch.manual_seed(0)
    cfg = dataclasses.replace(make_cfg(), dtype="float64")
    a, b = MoELayer(cfg, dispatcher="local"), MoELayer(cfg, dispatcher="symm")
    layers_agree(a, b)
    assert isinstance(b.dispatcher, SymmDispatcher) and b.dispatcher.buffers.layout.max_tokens == 10


def layers_agree(a, b) -> torch.Tensor:
    """``b`` with ``a``'s weights: same output, dx and parameter gradients on a [2, 5, D] fp64
    batch; returns the input ``b`` saw."""
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, a.cfg.dim, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = a(xa), b(xb)
    _close(yb, ya, "output")
    ya.square().sum().backward()
    yb.square().sum().backward()
    _close(xb.grad, xa.grad, "dx")
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        _close(pb.grad, pa.grad, n)
    return xb


def test_launches_per_op(monkeypatch):
    """Launches per op in steady state (the budget: dispatch <= 3, combine <= 2): dispatch is
    _route (single-pass scan + posting the counts), _send_tokens (+ the wait and the layout),
    _expand (+ the readiness for the next op) = 3 and nothing else (no torch op either); combine is
    _reduce_send (+ the wait), _reduce_recv (+ the readiness) = 2."""
    from tlx.comm import exchange

    launched = []

    class Counting:
        def __init__(self, name, kernel):
            self._name, self._kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self._name)
            return self._kernel[grid]

        def __getattr__(self, attr):
            return getattr(self._kernel, attr)

    for name in [n for n in dir(exchange) if n.endswith("_kernel")]:
        monkeypatch.setattr(exchange, name, Counting(name, getattr(exchange, name)))
    world = EmulatedWorld(2, 6, 4, 2, 4, torch.float64, device="cpu", capacity=2.0)
    xs = [torch.randn(6, 4, dtype=torch.float64) for _ in range(2)]
    idxs = [_kind_routing(s, 6, 2, 4, 2, "random") for s in range(2)]
    gates = [torch.rand(6, 2, dtype=torch.float64) for _ in range(2)]
    res = world.dispatch(xs, idxs, gates)
    # lockstep order: phase 1 of rank 0 and rank 1, then phase 2, then phase 3
    assert launched == ["_route_kernel"] * 2 + ["_send_tokens_kernel"] * 2 + ["_expand_kernel"] * 2, launched
    launched.clear()
    world.combine([x for x, _ in res], [h for _, h in res])
    assert launched == ["_reduce_send_kernel"] * 2 + ["_reduce_recv_kernel"] * 2, launched
    world.check()
    world.close()
