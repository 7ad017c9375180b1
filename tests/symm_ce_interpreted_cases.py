"""The copy-engine row form (``ExchangeConfig.copy_engine``, ``tlx_dist/comm/copy_engine.py``) on CPU: the real
tlx/comm kernels under TRITON_INTERPRET=1 in an emulated world whose "copy engine" is ``memmove``,
against the SM row form of the same world (the oracle that the rest of the suite ties to the
all-to-all reference and to a brute-force fp64 MoE).

The dense layout puts token t's row at receive row ``s*T_max + t`` on every rank, so the receive
rows differ from the SM form's; what the experts read through ``src_N``, the gates, the offsets and
every output and gradient must not. Run by tests/test_symm_interpreted.py in a child pytest."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from symm_interpreted_cases import _kind_routing  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld  # noqa: E402
from tlx_dist.comm.symm.buffers import ExchangeError  # noqa: E402
from tlx_dist.fused import fused_experts_rows  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


def _ops(Ts, kind, W, E, K, D, dt, n_ops, seed):
    gen = torch.Generator().manual_seed(seed)
    ops = []
    for s in range(n_ops):
        xs = [torch.randn(T, D, generator=gen, dtype=dt) for T in Ts]
        idxs = [_kind_routing(60 + 5 * s + d, T, K, E, W, kind) if T else torch.zeros(0, K, dtype=torch.long)
                for d, T in enumerate(Ts)]
        gates = [torch.rand(T, K, generator=gen, dtype=dt) for T in Ts]
        ops.append((xs, idxs, gates))
    return ops


def _run(world, ops, w13, w2, e, overlap, backend, dt):
    """Per op: dispatch into region k, the fused expert math, combine, then both backward ops.
    Returns what must not depend on the layout, and checks every counter is back to zero."""
    got = []
    gen = torch.Generator().manual_seed(99)
    for k, (xs, idxs, gates) in enumerate(ops):
        res = world.dispatch_rows(xs, idxs, gates, region=k, overlap=overlap)
        parts = []
        for d, (recv, src, gate_N, h) in enumerate(res):
            w13s, w2s = w13[d * e:(d + 1) * e], w2[d * e:(d + 1) * e]
            part = fused_experts_rows(recv, src, src, gate_N, w13s, w2s, h.offsets_e, recv.shape[0],
                                      backend=backend, overlap=h.overlap)
            n = int(h.offsets_e[-1])
            got.append(("rows", recv[src[:n].long()].clone(), gate_N[:n].clone(), h.offsets_e.clone()))
            parts.append(part)
        handles = [h for *_, h in res]
        got.append(("out", *world.combine_rows(parts, handles)))
        gs = [torch.randn(x.shape, generator=gen, dtype=dt) for x in xs]
        gp = world.combine_rows_grad(gs, handles)
        # the gradient of the receive rows, read through src_N (rows nobody reads are not compared)
        got.append(("g_part", *[g[src[:int(h.offsets_e[-1])].long()].clone() for g, (_, src, _, h) in zip(gp, res)]))
        # receive-row gradients that do not depend on the layout: the receive rows themselves (token t's
        # row is x_s[t] on every rank it reached, wherever the layout puts it), scaled per rank
        gR = [recv.clone() * (d + 1) for d, (recv, *_) in enumerate(res)]
        gN = [torch.randn(int(h.num_recv_rows), generator=gen, dtype=torch.float32 if dt != torch.float64 else dt)
              for h in handles]
        back = world.dispatch_rows_grad(gR, gN, handles)
        got.append(("back", *[b[0] for b in back], *[b[1] for b in back]))
        for d, b in enumerate(world.buffers):
            assert int(b.region_counters().abs().sum()) == 0, f"op {k} rank {d}: region counters left"
            assert int(b.comb_block_counters().abs().sum()) == 0, f"op {k} rank {d}: CBLK left"
            assert int(b.recv_block_counters().abs().sum()) == 0, f"op {k} rank {d}: RBLK left"
    world.check()
    return got


@pytest.mark.parametrize("overlap", [False, True])
# the 4-rank worlds in the release tier (4-rank chunked combines stay fast: test_ce_combine_in_chunks_...)
@pytest.mark.parametrize("Ts,kind", [([5, 3], "random"), ([3, 5], "random"),
                                     pytest.param([4, 0, 6, 2], "random", marks=pytest.mark.release),
                                     pytest.param([3, 5, 2, 4], "heavy_imbalance", marks=pytest.mark.release),
                                     ([6, 6], "zero_token_experts")])
def test_ce_row_form_matches_the_sm_row_form(Ts, kind, overlap):
    """Two ops in a row into two regions, fwd and both backward ops: bit for bit the SM row form
    (fp64, the reference expert math). Unequal T covers a source with more tokens than the owner
    (its copy extent), whose extra partial rows the fix-up kernel stores, and a rank of 0 tokens."""
    W, E, K, D, Fe = len(Ts), 12, 3, 8, 4
    e, dt, T_max = E // W, torch.float64, max(Ts)
    gen = torch.Generator().manual_seed(5)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=dt) * 0.5
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=dt) * 0.5
    ops = _ops(Ts, kind, W, E, K, D, dt, 2, 7)
    outs = {}
    for ce in (False, True):
        world = EmulatedWorld(W, T_max, D, K, E, dt, device="cpu", row_regions=2, capacity="worst", copy_engine=ce)
        outs[ce] = _run(world, ops, w13, w2, e, overlap, "reference", dt)
        if ce:
            res = world.dispatch_rows(*ops[0], region=0)
            for d, (_, _, _, h) in enumerate(res):
                assert h.dense
                t = torch.arange(Ts[d], dtype=torch.int32)
                # the dense layout: a token's receive row is its index where it is routed, -1 elsewhere
                routed = (ops[0][1][d] // e)[:, :, None] == torch.arange(W)[None, None, :]
                want = torch.where(routed.any(1), t[:, None], torch.full_like(t[:, None], -1))
                assert torch.equal(h.send_row_TW, want), f"rank {d}: send_row is not the dense layout"
                assert h.rows_from_W.tolist() == Ts, f"rank {d}: rows from each source must be its T"
            world.combine_rows([torch.zeros_like(r) for r, *_ in res], [h for *_, h in res])
        world.close()
    for a, b in zip(outs[False], outs[True]):
        assert a[0] == b[0]
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x, y), f"{a[0]}: the copy-engine row form differs from the SM one"


def test_ce_overlapped_triton_forward_sends_partials_early():
    """The fused forward's phased path (portable Triton kernels, interpreted) with the overlap: the
    peers' partial rows leave by copy engines from ``send_partials``, the combine only sums: equal to
    the SM form to fp32 rounding (the expert sums run in another order), exchange outputs bit for bit."""
    Ts, W, E, K, D, Fe = [5, 3], 2, 8, 2, 8, 4
    e, dt, T_max = E // W, torch.float32, max(Ts)
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=dt) * 0.5
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=dt) * 0.5
    ops = _ops(Ts, "random", W, E, K, D, dt, 1, 8)
    outs = {}
    for ce in (False, True):
        world = EmulatedWorld(W, T_max, D, K, E, dt, device="cpu", row_regions=1, capacity="worst", copy_engine=ce)
        res = world.dispatch_rows(*ops[0], region=0, overlap=True)
        parts = []
        for d, (recv, src, gate_N, h) in enumerate(res):
            parts.append(fused_experts_rows(recv, src, src, gate_N, w13[d * e:(d + 1) * e], w2[d * e:(d + 1) * e],
                                            h.offsets_e, recv.shape[0], backend="triton", overlap=h.overlap))
            assert h.overlap.partials_sent is not None
        outs[ce] = world.combine_rows(parts, [h for *_, h in res])
        for d, b in enumerate(world.buffers):
            assert int(b.comb_block_counters().abs().sum()) == 0, f"rank {d}: CBLK left"
        world.check()
        world.close()
    for x, y in zip(outs[False], outs[True]):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_ce_dispatch_of_a_rank_that_skips_is_an_error_naming_it():
    """Rank 1 skips a copy-engine dispatch: rank 0's rows wait gives up after the timeout, the
    host raises naming the op and the peer (no hang)."""
    from tlx_dist.comm.symm import dispatch_steps, run_steps
    Ts, W, E, K, D = [4, 4], 2, 8, 2, 8
    world = EmulatedWorld(W, 4, D, K, E, torch.float32, device="cpu", row_regions=1, capacity="worst",
                          timeout_s=0.02, copy_engine=True)
    (xs, idxs, gates), = _ops(Ts, "random", W, E, K, D, torch.float32, 1, 9)
    run_steps(dispatch_steps(world.buffers[0], xs[0], idxs[0], gates[0], "worst", rows=True, region=0))
    with pytest.raises(ExchangeError, match=r"rank 0.*(peer|rank) 1"):
        world.buffers[0].check()


@pytest.mark.parametrize("Ts,chunks", [([7, 5], {"ce_chunk_rows": 4}), ([5, 7, 0, 3], {"ce_chunk_rows": 4}),
                                       ([7, 5], {"ce_chunk_rows": 12, "ce_tail_rows": 3})], ids=["W2", "W4", "W2_tail"])
def test_ce_combine_in_chunks_straddling_token_blocks(monkeypatch, Ts, chunks):
    """3-token counter blocks and 4-row copy chunks (so 3-row chunks, one signal each; the owner with
    fewer tokens than a source copies its own count and the fix-up kernel stores the rest), or one
    12-row chunk cut down (the default's shape: a last copy cut in halves; here 3 + 4 rows): still bit
    for bit the SM row form, every counter back at zero."""
    import tlx_dist.comm.symm.buffers as sb
    from tlx_dist.comm.symm import ExchangeConfig
    from tlx_dist.comm.symm.ce_transport import ce_chunks
    monkeypatch.setattr(sb, "COMB_BLOCK", 3)
    if "ce_tail_rows" in chunks:
        assert ce_chunks(7, 3, 12, 3) == [(0, 3), (3, 7)]
    W, E, K, D, Fe = len(Ts), 8, 2, 8, 4
    e, dt, T_max = E // W, torch.float64, max(Ts)
    gen = torch.Generator().manual_seed(6)
    w13 = torch.randn(E, D, 2 * Fe, generator=gen, dtype=dt) * 0.5
    w2 = torch.randn(E, Fe, D, generator=gen, dtype=dt) * 0.5
    ops = _ops(Ts, "random", W, E, K, D, dt, 2, 17)
    outs = {}
    for ce in (False, True):
        world = EmulatedWorld(W, T_max, D, K, E, dt, device="cpu", row_regions=2, capacity="worst",
                              config=ExchangeConfig(copy_engine="on" if ce else "off", **chunks))
        assert world.buffers[0].layout.comb_block == 3
        outs[ce] = _run(world, ops, w13, w2, e, False, "reference", dt)
        world.close()
    for a, b in zip(outs[False], outs[True]):
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x, y), f"{a[0]}: the copy-engine row form differs from the SM one"
