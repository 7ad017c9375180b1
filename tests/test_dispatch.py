"""Dispatchers and layout math: Local (one rank) and AllToAll (gloo, W = 2, 4) against a
brute-force model of where every (token, k) row must land."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from tlx_dist.comm import AllToAllDispatcher, LocalDispatcher, layout_from_counts, sort_slots
from tlx_dist.comm.layout import dest_rows


def _brute_force_receive(xs, idxs, E, W):
    """For each rank d: the rows it must hold, expert-major then source rank then source slot."""
    e = E // W
    out = []
    for d in range(W):
        rows = []
        for j in range(e):
            g = d * e + j
            for s, (x, idx) in enumerate(zip(xs, idxs)):
                T, K = idx.shape
                for t in range(T):
                    for k in range(K):
                        if int(idx[t, k]) == g:
                            rows.append(x[t])
        out.append(torch.stack(rows) if rows else xs[0].new_zeros(0, xs[0].shape[1]))
    return out


def _routing(seed, T, K, E, kind):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    elif kind == "one_expert":  # every token's first choice is expert E-1 (last rank's last expert)
        idx = torch.stack([torch.cat([torch.tensor([E - 1]), torch.randperm(E - 1, generator=g)[:K - 1]]) for _ in range(T)])
    elif kind == "first_rank_only":  # only rank 0's experts receive anything; other ranks get zero rows
        idx = torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(T)])
    else:
        raise ValueError(kind)
    return idx.long()


def test_layout_math_single_rank_is_sorted_order():
    idx = torch.tensor([[2, 0], [1, 2], [2, 1]])
    slots = sort_slots(idx, 3)
    assert slots.counts_E.tolist() == [1, 2, 3]
    assert slots.order_S.tolist() == [1, 2, 5, 0, 3, 4]  # stable: token order kept within expert
    assert slots.rank_in_expert_S.tolist() == [0, 0, 1, 0, 1, 2]
    lay = layout_from_counts(slots.counts_E[None])
    assert lay.offsets_We.tolist() == [[1, 3, 6]]
    assert dest_rows(lay, 0, slots, idx).tolist() == list(range(6))


def test_layout_math_multi_rank_hand_example():
    # W=2, E=4 (e=2). counts C[s, g]:
    C = torch.tensor([[1, 2, 0, 3],
                      [2, 0, 1, 1]])
    lay = layout_from_counts(C)
    assert lay.recv_counts_We.tolist() == [[3, 2], [1, 4]]
    assert lay.offsets_We.tolist() == [[3, 5], [1, 5]]
    # rank 0: expert 0 rows [src0: 0, src1: 1..2], expert 1 rows [src0: 3..4, src1: -]
    assert lay.block_start_WE.tolist() == [[0, 3, 0, 1], [1, 5, 0, 4]]
    # Invariants: offsets = cumsum(counts); all counts sum to every slot.
    assert torch.equal(lay.offsets_We, lay.recv_counts_We.cumsum(1))
    assert int(lay.recv_counts_We.sum()) == int(C.sum())


@pytest.mark.parametrize("T,K,E", [(10, 2, 4), (1, 1, 1), (0, 2, 4), (7, 5, 5)],
                         ids=["basic", "single_token_single_expert", "empty", "k_eq_e_prime"])
def test_local_dispatch_combine_roundtrip(T, K, E):
    torch.manual_seed(0)
    x = torch.randn(T, 6, dtype=torch.float64, requires_grad=True)
    idx = _routing(0, T, K, E, "random")
    d = LocalDispatcher(E)
    recv, h = d.dispatch(x, idx)
    expect = _brute_force_receive([x.detach()], [idx], E, 1)[0]
    assert torch.equal(recv.detach(), expect)
    assert h.offsets_e.dtype == torch.int32 and h.offsets_e.tolist() == h.recv_counts_e.cumsum(0).tolist()
    y = d.combine(recv * 2, h)  # combine returns each slot's row at [t, k]
    assert torch.equal(y.detach(), 2 * x.detach()[:, None, :].expand(T, K, 6))
    # Backward of dispatch is a combine summed over k: d/dx sum(y) = 2*K for every element.
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0 * K))
    inv = torch.empty_like(h.order_S)
    inv[h.order_S] = torch.arange(T * K)
    assert torch.equal(inv, h.inverse_S)


KINDS = ["random", "one_expert", "first_rank_only"]


def _a2a_worker(rank, world, T, K, E):
    # One process group serves every routing kind (process start-up dominates on 2 cores).
    results = {}
    d = AllToAllDispatcher(E, dist.group.WORLD)
    for kind in KINDS:
        torch.manual_seed(100 + rank)
        x = torch.randn(T, 8, dtype=torch.float64, requires_grad=True)
        idx = _routing(rank, T, K, E, kind)
        recv, h = d.dispatch(x, idx)
        y_TKD = d.combine(recv * (1 + rank), h)  # scaled by the *expert's* rank: see the round trip
        g = torch.randn(T, K, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + rank))
        (y_TKD * g).sum().backward()
        results[kind] = dict(x=x.detach(), idx=idx, recv=recv.detach(), offsets=h.offsets_e,
                             y=y_TKD.detach(), g=g, dx=x.grad)
    try:
        d.dispatch(torch.randn(3, 2), torch.tensor([[0], [E + 5], [1]]))
        results["bad_ids"] = "no error"
    except ValueError as err:
        results["bad_ids"] = str(err)
    return results


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.release)])
def test_all_to_all_matches_brute_force(world):
    """Kinds: random routing; every token's first choice on the last rank (one expert holds T*W
    rows); only the first half of the ranks' experts used (the others receive zero rows)."""
    E, K, T = 4 * world, 3, 9
    all_res = run_world(_a2a_worker, world, T, K, E)
    e = E // world
    for kind in KINDS:
        res = [r[kind] for r in all_res]
        expect = _brute_force_receive([r["x"] for r in res], [r["idx"] for r in res], E, world)
        for d, r in enumerate(res):
            assert torch.equal(r["recv"], expect[d]), f"{kind}: rank {d} received the wrong rows"
            every_idx = torch.cat([q["idx"].reshape(-1) for q in res])
            counts = torch.stack([(every_idx == d * e + j).sum() for j in range(e)])
            assert r["offsets"].tolist() == counts.cumsum(0).tolist()
            # Combine brings each slot's row back from the expert's rank, scaled by (1 + that rank).
            owner = r["idx"] // e
            assert torch.equal(r["y"], r["x"][:, None, :] * (1 + owner[..., None]).double())
            # dispatch backward = combine of the gradient, summed over k (fp64; only the order of
            # the k-sum differs, hence a rounding-level tolerance).
            torch.testing.assert_close(r["dx"], (r["g"] * (1 + owner[..., None]).double()).sum(1),
                                       rtol=1e-13, atol=1e-13)
        if kind == "first_rank_only":
            assert all(res[d]["recv"].shape[0] == 0 for d in range(world // 2, world))
    for r in all_res:
        assert f"idx_TK holds expert ids in [0, {E + 5}], outside [0, {E})" in r["bad_ids"], r["bad_ids"]
