"""The pure-PyTorch reference of the hierarchical exchange (tlx_dist/comm/hier_reference.py) against
the flat oracles (emulated.reference_dispatch, the per-slot combine formula, AllToAllDispatcher on
gloo) and against brute-force per-token leg counts, for W = 8 as 2x4 and 4x2, W = 4 as 2x2, one
node (the flat exchange) and one rank per node, on random and adversarial routing (tier T0/T1).

Dispatch moves bits: rows are compared exactly. The combine's fp64 sums are compared at 1e-12 of
the terms' magnitude; bf16 ones against the bound of their four roundings (below)."""

from __future__ import annotations

import pytest
import torch

from _dist import run_world
from tlx_dist.comm.emulated import reference_dispatch
from tlx_dist.comm.hier_reference import (check_hier_topology, destination_nodes, hier_combine_reference,
                                          hier_dispatch_reference)


def hier_routing(seed: int, T: int, K: int, E: int, W: int, L: int, kind: str) -> torch.Tensor:
    """``[T, K]`` int64 expert ids. Kinds: ``random`` top-K; ``one_node`` every expert of every token
    on node 0 (all tokens to one node: the other nodes' relays get nothing); ``empty_node`` no
    expert on the last node (a node that receives nothing); ``all_experts`` K = E (every token to
    every rank of every node); ``one_rank_per_node`` each token's K experts on one rank of each of
    K nodes (every row crosses a NIC once per node and is forwarded at most once)."""
    g = torch.Generator().manual_seed(seed)
    e = E // W
    per_node = e * L
    if T == 0:
        return torch.zeros(0, K, dtype=torch.long)
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if kind == "one_node":
        return torch.stack([torch.randperm(per_node, generator=g)[:K] for _ in range(T)])
    if kind == "empty_node":
        return torch.stack([torch.randperm(E - per_node, generator=g)[:K] for _ in range(T)])
    if kind == "all_experts":
        assert K == E
        return torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    if kind == "one_rank_per_node":
        N = W // L
        rows = []
        for _ in range(T):
            nodes = torch.randperm(N, generator=g)[:K]
            rows.append(nodes * per_node + torch.randint(0, per_node, (K,), generator=g))
        return torch.stack(rows)
    raise ValueError(kind)


def _world(W, L, E, K, Ts, D, kind, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, D, generator=gen).to(dtype) for T in Ts]
    idxs = [hier_routing(seed + 10 + s, T, K, E, W, L, kind) for s, T in enumerate(Ts)]
    gates = [torch.rand(T, K, generator=gen).to(dtype) for T in Ts]
    return xs, idxs, gates


def _brute_counts(idxs, E, W, L):
    """(NIC rows, NVLink rows) each rank sends in a dispatch, token by token: a token of s = (n, l)
    crosses to every other node it reaches once (to (m, l)); the row's holder on each node it
    reaches stores it into every other owner there."""
    e = E // W
    nic = [0] * W
    nvl = [0] * W
    for s, idx in enumerate(idxs):
        n, l = divmod(s, L)
        for t in range(idx.shape[0]):
            owners = {int(g) // e for g in idx[t]}
            for m in {o // L for o in owners}:
                holder = s if m == n else m * L + l
                if m != n:
                    nic[s] += 1
                nvl[holder] += sum(1 for o in owners if o // L == m and o != holder)
    return nic, nvl


def _combine_formula(ys_flat, idxs, gates, E, W):
    """fp64 ``sum_k gate * y[slot]`` per source token, and ``sum_k |gate * y|`` (the error bound's scale),
    with the expert-major rows ``ys_flat`` of reference_dispatch's order."""
    e = E // W
    outs, mags = [], []
    rows_of = {}
    for d in range(W):
        r = 0
        for j in range(e):
            g = d * e + j
            for s, idx in enumerate(idxs):
                for t, k in torch.nonzero(idx == g).tolist():
                    rows_of[(s, t, k)] = (d, r)
                    r += 1
    for s, idx in enumerate(idxs):
        T, K = idx.shape
        D = ys_flat[0].shape[1]
        out = torch.zeros(T, D, dtype=torch.float64)
        mag = torch.zeros(T, D, dtype=torch.float64)
        for t in range(T):
            for k in range(K):
                d, r = rows_of[(s, t, k)]
                p = ys_flat[d][r].double() * (1.0 if gates is None else float(gates[s][t, k]))
                out[t] += p
                mag[t] += p.abs()
        outs.append(out)
        mags.append(mag)
    return outs, mags


CASES = [  # (W, L, E, K, kind): W = 8 as 2 x 4 and 4 x 2, W = 4 as 2 x 2, plus one node and one rank a node
    (8, 4, 16, 3, "random"), (8, 2, 16, 3, "random"), (4, 2, 8, 3, "random"),
    (8, 4, 16, 3, "one_node"), (8, 2, 16, 3, "one_node"), (4, 2, 8, 2, "one_node"),
    (8, 4, 16, 3, "empty_node"), (8, 2, 16, 3, "empty_node"), (4, 2, 8, 3, "empty_node"),
    (8, 4, 8, 8, "all_experts"), (4, 2, 4, 4, "all_experts"), (8, 2, 16, 4, "one_rank_per_node"),
    (4, 4, 8, 3, "random"),   # one node: no inter-node leg, the flat exchange
    (4, 1, 8, 3, "random"),   # one rank a node: every holder is the only owner, no NVLink leg
]


@pytest.mark.parametrize("W,L,E,K,kind", CASES)
def test_dispatch_reference_matches_flat_oracle_and_brute_counts(W, L, E, K, kind):
    Ts = [3 + (s * 5) % 7 for s in range(W)]
    Ts[1] = 0  # a rank with no tokens
    xs, idxs, _ = _world(W, L, E, K, Ts, 5, kind)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    flat = reference_dispatch(xs, idxs, E)
    for d in range(W):
        assert torch.equal(ref.recv[d][0], flat[d][0]), f"rank {d}: expert-major rows differ from the flat oracle"
        assert torch.equal(ref.recv[d][1], flat[d][1])
    nic, nvl = _brute_counts(idxs, E, W, L)
    assert ref.counts.nic_rows_W.tolist() == nic and ref.counts.nvl_rows_W.tolist() == nvl
    assert ref.counts.nic_bytes_W.tolist() == [r * 5 * 8 for r in nic]
    # NIC rows per token = its distinct destination nodes other than its own, exactly
    N = W // L
    for s, idx in enumerate(idxs):
        reach = destination_nodes(idx, E, W, L)
        reach[:, s // L] = False
        assert int(reach.sum()) == nic[s]
        for m in range(N):  # the relay of node m got exactly those tokens, in token order
            if m != s // L:
                assert ref.relay_rows[m * L + s % L][s].tolist() == torch.nonzero(reach[:, m]).flatten().tolist()
    # every rank holds one row per (source, token routed to it): the flat exchange's receive rows
    e = E // W
    for d in range(W):
        for s, idx in enumerate(idxs):
            want = torch.nonzero((idx // e == d).any(1)).flatten()
            assert ref.held_rows[d].get(s, torch.zeros(0, dtype=torch.long)).tolist() == want.tolist()
    if kind == "one_node":  # every other node's relays got nothing; the NICs carried node-0 rows only
        assert all(not v.numel() for r in range(L, W) for v in ref.relay_rows[r].values())
    if kind == "empty_node":
        assert all(not v.numel() for r in range(W - L, W) for v in ref.relay_rows[r].values())
        assert all(ref.recv[d][0].shape[0] == 0 for d in range(W - L, W))
    if L == W:
        assert not any(nic)
    if L == 1:
        assert not any(nvl)


@pytest.mark.parametrize("W,L,E,K,kind", CASES)
@pytest.mark.parametrize("gated", [True, False])
def test_combine_reference_matches_formula(W, L, E, K, kind, gated):
    Ts = [2 + (s * 3) % 5 for s in range(W)]
    xs, idxs, gates = _world(W, L, E, K, Ts, 4, kind)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    ys = [r * (1 + d) for d, (r, _) in enumerate(ref.recv)]  # rank d's "experts" scale by 1 + d
    outs, counts = hier_combine_reference(ys, idxs, gates if gated else None, E, L)
    expect, mag = _combine_formula(ys, idxs, gates if gated else None, E, W)
    for s in range(W):
        assert outs[s].dtype == torch.float64 and outs[s].shape == xs[s].shape
        assert ((outs[s] - expect[s]).abs() <= 1e-12 * (mag[s] + 1e-300)).all(), f"rank {s}"
    # one row per (token, remote node) back over the inter-node leg: what the relays got in dispatch
    d_counts = ref.counts
    for r in range(W):
        assert int(counts.nic_rows_W[r]) == sum(v.numel() for v in ref.relay_rows[r].values())
    assert int(counts.nic_rows_W.sum()) == int(d_counts.nic_rows_W.sum())
    # partial rows over NVLink: one per (owner, token) whose holder is another rank
    e = E // W
    nvl = [0] * W
    for s, idx in enumerate(idxs):
        n, l = divmod(s, L)
        for t in range(idx.shape[0]):
            for o in {int(g) // e for g in idx[t]}:
                holder = s if o // L == n else (o // L) * L + l
                nvl[o] += o != holder
    assert counts.nvl_rows_W.tolist() == nvl


def test_combine_reference_bf16_within_its_roundings():
    """bf16: the gated products, the owner's partial row, the relay's sum and the source's sum are each
    rounded once to bf16 (unit roundoff u = 2**-8), so the result is within 4u * sum_k |gate * y| of
    the exact sum (fp32 accumulation error is ~2**-24 per term, far below), and it is not the flat
    exchange's (which rounds three times): with enough tokens some differ."""
    W, L, E, K = 8, 4, 16, 4
    xs, idxs, gates = _world(W, L, E, K, [6] * W, 16, "random", torch.bfloat16, seed=3)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    ys = [r * (1 + d) for d, (r, _) in enumerate(ref.recv)]
    outs, _ = hier_combine_reference(ys, idxs, gates, E, L)
    expect, mag = _combine_formula(ys, idxs, gates, E, W)
    for s in range(W):
        assert outs[s].dtype == torch.bfloat16
        assert ((outs[s].double() - expect[s]).abs() <= 4 * 2.0 ** -8 * mag[s] * 1.001 + 1e-30).all(), f"rank {s}"
    ref1, _ = hier_combine_reference(ys, idxs, gates, E, W)  # one node: the flat exchange's roundings
    assert any(not torch.equal(a, b) for a, b in zip(outs, ref1)), "the node-level rounding changed nothing"


def test_one_node_is_the_flat_exchange():
    """L = W: every token is its own node's; no inter-node row, the source stores each row once into
    each other owner (the flat exchange's rows, ``rows_to`` of every rank)."""
    W, E, K = 4, 8, 3
    xs, idxs, gates = _world(W, W, E, K, [5, 4, 0, 3], 6, "random")
    ref = hier_dispatch_reference(xs, idxs, E, W)
    e = E // W
    assert ref.counts.nic_rows_W.tolist() == [0] * W
    assert ref.counts.nvl_rows_W.tolist() == [sum(int((i // e == d).any(1).sum()) for d in range(W) if d != s)
                                             for s, i in enumerate(idxs)]


def _gloo_a2a_dispatch(rank, world, W, L, E, K, Ts, D, kind):
    import torch.distributed as dist

    from tlx_dist.comm import AllToAllDispatcher
    xs, idxs, gates = _world(W, L, E, K, Ts, D, kind)
    recv, h = AllToAllDispatcher(E, dist.group.WORLD).dispatch(xs[rank], idxs[rank], gates[rank])
    return recv, h.offsets_e


@pytest.mark.parametrize("kind", ["random", "one_node"])
def test_dispatch_reference_matches_all_to_all_on_gloo(kind):
    """W = 4 as 2 x 2: the all-to-all path on 4 gloo ranks receives the reference's rows."""
    W, L, E, K, D = 4, 2, 8, 3, 5
    Ts = [4, 0, 6, 3]
    got = run_world(_gloo_a2a_dispatch, W, W, L, E, K, Ts, D, kind)
    xs, idxs, _ = _world(W, L, E, K, Ts, D, kind)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    for d, (recv, offs) in enumerate(got):
        assert torch.equal(recv, ref.recv[d][0])
        assert offs.tolist() == ref.recv[d][1].cumsum(0).tolist()


def test_reference_bad_input():
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the world size 4"):
        check_hier_topology(4, 3)
    with pytest.raises(ValueError, match="ranks_per_node=0 must be a positive integer"):
        check_hier_topology(4, 0)
    xs, idxs, _ = _world(4, 2, 8, 2, [2, 2, 2, 2], 3, "random")
    with pytest.raises(ValueError, match="outside"):
        hier_dispatch_reference(xs, [idxs[0] + 8] + idxs[1:], 8, 2)
    with pytest.raises(ValueError, match="one x_TD and one idx_TK per rank"):
        hier_dispatch_reference(xs, idxs[:3], 8, 2)


def test_reference_counts_match_the_scaling_projection():
    """The projection's hierarchical traffic (bench/scaling_traffic.py ``node_dedup``: expected rows
    per token over NVLink, forwards included, and over the NIC) is what the reference moves: uniform
    top-4 of 32 experts on W = 8 as 2 x 4, 3000 tokens a rank (the per-token counts' standard error
    is below 0.005; the bound is 0.02)."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import scaling_traffic as st

    W, L, E, K, T = 8, 4, 32, 4, 3000
    xs, idxs, _ = _world(W, L, E, K, [T] * W, 1, "random", seed=11)
    ref = hier_dispatch_reference(xs, idxs, E, L)
    legs = st.exchange_rows("node_dedup", E, K, W, L)
    tokens = W * T
    assert abs(float(ref.counts.nic_rows_W.sum()) / tokens - legs.nic) < 0.02, (ref.counts, legs)
    assert abs(float(ref.counts.nvl_rows_W.sum()) / tokens - legs.nvlink) < 0.02, (ref.counts, legs)
    flat = st.exchange_rows("rank_dedup", E, K, W, L)
    assert legs.nic < flat.nic  # (the flat exchange would cross the NIC once per remote rank)
