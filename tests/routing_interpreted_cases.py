"""The one-launch expert-major layout (tlx/common/routing.py) under the Triton interpreter, against
the torch sort it replaces: rows, order, offsets, the scheduler's tile_cum and the dW expert order,
on random and adversarial routing. Run by tests/test_routing_layout.py in a TRITON_INTERPRET=1 child."""

from __future__ import annotations

import os

import pytest
import torch

from tlx_dist.fused import expert_major_layout, expert_major_slots
from tlx_dist.fused.backends import sched_order_offset

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter child only")


def _ids(kind: str, T: int, K: int, E: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":  # K distinct experts per token, as top-k gives
        return torch.rand(T, E, generator=g).topk(K, dim=1).indices
    if kind == "one_expert_all":  # every token's first choice is expert E - 1, K = 1
        return torch.full((T, K), E - 1, dtype=torch.int64)
    if kind == "zero_token_experts":  # only even experts ever chosen
        return (torch.rand(T, E // 2, generator=g).topk(K, dim=1).indices * 2)
    if kind == "skewed":  # most slots on three experts, ties in count between the rest
        base = torch.rand(T, E, generator=g)
        base[:, :3] += 2.0
        return base.topk(K, dim=1).indices
    raise ValueError(kind)


CASES = [  # (kind, T, K, E, BM)
    ("random", 1, 1, 1, 128),
    ("random", 1, 8, 8, 128),  # K = E
    ("random", 37, 3, 5, 4),  # odd sizes, tiny tiles: many tiles per expert
    ("random", 300, 8, 64, 128),  # several 1024-slot blocks
    ("random", 64, 2, 256, 16),  # E = 256: 257 bins -> 512
    ("one_expert_all", 513, 1, 6, 128),
    ("zero_token_experts", 200, 4, 16, 32),
    ("skewed", 257, 6, 12, 8),
]


def _lpt(counts: torch.Tensor) -> torch.Tensor:
    E = counts.shape[0]
    key = -counts.to(torch.int64) * (E + 1) + torch.arange(E)  # count descending, index ascending
    return torch.argsort(key).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}K{c[2]}E{c[3]}")
def test_layout_matches_the_torch_sort(case, dtype):
    kind, T, K, E, BM = case
    g = torch.Generator().manual_seed(T * 1000 + E)
    idx = _ids(kind, T, K, E, g).to(dtype)
    tok, order, offs, sched = expert_major_layout(idx, E, block_m=BM)
    tok_ref, order_ref, offs_ref = expert_major_slots(idx.to(torch.int64), E)
    assert tok.dtype == torch.int32 and order.dtype == torch.int64 and offs.dtype == torch.int32
    assert torch.equal(order, order_ref)  # the same stable order
    assert torch.equal(tok, tok_ref) and torch.equal(offs, offs_ref)
    _check_sched(sched, offs, T * K, BM)


def _check_sched(sched, offs, S, BM):
    """tile_cum as the prep kernel defines it (entry E: the padding rows' tiles), the LPT order."""
    E = offs.shape[0]
    counts = torch.diff(offs.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    tiles = (counts + BM - 1) // BM
    pad = (S - int(offs[-1]) + BM - 1) // BM
    want_cum = torch.cat([torch.cumsum(tiles, 0), (tiles.sum() + pad).reshape(1)]).to(torch.int32)
    assert torch.equal(sched[:E + 1], want_cum)
    o = sched_order_offset(E)
    assert o % 4 == 0 and sched.shape[0] == o + E
    assert torch.equal(sched[o:], _lpt(counts))


def test_ids_out_of_range_become_padding_rows():
    T, K, E = 50, 3, 7
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[::5, 0] = -1
    idx[1::7, 2] = E + 3
    idx[3, 1] = 2**32 + 1  # wraps to 1 in int32: must still be out of range
    idx[4, 1] = -(2**32) + 2
    tok, order, offs, sched = expert_major_layout(idx, E, block_m=4)
    _check_sched(sched, offs, T * K, 4)
    bad = ((idx < 0) | (idx >= E)).reshape(-1)
    n_good = int((~bad).sum())
    assert int(offs[-1]) == n_good
    assert torch.equal(torch.sort(order).values, torch.arange(T * K))  # still a permutation
    assert torch.equal(order[n_good:], torch.nonzero(bad).reshape(-1))  # padding rows in slot order
    assert torch.equal(tok.to(torch.int64), order // K)
    good = idx.reshape(-1).clone()
    good[bad] = E  # sorts after every expert, like the kernel's padding rows
    assert torch.equal(order, torch.sort(good, stable=True).indices)


def test_no_tokens_and_no_experts():
    tok, order, offs, sched = expert_major_layout(torch.zeros(0, 4, dtype=torch.int64), 5)
    assert tok.numel() == 0 and order.numel() == 0
    assert offs.tolist() == [0] * 5 and sched[:6].tolist() == [0] * 6 and sched[8:].tolist() == list(range(5))
    with pytest.raises(ValueError, match="E=0 experts"):
        expert_major_layout(torch.zeros(3, 1, dtype=torch.int64), 0)
