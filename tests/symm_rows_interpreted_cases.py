"""The fused EP pipeline's exchange (``SymmDispatcher.dispatch_rows`` / ``combine_rows``) on CPU: the
real tlx/comm kernels under TRITON_INTERPRET=1, in an emulated world of W virtual ranks and on one
rank with autograd, against a brute-force fp64 MoE written from the definition.

The row form keeps the token rows where they arrived: each expanded (expert-major) row reads its
receive row by index, the experts' gate-weighted outputs are summed per receive row on the owner
and one partial row per (token, rank) goes home. Per rank the expert math here is
``tlx_dist.fused.reference`` (what the fused kernels compute); the exchange is the kernels'.
Run by tests/test_symm_interpreted.py in a child pytest (TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from symm_interpreted_cases import _close, _kind_routing, layers_agree  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld  # noqa: E402
from tlx_dist.comm.symm import ExchangeConfig, SymmDispatcher, SymmHandle, Tile  # noqa: E402
from tlx_dist.fused import fused_experts, fused_experts_rows  # noqa: E402
from tlx_dist.fused.reference import fused_backward_ref, fused_forward_ref  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


def _moe_brute(x_TD, idx_TK, gate_TK, w13_EDF2, w2_EFD):
    """out[t] = sum_k gate[t, k] * SwiGLU-expert_{idx[t, k]}(x[t]), one slot at a time (fp64)."""
    Fe = w2_EFD.shape[1]
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            h = x_TD[t] @ w13_EDF2[e]
            out[t] = out[t] + gate_TK[t, k] * ((F.silu(h[:Fe]) * h[Fe:]) @ w2_EFD[e])
    return out


# W = 4 with a rank of 0 tokens: its receive blocks are empty, it still answers every barrier.
# heavy_imbalance: every slot goes to rank 0's experts (other ranks receive nothing);
# zero_token_experts: odd experts get no rows (empty segments inside offsets_e).
# rpn: ranks per emulated node -- peers on other nodes are reached by the (emulated) NVSHMEM route:
# staged puts of the partial rows and of the given gate gradients; with two ranks a node the exchange
# is the hierarchical one (ExchangeConfig.topology "auto"; test_rows_world_flat_nodes_of_two: the flat).
@pytest.mark.parametrize("Ts,kind,rpn", [([5, 3], "random", None), ([4, 4], "heavy_imbalance", None),
                                         ([6, 2], "zero_token_experts", None), ([4, 0, 6, 2], "random", None),
                                         ([3, 5, 2, 4], "heavy_imbalance", None), ([5, 3], "random", 1),
                                         ([4, 0, 6, 2], "random", 2)])
def test_rows_world_matches_brute_force(Ts, kind, rpn, config=None):
    W, E, K, D, Fe = len(Ts), 12, 3, 8, 4
    e = E // W
    dt = torch.float64
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(T, D, generator=gen, dtype=dt) for T in Ts]
    idxs = [_kind_routing(20 + s, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
            for s, T in enumerate(Ts)]
    gates = [torch.rand(T, K, generator=gen, dtype=dt) for T in Ts]
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=dt) * 0.5
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=dt) * 0.5
    w13s, w2s = [w13[d * e:(d + 1) * e] for d in range(W)], [w2[d * e:(d + 1) * e] for d in range(W)]

    world = EmulatedWorld(W, max(max(Ts), 1), D, K, E, dt, device="cpu", ranks_per_node=rpn, config=config)
    res = world.dispatch_rows(xs, idxs, gates)
    fwd = []
    for d, (recv, src, gate_N, h) in enumerate(res):
        assert isinstance(h, SymmHandle) and recv.shape == (W * world.buffers[d].layout.max_tokens, D)
        assert gate_N.dtype == dt and src.dtype == torch.int32
        n = int(h.offsets_e[-1])
        # every expanded row reads the receive row its token arrived in, with that slot's gate
        m = h.src_map_N[:n].long()
        assert torch.equal(src[:n].long(), m // K)
        assert torch.equal(gate_N[:n], h.gate_RK.reshape(-1)[m])
        fwd.append(fused_forward_ref(recv, src, src, gate_N, w13s[d], w2s[d], h.offsets_e, recv.shape[0]))
    outs = world.combine_rows([p for p, _ in fwd], [h for *_, h in res])

    # the reference, with autograd for the backward
    leaves = [t.clone().requires_grad_(True) for t in xs + gates] + [w13.clone().requires_grad_(True),
                                                                      w2.clone().requires_grad_(True)]
    rx, rg, rw13, rw2 = leaves[:W], leaves[W:2 * W], leaves[2 * W], leaves[2 * W + 1]
    ref = [_moe_brute(rx[s], idxs[s], rg[s], rw13, rw2) for s in range(W)]
    for s in range(W):
        assert outs[s].shape == (Ts[s], D)
        _close(outs[s], ref[s].detach(), f"{kind}: output on rank {s}")

    gs = [torch.randn(T, D, generator=gen, dtype=dt) for T in Ts]
    torch.autograd.backward([r for r in ref if r.numel()], [g for g, r in zip(gs, ref) if r.numel()])
    g_parts = world.combine_rows_grad(gs, [h for *_, h in res])
    bwd = [fused_backward_ref(g_parts[d], recv, src, src, gate_N, w13s[d], w2s[d], h.offsets_e, fwd[d][1])
           for d, (recv, src, gate_N, h) in enumerate(res)]
    back = world.dispatch_rows_grad([b[0] for b in bwd], [b[1] for b in bwd], [h for *_, h in res])
    for s in range(W):
        g_x, g_gate = back[s]
        _close(g_x, rx[s].grad if rx[s].grad is not None else torch.zeros_like(xs[s]), f"{kind}: dx on rank {s}")
        _close(g_gate, rg[s].grad if rg[s].grad is not None else torch.zeros_like(gates[s]),
               f"{kind}: dgate on rank {s}")
    for d in range(W):
        _close(bwd[d][2], rw13.grad[d * e:(d + 1) * e], f"{kind}: dw13 on rank {d}")
        _close(bwd[d][3], rw2.grad[d * e:(d + 1) * e], f"{kind}: dw2 on rank {d}")
    world.check()
    world.close()


def test_rows_world_flat_nodes_of_two():
    """Nodes of two over the flat exchange: a sender mixes peer stores and NVSHMEM puts."""
    test_rows_world_matches_brute_force([4, 0, 6, 2], "random", 2, ExchangeConfig(topology="flat"))


def test_rows_world_short_wide_tiles(monkeypatch):
    """The row form with 2-row tiles of two column chunks (what tuning._tiles picks for few rows at
    large D, forced here at D = 8): forward and backward against the brute force."""
    from tlx_dist.comm.symm import tuning
    monkeypatch.setattr(tuning, "_tiles", lambda D, rows=None, cols=512: (2, 4))
    test_rows_world_matches_brute_force([5, 3], "random", None)
    test_rows_world_matches_brute_force([4, 0, 6, 2], "random", 2)


def test_rows_world_launch_shapes():
    """Launch shapes of the config (what bench/exchange_tiles.py sweeps): a different tile shape and
    warp count per row-moving kernel -- one-row tiles, tiles taller than a rank's rows, a column
    chunk narrower than D -- still give the brute force's forward and backward; the default
    config is the sized-per-launch tile again."""
    from tlx_dist.comm.symm.tuning import _grid, _tiles, launch_shape
    cfg = ExchangeConfig(send=Tile(rows=1, cols=4, warps=8, per_sm=1), expand=Tile(rows=16, cols=8),
                         reduce_send=Tile(rows=4, cols=2, warps=2, per_sm=16),
                         reduce_recv=Tile(rows=8, cols=16, per_sm=16))
    cpu = torch.device("cpu")
    assert launch_shape(cfg.send, 8, 5, cpu)[:3] == (1, 4, 8)
    test_rows_world_matches_brute_force([5, 3], "random", None, cfg)
    test_rows_world_matches_brute_force([3, 5, 2, 4], "heavy_imbalance", None, cfg)
    # column chunks that do and do not divide D (3 of 4 + 4 / 8), two tokens per route block (a
    # look-back across blocks), and the same over NVSHMEM (rpn=1)
    cfg = dataclasses.replace(cfg, send=Tile(rows=2, cols=4), reduce_send=Tile(rows=2, cols=8, per_sm=16),
                              route_block=2)
    test_rows_world_matches_brute_force([5, 3], "random", None, cfg)
    test_rows_world_matches_brute_force([4, 0, 6, 2], "zero_token_experts", None, cfg)
    test_rows_world_matches_brute_force([5, 3], "random", 1, cfg)
    cfg = dataclasses.replace(cfg, send=Tile(rows=2, cols=16))  # one chunk wider than D = 8
    test_rows_world_matches_brute_force([3, 5, 2, 4], "heavy_imbalance", None, cfg)
    send = ExchangeConfig().send
    assert launch_shape(send, 8, 5, cpu) == (*_tiles(8, 5, 1024), 4, _grid(-(-5 // _tiles(8, 5, 1024)[0]), cpu))


@pytest.mark.parametrize("Ts,kind", [([5, 3], "random"), ([3, 5, 2, 4], "heavy_imbalance"), ([4, 0, 6, 2], "random")])
def test_rows_arrive_block_by_block(monkeypatch, Ts, kind):
    """The row form's receive copy waits on per-block arrival counters (RBLK): with 3-row receive
    blocks and 4-row send tiles a token block's rows straddle two counters. After the send phase
    each rank's counter (s, j) holds exactly the rows of receive block j from source s (none from
    itself); after the op every counter is back at zero, and the results are right, twice over."""
    from tlx_dist.comm.symm import tuning
    import tlx_dist.comm.symm as symm
    from tlx_dist.comm.symm import policy
    import tlx_dist.comm.symm.buffers as sb
    monkeypatch.setattr(sb, "RECV_BLOCK", 3)
    monkeypatch.setattr(tuning, "_tiles", lambda D, rows=None, cols=512: (4, 4))
    W, E, K, D = len(Ts), 12, 3, 8
    world = EmulatedWorld(W, max(Ts), D, K, E, torch.float64, device="cpu")
    bufs = world.buffers
    assert bufs[0].layout.recv_block == 3 and policy.recv_mode(bufs[0]) == "blocks"
    gen = torch.Generator().manual_seed(5)
    for rep in range(2):
        xs = [torch.randn(T, D, generator=gen, dtype=torch.float64) for T in Ts]
        idxs = [_kind_routing(30 + s + rep, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
                for s, T in enumerate(Ts)]
        gates = [torch.rand(T, K, generator=gen, dtype=torch.float64) for T in Ts]
        gens = [symm.dispatch_steps(bufs[d], xs[d], idxs[d], gates[d], "worst", rows=True) for d in range(W)]
        for g in gens:  # route
            next(g)
        for g in gens:  # send
            next(g)
        for d in range(W):
            ctr = bufs[d].recv_block_counters()
            for s in range(W):
                n_s = int((idxs[s] // (E // W) == d).any(1).sum()) if Ts[s] else 0  # rows s sends to d
                want = torch.zeros(ctr.shape[1], dtype=torch.int64)
                if s != d:
                    for j in range(-(-n_s // 3)):
                        want[j] = min(3, n_s - 3 * j)
                assert torch.equal(ctr[s], want), f"rep {rep}: rank {d}'s counters of source {s}: {ctr[s]} != {want}"
        res = []
        for g in gens:
            try:
                next(g)
                raise AssertionError("dispatch has three phases")
            except StopIteration as stop:
                res.append(stop.value)
        for d, (recv, src, gate_N, h) in enumerate(res):
            assert not bufs[d].recv_block_counters().any(), f"rep {rep}: rank {d}'s counters were not zeroed"
            for s in range(W):
                tok = h.tok_R.long()[s * max(Ts):s * max(Ts) + int(h.rows_from_W[s])]
                assert torch.equal(recv[s * max(Ts):s * max(Ts) + tok.numel()], xs[s][tok]), f"rank {d} from {s}"
        g = [torch.randn(T, D, generator=gen, dtype=torch.float64) for T in Ts]
        gp = world.combine_rows_grad(g, [h for *_, h in res])  # the same copy, in combine's backward
        for d, (recv, src, gate_N, h) in enumerate(res):
            assert not bufs[d].recv_block_counters().any()
            for s in range(W):
                tok = h.tok_R.long()[s * max(Ts):s * max(Ts) + int(h.rows_from_W[s])]
                assert torch.equal(gp[d][s * max(Ts):s * max(Ts) + tok.numel()], g[s][tok])
    world.check()
    world.close()


def test_rows_interleave_with_the_copying_ops():
    """Row-form and expanded-form ops on the same buffers, alternating: epochs, arrival counters and
    the gate-gradient region are shared, so a mistake in either shows up in the other."""
    W, E, K, D, T = 2, 4, 2, 8, 6
    world = EmulatedWorld(W, T, D, K, E, torch.float64, device="cpu")
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(T, D, generator=gen, dtype=torch.float64) for _ in range(W)]
    idxs = [_kind_routing(5 + s, T, K, E, W, "random") for s in range(W)]
    gates = [torch.rand(T, K, generator=gen, dtype=torch.float64) for _ in range(W)]
    for _ in range(2):
        rows = world.dispatch_rows(xs, idxs, gates)
        # identity "experts": each rank's partial is sum over its slots of gate * x
        parts = []
        for recv, src, gate_N, h in rows:
            n = int(h.offsets_e[-1])
            p = torch.zeros_like(recv)
            p.index_add_(0, src[:n].long(), gate_N[:n, None] * recv[src[:n].long()])
            parts.append(p)
        out_rows = world.combine_rows(parts, [h for *_, h in rows])
        exp = world.dispatch(xs, idxs, gates)
        out_exp = world.combine([x for x, _ in exp], [h for _, h in exp])
        for s in range(W):
            _close(out_rows[s], (gates[s].sum(1, keepdim=True) * xs[s]), "rows: identity experts")
            _close(out_exp[s], out_rows[s], "expanded vs rows")
        g = [torch.randn(T, D, generator=gen, dtype=torch.float64) for _ in range(W)]
        gp = world.combine_rows_grad(g, [h for *_, h in rows])
        for d, (recv, src, gate_N, h) in enumerate(rows):
            valid = [s * T + i for s in range(W) for i in range(int(h.rows_from_W[s]))]
            tok = h.tok_R.long()
            for r in valid:  # each received row's gradient is its token's output gradient at home
                assert torch.equal(gp[d][r], g[r // T][tok[r]])
    world.check()
    world.close()


def test_own_rows_skip_the_shared_region():
    """A rank's own token rows never pass through its symmetric regions in the row form: dispatch
    (and combine's backward) store them straight into the op's output, and the reductions read this
    rank's own partial rows where they are. Both regions' own parts are poisoned with NaN first and
    must still be NaN after all four ops, whose results must still be right."""
    W, E, K, D, T = 2, 4, 2, 8, 6
    dt = torch.float64
    world = EmulatedWorld(W, T, D, K, E, dt, device="cpu")
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(T, D, generator=gen, dtype=dt) for _ in range(W)]
    idxs = [_kind_routing(9 + s, T, K, E, W, "random") for s in range(W)]
    gates = [torch.rand(T, K, generator=gen, dtype=dt) for _ in range(W)]
    recv = [b.recv_rows() for b in world.buffers]
    combs = []
    for d, b in enumerate(world.buffers):
        L = b.layout
        combs.append(b._region(L.off_comb, L.max_tokens * W * D * L.dtype.itemsize).view(dt).view(W, L.max_tokens, D))
        recv[d][d * T:(d + 1) * T] = float("nan")
        combs[d][d] = float("nan")
    rows = world.dispatch_rows(xs, idxs, gates)
    parts = []
    for r, src, gate_N, h in rows:  # identity experts: the partial row is the sum of its slots' gates times x
        n = int(h.offsets_e[-1])
        p = torch.zeros_like(r)
        p.index_add_(0, src[:n].long(), gate_N[:n, None] * r[src[:n].long()])
        parts.append(p)
    outs = world.combine_rows(parts, [h for *_, h in rows])
    g = [torch.randn(T, D, generator=gen, dtype=dt) for _ in range(W)]
    gp = world.combine_rows_grad(g, [h for *_, h in rows])
    back = world.dispatch_rows_grad(gp, [None] * W, [h for *_, h in rows])
    for s in range(W):
        _close(outs[s], gates[s].sum(1, keepdim=True) * xs[s], "rows with own rows local: identity experts")
        sent_to = [(idxs[s] // (E // W) == d).any(1) for d in range(W)]  # the ranks each token went to
        _close(back[s][0], g[s] * sum(m.to(dt)[:, None] for m in sent_to), "dx: the gradient once per rank")
    for d in range(W):
        assert torch.isnan(recv[d][d * T:(d + 1) * T]).all(), f"rank {d}: its own rows went through RECV"
        assert torch.isnan(combs[d][d]).all(), f"rank {d}: its own partial rows went through COMB"
    world.check()
    world.close()


@pytest.mark.parametrize("region", [None, 0])
def test_single_rank_rows_autograd_matches_fused_local(region):
    """W = 1 (no process group, "local" buffers): dispatch_rows -> fused_experts_rows ->
    combine_rows under autograd vs the one-rank fused_experts, output and every gradient, fp64."""
    E, K, D, Fe, T = 6, 2, 8, 4, 9
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    gate = torch.rand(T, K, generator=gen, dtype=torch.float64)
    idx = _kind_routing(9, T, K, E, 1, "zero_token_experts")
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=torch.float64)
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=torch.float64)
    a = [t.clone().requires_grad_(True) for t in (x, gate, w13, w2)]
    b = [t.clone().requires_grad_(True) for t in (x, gate, w13, w2)]
    sd = SymmDispatcher(E, max_tokens=16, capacity="worst", row_regions=int(region is not None))
    recv, src, gate_N, h = sd.dispatch_rows(a[0], idx, a[1], region=region)
    if region is not None:  # autograd through a region view: the rows read where they landed
        assert recv.data_ptr() == sd.buffers.rows_region(region).data_ptr()
    part = fused_experts_rows(recv, src, src, gate_N, a[2], a[3], h.offsets_e, recv.shape[0], backend="reference")
    out = sd.combine_rows(part, h)
    ref = fused_experts(b[0], idx, b[1], b[2], b[3], backend="reference")
    _close(out, ref, "output")
    g = torch.randn(T, D, generator=gen, dtype=torch.float64)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for name, ta, tb in zip(("dx", "dgate", "dw13", "dw2"), a, b):
        _close(ta.grad, tb.grad, name)
    sd.check()


def test_moe_layer_fused_ep_matches_separate():
    """MoELayer(pipeline="fused", dispatcher="symm") on one rank vs the separate local layer:
    output, dx and every parameter gradient (fp64)."""
    from _util import make_cfg
    from tlx_dist import MoELayer

    torch.manual_seed(0)
    cfg = dataclasses.replace(make_cfg(), dtype="float64")
    a = MoELayer(cfg, dispatcher="local", pipeline="separate")
    b = MoELayer(cfg, dispatcher="symm", pipeline="fused")
    xb = layers_agree(a, b)
    assert isinstance(b.dispatcher, SymmDispatcher) and b._fused(xb.reshape(-1, cfg.dim))


def test_rows_bad_input():
    E, K, D, T = 4, 2, 8, 5
    sd = SymmDispatcher(E, max_tokens=8, capacity="worst")
    x = torch.randn(T, D, dtype=torch.float64)
    idx = _kind_routing(1, T, K, E, 1, "random")
    gate = torch.rand(T, K, dtype=torch.float64)
    with pytest.raises(ValueError, match="gate_TK must be a float tensor"):
        sd.dispatch_rows(x, idx, None)
    with pytest.raises(ValueError, match="gate_TK must be a float tensor"):
        sd.dispatch_rows(x, idx, gate[:, :1])
    recv, src, gate_N, h = sd.dispatch_rows(x, idx, gate)
    with pytest.raises(ValueError, match=r"part_RD must be \[8, 8\]"):
        sd.combine_rows(recv[:3], h)
    with pytest.raises(ValueError, match="part_RD must be"):
        sd.combine_rows(recv.float(), h)
    with pytest.raises(TypeError, match="handle must come from SymmDispatcher.dispatch_rows"):
        sd.combine_rows(recv, object())
    from _util import make_cfg
    from tlx_dist import MoELayer
    with pytest.raises(ValueError, match="pipeline='fused' runs its own gather/scatter GEMMs"):
        MoELayer(make_cfg(), dispatcher="local", pipeline="fused", gemm_backend="torch")


def test_bench_rows_check_passes_and_can_fail():
    """bench/dispatch.py's row-form check (run before its rows_graph timing on GPUs): it passes on a
    correct exchange and fails on a wrong anchor or a wrong rank count."""
    import sys

    from tlx_dist.comm import LocalDispatcher

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import dispatch as bench_dispatch
    finally:
        sys.path.pop(0)
    E, T, D, K = 8, 12, 16, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g).bfloat16()
    gate, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, dim=1)
    ra, _ = LocalDispatcher(E, validate=False).dispatch(x, idx, gate)
    sd = SymmDispatcher(E, max_tokens=T, capacity=2.0, validate=False)
    ranks_T = torch.ones(T, dtype=torch.long)  # one rank: every token reaches it once
    recv, h = bench_dispatch.rows_check(sd, x, idx, gate, ra, ranks_T)
    assert recv.shape == (T, D) and isinstance(h, SymmHandle)
    with pytest.raises(AssertionError, match="expert-major rows"):
        bench_dispatch.rows_check(sd, x, idx, gate, ra.flip(0), ranks_T)
    with pytest.raises(AssertionError, match="x \\* ranks reached"):
        bench_dispatch.rows_check(sd, x, idx, gate, ra, ranks_T + 1)
    sd.check()


@pytest.mark.parametrize("rpn,capacity", [(None, "worst"), (None, "exact"), (1, "worst")])
def test_rows_land_in_per_layer_regions(rpn, capacity):
    """``row_regions``: a row-form dispatch into region k leaves the rows in this rank's region k
    (peers store them there; no RECV, no copy) -- the same rows, index maps and gates as the copying
    row form -- and a later dispatch into another region leaves region k as it was (a layer's rows
    live until its next forward). RECV is poisoned with NaN and must stay NaN on peer pointers. The
    NVSHMEM route (rpn=1: every peer on another node) ignores the region and copies as before."""
    W, E, K, D = 2, 4, 2, 8
    Ts = [6, 5]
    dt = torch.float64
    gen = torch.Generator().manual_seed(21)
    ops = []
    for s in range(2):  # two layers' ops
        xs = [torch.randn(T, D, generator=gen, dtype=dt) for T in Ts]
        idxs = [_kind_routing(40 + 3 * s + d, T, K, E, W, "random") for d, T in enumerate(Ts)]
        gates = [torch.rand(T, K, generator=gen, dtype=dt) for T in Ts]
        ops.append((xs, idxs, gates))
    # the copying row form first (one emulated NVSHMEM world at a time: each registers its heaps)
    ref_world = EmulatedWorld(W, max(Ts), D, K, E, dt, device="cpu", ranks_per_node=rpn, capacity=capacity)
    wants = []
    for xs, idxs, gates in ops:
        want = ref_world.dispatch_rows(xs, idxs, gates)
        wants.append([(r.clone(), s_.clone(), g.clone(), h) for r, s_, g, h in want])
        ref_world.combine_rows([r.clone() for r, *_ in want], [h for *_, h in want])
    ref_world.check()
    ref_world.close()
    world = EmulatedWorld(W, max(Ts), D, K, E, dt, device="cpu", ranks_per_node=rpn, row_regions=2,
                          capacity=capacity)
    with pytest.raises(ValueError, match=r"row region 2 is not in \[0, 2\)"):
        world.dispatch_rows(*ops[0], region=2)
    for b in world.buffers:
        b.recv_rows().fill_(float("nan"))
    kept = []
    for k, (xs, idxs, gates) in enumerate(ops):
        want = wants[k]
        got = world.dispatch_rows(xs, idxs, gates, region=k)
        for d in range(W):
            (rw, sw, gw, hw), (rg, sg, gg, hg) = want[d], got[d]
            n = int(hw.offsets_e[-1])
            assert torch.equal(hg.offsets_e, hw.offsets_e)
            assert torch.equal(sg[:n], sw[:n]) and torch.equal(gg[:n], gw[:n])
            rows = sw[:n].long().unique()
            assert torch.equal(rg[rows], rw[rows]), f"op {k}, rank {d}: the rows in the region"
            if rpn is None:
                assert rg.data_ptr() == world.buffers[d].rows_region(k).data_ptr(), "recv_RD is the region itself"
            kept.append((k, d, rows, rw[rows].clone()))
        world.combine_rows([r.clone() for r, *_ in got], [h for *_, h in got])  # finish the op
    for k, d, rows, val in kept:
        if rpn is None:  # region 0 still holds the first op's rows after the second op
            assert torch.equal(world.buffers[d].rows_region(k)[rows], val), f"region {k} of rank {d} was overwritten"
    if rpn is None:
        for d, b in enumerate(world.buffers):
            assert torch.isnan(b.recv_rows()).all(), f"rank {d}: rows went through RECV"
    world.check()
    world.close()


def test_region_rows_saved_then_overwritten_raise_in_backward():
    """A layer's rows in its receive region live until its next dispatch: two steps of forward +
    backward through region 0 are fine, a second forward before the first one's backward makes that
    backward raise (each dispatch bumps the region's autograd version) instead of reading new rows."""
    E, K, D, Fe, T = 4, 2, 8, 4, 6
    gen = torch.Generator().manual_seed(8)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=torch.float64).requires_grad_(True)
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=torch.float64).requires_grad_(True)
    sd = SymmDispatcher(E, max_tokens=T, capacity="worst", row_regions=1)

    def forward():
        x = torch.randn(T, D, generator=gen, dtype=torch.float64).requires_grad_(True)
        gate = torch.rand(T, K, generator=gen, dtype=torch.float64).requires_grad_(True)
        idx = _kind_routing(3, T, K, E, 1, "random")
        recv, src, gate_N, h = sd.dispatch_rows(x, idx, gate, region=0)
        part = fused_experts_rows(recv, src, src, gate_N, w13, w2, h.offsets_e, recv.shape[0], backend="reference")
        return sd.combine_rows(part, h).sum()

    for _ in range(2):
        forward().backward()
    first = forward()
    forward().backward()  # the second forward overwrote region 0
    with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace operation"):
        first.backward()
    sd.check()


# ---- the overlapped row form (SymmDispatcher(overlap=True)) ----

def _check_phase_runs(h, recv_rows_of, r, T_max, what):
    """``offsets_V``: every local expert's rows cut in three consecutive runs -- rows from sources
    before rank r, rank r's own, sources after -- ending at the expert's end."""
    ov = h.overlap
    offs = h.offsets_e.long()
    V = ov.offsets_V.long()
    e = offs.shape[0]
    assert V.shape == (3 * e,) and ov.offsets_V.dtype == torch.int32, what
    src = recv_rows_of
    for j in range(e):
        lo = int(offs[j - 1]) if j else 0
        a, b, c = (int(v) for v in V[3 * j:3 * j + 3])
        assert lo <= a <= b <= c == int(offs[j]), f"{what}: expert {j} runs {lo, a, b, c}"
        s = src[lo:c] // T_max
        assert bool((s[:a - lo] < r).all()), f"{what}: expert {j}, run 0 holds rows of rank >= {r}"
        assert bool((s[a - lo:b - lo] == r).all()), f"{what}: expert {j}, run 1 is not rank {r}'s own rows"
        assert bool((s[b - lo:] > r).all()), f"{what}: expert {j}, run 2 holds rows of rank <= {r}"


@pytest.mark.parametrize("backend", ["reference", "triton"])
# the two 4-rank worlds of full capacity in the release tier
@pytest.mark.parametrize("Ts,kind,capacity", [([5, 3], "random", "worst"),
                                              pytest.param([4, 0, 6, 2], "random", "worst", marks=pytest.mark.release),
                                              pytest.param([3, 5, 2, 4], "heavy_imbalance", "worst",
                                                           marks=pytest.mark.release),
                                              ([6, 2], "zero_token_experts", 1.0), ([7, 7], "random", 0.5)])
def test_overlapped_rows_match_the_plain_row_form(Ts, kind, capacity, backend):
    """``overlap=True``: the same rows in the same regions, index maps, gates and layout as the plain
    region form, two ops in a row (the region counters reset by each op's wait); before the wait the
    counters hold every peer's rows (the emulated world sends in line) and the own column nothing;
    ``offsets_V`` cut each expert into (before | own | after) runs; then the fused expert math on the
    phase plan (``fused_experts_rows(overlap=)``, here the reference backend: wait, then one pass)
    and the combine give the plain form's outputs bit for bit. Capacity 0.5 overflows (flagged).
    ``triton`` (the portable kernels, interpreted): the phased forward -- gate/up over the own runs,
    wait, the rest, down over the peers' runs, their partial rows sent home early (the combine's
    first kernel), down over the own runs -- and a combine that only receives; fp32-ordered sums,
    so equal to fp32 rounding (fp32 operands), the exchange's outputs bit for bit."""
    W, E, K, D, Fe = len(Ts), 12, 3, 8, 4
    e = E // W
    dt = torch.float64 if backend == "reference" else torch.float32  # (the portable kernels: no fp64)
    gen = torch.Generator().manual_seed(5)
    T_max = max(max(Ts), 1)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=dt) * 0.5
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=dt) * 0.5
    ops = []
    for s in range(2):
        xs = [torch.randn(T, D, generator=gen, dtype=dt) for T in Ts]
        idxs = [_kind_routing(60 + 5 * s + d, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
                for d, T in enumerate(Ts)]
        gates = [torch.rand(T, K, generator=gen, dtype=dt) for T in Ts]
        ops.append((xs, idxs, gates))
    outs = {}
    for overlap in (False, True):
        world = EmulatedWorld(W, T_max, D, K, E, dt, device="cpu", row_regions=2, capacity=capacity)
        got = []
        for k, (xs, idxs, gates) in enumerate(ops):
            res = world.dispatch_rows(xs, idxs, gates, region=k, overlap=overlap)
            parts = []
            for d, (recv, src, gate_N, h) in enumerate(res):
                if overlap:
                    assert h.overlap is not None, "an overlapped dispatch returns its receive plan"
                    ctr = world.buffers[d].region_counters()[k]
                    want = h.rows_from_W.clone()
                    want[d] = 0
                    assert torch.equal(ctr, want), f"op {k} rank {d}: region counters {ctr} != rows from {want}"
                    _check_phase_runs(h, src.long(), d, T_max, f"op {k} rank {d}")
                else:
                    assert h.overlap is None
                w13s, w2s = w13[d * e:(d + 1) * e], w2[d * e:(d + 1) * e]
                part = fused_experts_rows(recv, src, src, gate_N, w13s, w2s, h.offsets_e, recv.shape[0],
                                          backend=backend, overlap=h.overlap)
                if overlap:
                    assert h.overlap.waited
                    assert (h.overlap.partials_sent is not None) == (backend == "triton")
                    assert torch.equal(world.buffers[d].region_counters()[k], torch.zeros(W, dtype=torch.int64)), \
                        f"op {k} rank {d}: the wait takes the rows off the region counters"
                n = int(h.offsets_e[-1])
                got.append((recv[src[:n].long()].clone(), src[:n].clone(), gate_N[:n].clone(), h.offsets_e.clone(),
                            h.pos_RK.clone()))
                parts.append(part)
            got.append(world.combine_rows(parts, [h for *_, h in res]))
        if capacity == 0.5:
            with pytest.raises(RuntimeError, match="received more expert rows"):
                world.check()
        else:
            world.check()
        world.close()
        outs[overlap] = got
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):
        if isinstance(a, tuple):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"item {i}: the overlapped form differs from the plain one"
        else:
            for x, y in zip(a, b):
                if backend == "reference":
                    assert torch.equal(x, y), f"combine {i}: the overlapped form's output differs"
                else:
                    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"combine {i}")


def test_overlapped_rows_autograd_and_fallbacks():
    """The overlap is asked for where it cannot run -- one rank, no region, capacity 'exact' -- and
    the dispatch is the plain one there (no plan); with a plan, ``fused_experts_rows`` differentiates
    as without one (the plan is an extra, non-tensor input of its autograd function)."""
    E, K, D, Fe, T = 4, 2, 8, 4, 6
    dt = torch.float64
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, D, generator=gen, dtype=dt)
    idx = _kind_routing(3, T, K, E, 1, "random")
    gate = torch.rand(T, K, generator=gen, dtype=dt)
    for region, cap in ((0, "worst"), (None, "worst"), (0, "exact")):
        sd = SymmDispatcher(E, max_tokens=T, capacity=cap, row_regions=1, overlap=True)
        recv, src, gate_N, h = sd.dispatch_rows(x, idx, gate, region=region)
        assert h.overlap is None, f"region={region}, capacity={cap}: one rank has nothing to overlap"
    with pytest.raises(TypeError, match="overlap"):
        SymmDispatcher(E, overlap=1)
    # the output of a phased forward (partial rows already sent) must reach the combine as it is
    W = 2
    f32 = torch.float32
    world = EmulatedWorld(W, T, D, K, E, f32, device="cpu", row_regions=1, capacity="worst")
    xs = [torch.randn(T, D, generator=gen, dtype=f32) for _ in range(W)]
    idxs = [_kind_routing(11 + d, T, K, E, W, "random") for d in range(W)]
    gates = [torch.rand(T, K, generator=gen, dtype=f32) for _ in range(W)]
    res = world.dispatch_rows(xs, idxs, gates, region=0, overlap=True)
    w13 = torch.randn(E // W, D, 2 * Fe, generator=gen, dtype=f32)
    w2 = torch.randn(E // W, Fe, D, generator=gen, dtype=f32)
    parts = [fused_experts_rows(r, s_, s_, g, w13, w2, h.offsets_e, r.shape[0], backend="triton", overlap=h.overlap)
             for r, s_, g, h in res]
    with pytest.raises(ValueError, match="as it is"):
        world.combine_rows([parts[0].clone(), parts[1]], [r[3] for r in res])
    world.close()
    # the plan through autograd: an emulated W=2 dispatch's plan on rank 0, the reference backend
    W = 2
    world = EmulatedWorld(W, T, D, K, E, dt, device="cpu", row_regions=1, capacity="worst")
    xs = [torch.randn(T, D, generator=gen, dtype=dt) for _ in range(W)]
    idxs = [_kind_routing(7 + d, T, K, E, W, "random") for d in range(W)]
    gates = [torch.rand(T, K, generator=gen, dtype=dt) for _ in range(W)]
    gates = [g.requires_grad_(True) * 1.0 for g in gates]  # a router's gates: with an autograd graph
    res = world.dispatch_rows(xs, idxs, gates, region=0, overlap=True)
    recv, src, gate_N, h = res[0]
    # the plan (which the buffers keep until the next dispatch into its region) holds no tensor of an
    # autograd graph: it would keep that step's graph alive into the next (and a CUDA-graph capture's
    # backward fails on the old AccumulateGrad nodes' streams)
    for plan in [r[3].overlap for r in res] + list(world.buffers[0]._overlap_plans.values()):
        held = [v for v in list(vars(plan).values()) + list(vars(plan._handle).values())
                if isinstance(v, torch.Tensor)]
        assert held and not any(t.requires_grad or t.grad_fn is not None for t in held), "the plan holds a graph"
        assert plan._handle.overlap is None
    w13 = torch.randn(E // W, D, 2 * Fe, generator=gen, dtype=dt, requires_grad=True)
    w2 = torch.randn(E // W, Fe, D, generator=gen, dtype=dt, requires_grad=True)
    g_N = gate_N.clone().requires_grad_(True)
    r_in = recv.clone().requires_grad_(True)
    with_plan = fused_experts_rows(r_in, src, src, g_N, w13, w2, h.offsets_e, recv.shape[0], backend="reference",
                                   overlap=h.overlap)
    grads = torch.autograd.grad(with_plan.sum(), (r_in, g_N, w13, w2))
    plain = fused_experts_rows(r_in, src, src, g_N, w13, w2, h.offsets_e, recv.shape[0], backend="reference")
    grads0 = torch.autograd.grad(plain.sum(), (r_in, g_N, w13, w2))
    assert torch.equal(with_plan, plain)
    for a, b in zip(grads, grads0):
        assert torch.equal(a, b)
    world.combine_rows([with_plan.detach(), torch.zeros_like(res[1][0])], [r[3] for r in res])
    world.check()
    world.close()


def test_overlapped_rows_wait_times_out_naming_the_peer():
    """A peer whose rows never land (its row send skipped: the counters are taken back here) makes
    the wait give up after the timeout and ``check()`` raise, naming the token rows and the peer --
    no hang."""
    from tlx_dist.comm.symm.buffers import ExchangeError

    W, E, K, D, T = 2, 4, 2, 8, 5
    dt = torch.float64
    gen = torch.Generator().manual_seed(9)
    world = EmulatedWorld(W, T, D, K, E, dt, device="cpu", row_regions=1, capacity="worst", timeout_s=0.02)
    xs = [torch.randn(T, D, generator=gen, dtype=dt) for _ in range(W)]
    idxs = [_kind_routing(30 + d, T, K, E, W, "random") for d in range(W)]
    gates = [torch.rand(T, K, generator=gen, dtype=dt) for _ in range(W)]
    res = world.dispatch_rows(xs, idxs, gates, region=0, overlap=True)
    h0 = res[0][3]
    assert int(h0.rows_from_W[1]) > 0
    world.buffers[0].region_counters()[0].zero_()  # rank 1's rows "never arrived" at rank 0
    h0.overlap.wait()
    with pytest.raises(ExchangeError, match=r"rank 0 waited .* from rank 1"):
        world.buffers[0].check()


@pytest.mark.parametrize("offsets,N", [([3, 9, 9, 9, 20, 33], 40), ([0, 0, 0, 5, 5, 5], 8), ([4, 4, 4], 4),
                                       ([0, 130, 260, 300, 301, 640], 700)])
def test_phase_tile_counts(offsets, N):
    """The overlapped gate/up GEMM's two tile walks over 3e virtual experts: phase 0 gets tiles only
    for the own runs (v % 3 == 1), phase 1 for the others and the padding; together exactly the
    tiles of the one-launch walk over the same runs (``prep_offsets(phase=)``, the real prep kernel)."""
    from tlx_dist.grouped_gemm.host import prep_offsets

    BM = 32
    off = torch.tensor(offsets, dtype=torch.int32)
    rows = torch.diff(torch.tensor([0] + offsets + [N])).tolist()
    m_tiles = [-(-r // BM) for r in rows]
    _, all_cum = prep_offsets(off, N, BM)
    _, cum0 = prep_offsets(off, N, BM, phase=0)
    _, cum1 = prep_offsets(off, N, BM, phase=1)
    want0 = [m if v < len(offsets) and v % 3 == 1 else 0 for v, m in enumerate(m_tiles)]
    want1 = [0 if v < len(offsets) and v % 3 == 1 else m for v, m in enumerate(m_tiles)]
    assert torch.equal(all_cum, torch.tensor(m_tiles).cumsum(0).to(torch.int32))
    assert torch.equal(cum0, torch.tensor(want0).cumsum(0).to(torch.int32)), cum0
    assert torch.equal(cum1, torch.tensor(want1).cumsum(0).to(torch.int32)), cum1


def test_overlapped_forward_in_a_recompute_leaves_the_combine_whole():
    """Activation checkpointing recomputes the forward inside the backward and may stop right after
    the fused GEMMs (non-reentrant early stop): there the overlapped forward must not start the
    combine's op (no early partial rows), and joins the rows' side stream itself; the combine, if
    it runs, sends everything. Also: the forward refuses calls that are not this dispatch's row form
    before it launches anything."""
    W, E, K, D, Fe, T = 2, 4, 2, 8, 4, 6
    f32 = torch.float32
    gen = torch.Generator().manual_seed(4)
    world = EmulatedWorld(W, T, D, K, E, f32, device="cpu", row_regions=1, capacity="worst")
    xs = [torch.randn(T, D, generator=gen, dtype=f32) for _ in range(W)]
    idxs = [_kind_routing(50 + d, T, K, E, W, "random") for d in range(W)]
    gates = [torch.rand(T, K, generator=gen, dtype=f32) for _ in range(W)]
    res = world.dispatch_rows(xs, idxs, gates, region=0, overlap=True)
    w13 = torch.randn(E // W, D, 2 * Fe, generator=gen, dtype=f32)
    w2 = torch.randn(E // W, Fe, D, generator=gen, dtype=f32)
    recv, src, gate_N, h = res[0]
    with pytest.raises(ValueError, match="dst_N must be src_N"):
        fused_experts_rows(recv, src, src.clone(), gate_N, w13, w2, h.offsets_e, recv.shape[0], backend="triton",
                           overlap=h.overlap)
    with pytest.raises(ValueError, match="num_dst"):
        fused_experts_rows(recv, src, src, gate_N, w13, w2, h.offsets_e, recv.shape[0] - 1, backend="triton",
                           overlap=h.overlap)
    with pytest.raises(ValueError, match="offsets_E"):
        fused_experts_rows(recv, src, src, gate_N, w13, w2, h.offsets_e.clone(), recv.shape[0], backend="triton",
                           overlap=h.overlap)
    assert h.overlap.partials_sent is None and not h.overlap.waited, "a refused call launched something"
    parts = {}

    class InBackward(torch.autograd.Function):  # runs rank d's fused forward the way a recompute does
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            for d, (r, s_, gn, hh) in enumerate(res):
                parts[d] = fused_experts_rows(r, s_, s_, gn, w13, w2, hh.offsets_e, r.shape[0], backend="triton",
                                              overlap=hh.overlap)
            return g

    InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    for d, (*_, hh) in enumerate(res):
        assert hh.overlap.waited and hh.overlap.joined and hh.overlap.partials_sent is None, d
    want = [fused_experts_rows(r, s_, s_, gn, w13, w2, hh.offsets_e, r.shape[0], backend="triton")
            for r, s_, gn, hh in res]
    outs = world.combine_rows([parts[d] for d in range(W)], [r[3] for r in res])  # a whole combine
    for d in range(W):
        torch.testing.assert_close(parts[d], want[d], rtol=1e-5, atol=1e-5)
        assert outs[d].shape == (T, D)
    world.check()
    world.close()


def test_an_abandoned_overlapped_dispatch_does_not_leak_into_the_next():
    """An overlapped dispatch whose forward is abandoned before its GEMMs (no wait, no combine) leaves
    its rows' counts in the region counters; the next dispatch into that region takes them off first
    (``RowsOverlap.finish`` of the old plan), so its own wait counts only its own rows."""
    W, E, K, D, T = 2, 4, 2, 8, 5
    f32 = torch.float32
    gen = torch.Generator().manual_seed(13)
    world = EmulatedWorld(W, T, D, K, E, f32, device="cpu", row_regions=1, capacity="worst")

    def op(seed):
        xs = [torch.randn(T, D, generator=gen, dtype=f32) for _ in range(W)]
        idxs = [_kind_routing(seed + d, T, K, E, W, "random") for d in range(W)]
        gates = [torch.rand(T, K, generator=gen, dtype=f32) for _ in range(W)]
        return world.dispatch_rows(xs, idxs, gates, region=0, overlap=True)

    first = op(70)
    assert all(not h.overlap.waited for *_, h in first)
    second = op(80)  # the first forward was abandoned: no GEMMs, no combine
    for d, (*_, h) in enumerate(first):
        assert h.overlap.waited and h.overlap.joined, f"rank {d}: the abandoned plan was not finished"
    for d, (recv, src, gate_N, h) in enumerate(second):
        want = h.rows_from_W.clone()
        want[d] = 0
        assert torch.equal(world.buffers[d].region_counters()[0], want), f"rank {d}: stale counts"
    parts = [torch.zeros_like(r) for r, *_ in second]
    for p_, (*_, h) in zip(parts, second):
        h.overlap.wait()
    world.combine_rows(parts, [h for *_, h in second])
    for b in world.buffers:
        assert int(b.region_counters().abs().sum()) == 0
    world.check()
    world.close()


def _comb_world(Ts, D, K, E, monkeypatch, comb_mode=None):
    world = EmulatedWorld(len(Ts), max(Ts), D, K, E, torch.float64, device="cpu")
    if comb_mode is not None:
        for b in world.buffers:
            b.modes["comb"] = comb_mode  # (pinned: the emulated world would sum by blocks)
    return world


# the 4-rank worlds in the release tier; both row modes stay in the fast tier at W = 2
@pytest.mark.parametrize("Ts,kind,rows", [([7, 5], "random", True),
                                          pytest.param([4, 0, 6, 2], "random", False, marks=pytest.mark.release),
                                          pytest.param([5, 3, 6, 2], "heavy_imbalance", True, marks=pytest.mark.release),
                                          ([6, 6], "zero_token_experts", False)])
def test_combine_counts_partial_rows_per_token_block(monkeypatch, Ts, kind, rows):
    """The combine's per-token-block arrival counters (CBLK; ``policy.comb_mode`` "blocks" in the
    emulated world, and on real ranks the counters the one-launch combine sums by). With 3-token
    blocks and 4-row reduce-send tiles a tile's rows straddle blocks and sources. After the send
    phase, source s's counter (d, j) holds the rows of its token block j that rank d sent back: the
    block's tokens that went to d (row form: none from s itself, whose partial rows stay where they
    are). After the op every counter is zero and the output is bit for bit the one-count-per-rank
    path's ("after", the NVSHMEM route's), twice over on the same buffers."""
    from tlx_dist.comm.symm import tuning
    import tlx_dist.comm.symm as symm
    from tlx_dist.comm.symm import policy
    import tlx_dist.comm.symm.buffers as sb
    monkeypatch.setattr(sb, "COMB_BLOCK", 3)
    monkeypatch.setattr(tuning, "_tiles", lambda D, rows=None, cols=512: (4, 4))
    W, E, K, D = len(Ts), 12, 3, 8
    world, ref_world = _comb_world(Ts, D, K, E, monkeypatch), _comb_world(Ts, D, K, E, monkeypatch, "after")
    bufs = world.buffers
    assert bufs[0].layout.comb_block == 3 and policy.comb_mode(bufs[0]) == "blocks"
    gen = torch.Generator().manual_seed(8)
    for rep in range(2):
        xs = [torch.randn(T, D, generator=gen, dtype=torch.float64) for T in Ts]
        idxs = [_kind_routing(40 + s + rep, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
                for s, T in enumerate(Ts)]
        gates = [torch.rand(T, K, generator=gen, dtype=torch.float64) for T in Ts]
        outs = []
        for w in (world, ref_world):
            res = w.dispatch_rows(xs, idxs, gates) if rows else w.dispatch(xs, idxs, gates)
            hs = [r[-1] for r in res]
            if rows:
                ys = [torch.randn(W * max(Ts), D, generator=torch.Generator().manual_seed(60 + rep + d),
                                  dtype=torch.float64) for d in range(W)]
                gens = [symm.combine_rows_steps(w.buffers[d], ys[d], hs[d]) for d in range(W)]
            else:
                ys = [torch.randn(r[0].shape[0], D, generator=torch.Generator().manual_seed(60 + rep + d),
                                  dtype=torch.float64) for d, r in enumerate(res)]
                gens = [symm.combine_steps(w.buffers[d], ys[d], hs[d]) for d in range(W)]
            for g in gens:  # reduce-send
                next(g)
            if w is world:
                for s in range(W):
                    ctr = bufs[s].comb_block_counters()
                    sent = hs[s].send_row_TW.long() >= 0  # [T_s, W]
                    want = torch.zeros_like(ctr)
                    for d in range(W):
                        if rows and d == s:
                            continue
                        for j in range(-(-Ts[s] // 3)):
                            want[d, j] = int(sent[3 * j:3 * j + 3, d].sum())
                    assert torch.equal(ctr, want), f"rep {rep}: source {s}'s counters {ctr} != {want}"
            out = []
            for g in gens:
                try:
                    next(g)
                    raise AssertionError("combine has two phases")
                except StopIteration as stop:
                    out.append(stop.value)
            outs.append(out)
        for s in range(W):
            assert not bufs[s].comb_block_counters().any(), f"rep {rep}: rank {s}'s counters were not zeroed"
            assert outs[0][s].shape == (Ts[s], D)
            assert torch.equal(outs[0][s], outs[1][s]), f"rep {rep}: rank {s}'s combine differs from the ARRIVE path"
            assert outs[0][s].abs().sum() > 0 or Ts[s] == 0
    world.check()
    ref_world.check()


def test_combine_block_wait_names_the_peer_that_skipped():
    """One virtual rank skips a combine: the other's per-block wait gives up after timeout_s (no
    hang), and check() raises ExchangeError naming the combine, this rank and the peer."""
    from tlx_dist.comm.emulated import run_lockstep
    from tlx_dist.comm.symm import combine_steps
    from tlx_dist.comm.symm.buffers import ExchangeError
    W, E, K, D, T = 2, 4, 2, 4, 6
    world = EmulatedWorld(W, T, D, K, E, torch.float64, device="cpu", timeout_s=0.002)
    xs = [torch.randn(T, D, dtype=torch.float64) for _ in range(W)]
    idxs = [torch.tensor([[0, 2]] * T) for _ in range(W)]  # every token goes to both ranks
    gates = [torch.rand(T, K, dtype=torch.float64) for _ in range(W)]
    res = world.dispatch(xs, idxs, gates)
    run_lockstep([combine_steps(world.buffers[0], res[0][0], res[0][1])])  # rank 1 skips
    with pytest.raises(ExchangeError, match=r"rank 0 waited 0.002 s for the combine partial rows from rank 1"):
        world.buffers[0].check()
    world.buffers[1].check()


def test_one_launch_combine_host_path_on_one_rank(monkeypatch):
    """The one-launch combine (``comb_mode`` "overlap", real ranks over peer pointers) run through
    the interpreter where it can be: one rank, row form, bf16 -- its summing programs (the launch's
    first) wait for no peer (the own partial rows are read in place), so the sequential interpreter
    runs them to the end. One kernel per combine; its output is the two-launch path's bit for bit,
    twice (the op's end readies the next). fp64 rows (too many registers a thread for programs to
    wait beside the senders) keep two launches."""
    from tlx.comm import exchange

    launched = []

    class Counting:
        def __init__(self, name, kernel):
            self._name, self._kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self._name)
            return self._kernel[grid]

    for name in ("_reduce_send_kernel", "_reduce_recv_kernel"):
        monkeypatch.setattr(exchange, name, Counting(name, getattr(exchange, name)))
    T, E, K, D = 70, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    for dt, want in ((torch.bfloat16, ["_reduce_send_kernel"]), (torch.float64, ["_reduce_send_kernel",
                                                                                 "_reduce_recv_kernel"])):
        world = EmulatedWorld(1, T, D, K, E, dt, device="cpu")
        b = world.buffers[0]
        for rep in range(2):
            x = torch.randn(T, D, generator=gen).to(dt)
            idx = _kind_routing(50 + rep, T, K, E, 1, "random")
            gate = torch.rand(T, K, generator=gen, dtype=torch.float64)
            recv, src, gate_N, h = world.dispatch_rows([x], [idx], [gate])[0]
            part = torch.randn(recv.shape, generator=gen).to(dt)
            outs = []
            for mode in ("overlap", "blocks"):
                b.modes["comb"] = mode  # (pinned: one rank of an emulated world would sum by blocks)
                launched.clear()
                outs.append(world.combine_rows([part], [h])[0])
                if mode == "overlap":
                    assert launched == want, (dt, launched)
            assert torch.equal(outs[0], outs[1]) and outs[0].shape == (T, D)
            # token t's row is its own partial row (one rank: nothing else to add)
            assert torch.equal(outs[0], part[h.send_row_TW[:, 0].long()])
            assert not b.comb_block_counters().any()
        b.modes.pop("comb")
        world.check()
