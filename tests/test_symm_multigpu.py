"""Real multi-GPU symmetric dispatch (tier T5): SymmDispatcher vs AllToAllDispatcher (NCCL) on W >= 2
GPUs, and MoELayer forward/backward with both. Launch with torchrun, one process per GPU:

    torchrun --nproc-per-node=2 -m pytest -m multigpu tests/test_symm_multigpu.py -q

The fused EP layers run with receive regions, and overlapped with a CUDA-graph replay. Groups
spanning nodes take the NVSHMEM route: tests/test_symm_nvshmem_multigpu.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="needs torchrun with WORLD_SIZE >= 2"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set"),
]



@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["random", "heavy_imbalance", "zero_token_experts"])
def test_symm_matches_all_to_all(group, kind):
    import torch.distributed as dist

    from tlx_dist.comm import AllToAllDispatcher, SymmBuffers, SymmDispatcher

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T_max = 8 * W, 4, 2048, 256
    T = T_max - 17 * r  # unequal token counts per rank
    g = torch.Generator(device="cuda").manual_seed(r)
    if kind == "random":
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    elif kind == "heavy_imbalance":  # everything to rank 0
        idx = torch.rand(T, E // W, device="cuda", generator=g).topk(K, dim=1).indices
    else:
        idx = torch.rand(T, E // 2, device="cuda", generator=g).topk(K, dim=1).indices * 2
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.rand(T, K, device="cuda", generator=g)
    bufs = SymmBuffers(T_max, D, K, E, torch.bfloat16, group)
    sd, ad = SymmDispatcher(E, group, buffers=bufs), AllToAllDispatcher(E, group)
    xs, xa = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gs, ga = gate.clone().requires_grad_(True), gate.clone().requires_grad_(True)
    rs, hs = sd.dispatch(xs, idx, gs)
    ra, ha = ad.dispatch(xa, idx, ga)
    n = ra.shape[0]
    assert rs.shape[0] == n and torch.equal(rs, ra)  # capacity="exact"
    assert torch.equal(hs.offsets_e, ha.offsets_e)
    assert hs.rows_to_W.tolist() == [int((idx // (E // W) == d).any(1).sum()) for d in range(W)]  # deduplicated
    scale = torch.tensor(1.0 + r, device="cuda", dtype=torch.bfloat16)
    ys, ya = sd.combine_weighted(rs * scale, hs, gs), ad.combine_weighted(ra * scale, ha, ga)
    # Per-rank partial sums then a sum over ranks vs one fp32 k-sum: the same terms, two roundings.
    torch.testing.assert_close(ys.float(), ya.float(), rtol=2 ** -7, atol=2 ** -7 * float(ya.float().abs().max()))
    gy = torch.randn(ys.shape, device="cuda", generator=g).to(torch.bfloat16)
    (ys.float() * gy.float()).sum().backward()
    (ya.float() * gy.float()).sum().backward()
    torch.testing.assert_close(xs.grad.float(), xa.grad.float(), rtol=2 ** -7, atol=2 ** -7 * float(xa.grad.abs().max()))
    torch.testing.assert_close(gs.grad, ga.grad, rtol=2 ** -7, atol=2 ** -7 * float(ga.grad.abs().max()))
    sd.check()
    bufs.close()


def test_moe_layer_symm_vs_all_to_all(group):
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer

    W = dist.get_world_size()
    cfg = MoEConfig(dim=1024, moe_inter_dim=512, num_experts=8 * W, top_k=4, dtype="bfloat16")
    torch.manual_seed(0)  # same seed on every rank: replicated router, expert e identical whatever W
    a = MoELayer(cfg, group, dispatcher="all_to_all", device="cuda")
    # the separate ops over the exchange (auto would take the fused EP form on sm_90, tested below)
    b = MoELayer(cfg, group, dispatcher="symm", device="cuda", pipeline="separate")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 128, 1024, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(dist.get_rank()))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oa, ob = a(xa), b(xb)
    torch.testing.assert_close(ob.float(), oa.float(), rtol=2 ** -7, atol=2 ** -7 * float(oa.float().abs().max()))
    oa.float().square().sum().backward()
    ob.float().square().sum().backward()
    torch.testing.assert_close(xb.grad.float(), xa.grad.float(), rtol=2e-2, atol=2e-2 * float(xa.grad.abs().max()))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad.float(), pa.grad.float(), rtol=2e-2,
                                   atol=2e-2 * float(pa.grad.abs().max()), msg=name)
    b.dispatcher.check()


@pytest.mark.parametrize("regions", [0, 2])
def test_moe_layer_fused_ep_vs_all_to_all(group, regions):
    """MoELayer(pipeline="fused", dispatcher="symm") at EP=W -- receive rows read by index, the
    gate/scatter epilogue into per-receive-row partials, one row home per (token, rank) -- against
    the all-to-all separate layer with the same weights and routing: output, dx and every parameter
    gradient. Both are bf16 with fp32 accumulation; they round at different points (the fused path
    adds gate * y in fp32 before one rounding per rank), so the bounds are those of the symm test.
    ``regions=2``: the symmetric dispatcher reserves per-layer receive regions and the layer reads
    its rows where they land (SymmDispatcher(row_regions=...))."""
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer
    from tlx_dist.comm import SymmDispatcher

    W = dist.get_world_size()
    cfg = MoEConfig(dim=1024, moe_inter_dim=512, num_experts=8 * W, top_k=4, dtype="bfloat16")
    torch.manual_seed(0)
    a = MoELayer(cfg, group, dispatcher="all_to_all", device="cuda")
    disp = SymmDispatcher(cfg.num_experts, group, validate=False, row_regions=regions) if regions else "symm"
    b = MoELayer(cfg, group, dispatcher=disp, pipeline="fused", device="cuda")
    assert b._rows_region == (0 if regions else None)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 128, 1024, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(dist.get_rank()))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oa, ob = a(xa), b(xb)
    assert b._fused(xb.reshape(-1, 1024))
    torch.testing.assert_close(ob.float(), oa.float(), rtol=2 ** -7, atol=2 ** -7 * float(oa.float().abs().max()))
    oa.float().square().sum().backward()
    ob.float().square().sum().backward()
    torch.testing.assert_close(xb.grad.float(), xa.grad.float(), rtol=2e-2, atol=2e-2 * float(xa.grad.abs().max()))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad.float(), pa.grad.float(), rtol=2e-2,
                                   atol=2e-2 * float(pa.grad.abs().max()), msg=name)
    b.dispatcher.check()


@pytest.mark.parametrize("copy_engine", [False, True], ids=["sm", "copy_engine"])
def test_moe_layer_overlapped_fused_ep(group, copy_engine):
    """``copy_engine=True``: the same with the copy-engine row form (rows and partial rows by
    cuMemcpyAsync on side streams, the dense layout). The arrival-driven overlap (``SymmDispatcher(overlap=True)``): the row send
    on a side stream while the gate/up GEMM computes the own rows on the other SMs -- three steps
    of forward + backward against the all-to-all layer (output, dx, every parameter gradient), the
    region counters back at zero after each step, then the whole step captured in a CUDA graph
    (the side stream forked and joined inside it) and replayed on new inputs with the same result."""
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer
    from tlx_dist.comm import SymmDispatcher

    W, r = dist.get_world_size(), dist.get_rank()
    cfg = MoEConfig(dim=1024, moe_inter_dim=512, num_experts=8 * W, top_k=4, dtype="bfloat16")
    torch.manual_seed(0)
    a = MoELayer(cfg, group, dispatcher="all_to_all", device="cuda")
    disp = SymmDispatcher(cfg.num_experts, group, validate=False, row_regions=1, capacity=2.0, overlap=True,
                          max_tokens=512, copy_engine=copy_engine)
    b = MoELayer(cfg, group, dispatcher=disp, pipeline="fused", device="cuda")
    b.load_state_dict(a.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(r)

    def step(layer, x):
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        out = layer(x)
        out.float().square().sum().backward()
        return out

    for it in range(3):
        x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        oa, ob = step(a, xa), step(b, xb)
        torch.testing.assert_close(ob.float(), oa.float(), rtol=2 ** -7, atol=2 ** -7 * float(oa.float().abs().max()),
                                   msg=f"step {it}: output")
        torch.testing.assert_close(xb.grad.float(), xa.grad.float(), rtol=2e-2,
                                   atol=2e-2 * float(xa.grad.abs().max()), msg=f"step {it}: dx")
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pb.grad.float(), pa.grad.float(), rtol=2e-2,
                                       atol=2e-2 * float(pa.grad.abs().max()), msg=f"step {it}: {name}")
        torch.cuda.synchronize()
        assert int(disp.buffers.region_counters().abs().sum()) == 0, "the rows' waits left counts behind"
        assert not disp.buffers.comb_block_counters().any(), "a combine counter was left non-zero"
    from tlx_dist.comm.symm.policy import ce_mode
    assert ce_mode(disp.buffers) == copy_engine
    disp.check()
    # the step in a CUDA graph: side stream forked and joined inside the capture. The eager steps'
    # outputs go first: their autograd graphs hold the parameters' AccumulateGrad nodes, made on the
    # default stream, which a capture's backward must not reuse.
    del oa, ob, xa, xb
    torch.cuda.synchronize()
    xs = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(b, xs)
    torch.cuda.current_stream().wait_stream(side)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step(b, xs)
    for it in range(2):
        new = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
        with torch.no_grad():
            xs.copy_(new)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        xa = new.clone().requires_grad_(True)
        oa = step(a, xa)
        torch.testing.assert_close(out_g.float(), oa.float(), rtol=2 ** -7,
                                   atol=2 ** -7 * float(oa.float().abs().max()), msg=f"replay {it}: output")
        torch.testing.assert_close(xs.grad.float(), xa.grad.float(), rtol=2e-2,
                                   atol=2e-2 * float(xa.grad.abs().max()), msg=f"replay {it}: dx")
    disp.check()
    dist.barrier()
    disp.buffers.close()  # (ep_buffers would hand this set, its mode fixed, to the next case)


@pytest.mark.parametrize("overlap", ["on", "off"])
@pytest.mark.parametrize("kind", ["random", "heavy_imbalance", "one_token"])
def test_row_form_matches_all_to_all(group, kind, overlap):
    """The fused EP pipeline's exchange (``dispatch_rows``) alone, three ops in a row with unequal
    token counts (one rank with a single token): every expanded row reads exactly the all-to-all's
    row; identity experts through ``combine_rows`` and autograd (``combine_rows``' backward moves dy
    rows the same way as dispatch moves x) give ``sum_k gate * x`` and its gradients. Both receive
    copies: the send kernel's receiving programs (``recv_overlap="on"``) and the expand kernel's,
    after arrival (``"off"``; what buffers below ``RECV_OVERLAP_MIN_TOKENS`` use)."""
    import torch.distributed as dist

    from tlx_dist.comm import AllToAllDispatcher, ExchangeConfig, SymmBuffers, SymmDispatcher
    from tlx_dist.comm.symm.policy import recv_mode

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T_max = 8 * W, 4, 2048, 1000
    bufs = SymmBuffers(T_max, D, K, E, torch.bfloat16, group, config=ExchangeConfig(recv_overlap=overlap))
    assert recv_mode(bufs) == ("overlap" if overlap == "on" else "after")
    sd, ad = SymmDispatcher(E, group, buffers=bufs), AllToAllDispatcher(E, group)
    g = torch.Generator(device="cuda").manual_seed(10 + r)
    for rep in range(3):
        T = (1 if r == 0 else T_max) if kind == "one_token" else T_max - 37 * r - rep
        if kind == "heavy_imbalance":  # everything to rank 0
            idx = torch.rand(T, E // W, device="cuda", generator=g).topk(K, dim=1).indices
        else:
            idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        gate = torch.rand(T, K, device="cuda", generator=g)
        xs, gs = x.clone().requires_grad_(True), gate.clone().requires_grad_(True)
        recv, src, gate_N, h = sd.dispatch_rows(xs, idx, gs)
        ra, _ = ad.dispatch(x, idx, gate)
        n = int(h.offsets_e[-1])
        assert n == ra.shape[0]
        assert torch.equal(recv[src[:n].long()], ra), f"rep {rep}: expanded rows differ from the all-to-all's"
        part = torch.zeros(recv.shape, device="cuda", dtype=torch.float32).index_add(
            0, src[:n].long(), gate_N[:n, None] * recv[src[:n].long()].float()).to(torch.bfloat16)
        out = sd.combine_rows(part, h)
        ref = (gate.sum(1, keepdim=True) * x.float())
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -6, atol=2 ** -6 * float(ref.abs().max()))
        gy = torch.randn(out.shape, device="cuda", generator=g).to(torch.bfloat16)
        (out.float() * gy.float()).sum().backward()
        torch.testing.assert_close(xs.grad.float(), gate.sum(1, keepdim=True) * gy.float(), rtol=2 ** -6,
                                   atol=2 ** -6 * float(gy.float().abs().max()) * K)
        dg = (x.float() * gy.float()).sum(1, keepdim=True).expand(T, K)
        torch.testing.assert_close(gs.grad, dg, rtol=2 ** -6, atol=2 ** -6 * float(dg.abs().max()))
    sd.check()
    torch.cuda.synchronize()
    assert not bufs.recv_block_counters().any(), "an arrival counter was left non-zero"
    bufs.close()


def test_rank_that_skips_an_op_is_an_error_not_a_hang(group):
    """Real ranks (peer pointers): rank 1 skips a dispatch. Rank 0's waits give up after timeout_s (1 s)
    instead of hanging, its dispatch returns, and check() names the op, the waiting rank and the
    missing peer. (Buffers of their own: the timeout is part of ep_buffers' key.)"""
    import time

    import torch.distributed as dist

    from tlx_dist.comm import SymmDispatcher
    from tlx_dist.comm.symm.buffers import ExchangeError

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T = 4 * W, 2, 256, 32
    sd = SymmDispatcher(E, group, max_tokens=T, capacity=2.0, timeout_s=1.0, validate=False)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    gate = torch.rand(T, K, device="cuda")
    bufs = sd._buffers_for(x, K)  # collective: every rank builds the buffers
    dist.barrier()
    if r == 0:
        t0 = time.monotonic()
        sd.dispatch(x, idx, gate)
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        with pytest.raises(ExchangeError, match=r"rank 0 waited 1 s for the .* from rank 1"):
            sd.check()
        assert waited < 30, f"the dispatch returned after {waited:.1f} s"
    dist.barrier()
    bufs.close()


@pytest.mark.parametrize("rows", [False, True])
def test_one_launch_combine_matches_the_arrive_path(group, rows):
    """Real ranks over peer pointers combine the row form in one launch (``policy.comb_mode``
    "overlap": the reduce-send's first programs sum each token block as its partial rows land). Its
    output is bit for bit the two-launch path's ("after": one ARRIVE count per rank, then the
    reduce-receive), T not a multiple of the counters' token block and unequal per rank; every
    per-block counter is back at zero after the op, and the profiler sees one kernel per combine
    (the expanded form: two, and the same output)."""
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from tlx_dist.comm import SymmDispatcher
    from tlx_dist.comm.symm import policy

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T_max = 8 * W, 8, 1024, 1000
    T = T_max - 37 * r
    g = torch.Generator(device="cuda").manual_seed(70 + r)
    idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.rand(T, K, device="cuda", generator=g)
    sd = SymmDispatcher(E, group, max_tokens=T_max, capacity=2.0, validate=False)
    with torch.no_grad():
        if rows:
            recv, src, gate_n, h = sd.dispatch_rows(x, idx, gate)
            part = torch.randn(recv.shape, device="cuda", generator=g).to(torch.bfloat16)
            comb = lambda: sd.combine_rows(part, h)  # noqa: E731
        else:
            recv, h = sd.dispatch(x, idx, gate)
            y = torch.randn(recv.shape, device="cuda", generator=g).to(torch.bfloat16)
            comb = lambda: sd.combine_weighted(y, h, gate)  # noqa: E731
        bufs = sd.buffers
        assert policy.comb_mode(bufs) == "overlap"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            one = comb()
            torch.cuda.synchronize()
        kernels = [e.name for e in p.events() if e.device_type == DeviceType.CUDA
                   and getattr(e, "activity_type", "kernel") == "kernel"]
        # the expanded form keeps two launches (its reduce-send's registers leave no room for waiting programs)
        assert kernels == (["_reduce_send_kernel"] if rows else ["_reduce_send_kernel", "_reduce_recv_kernel"]), kernels
        assert not bufs.comb_block_counters().any(), "a combine counter was left non-zero"
        dist.barrier()
        cfg = bufs.config
        bufs.reconfigure(dataclasses.replace(cfg, comb_overlap="off"))  # every rank, between ops
        two = comb()
        torch.cuda.synchronize()
        bufs.reconfigure(cfg)
    assert one.shape == (T, D) and torch.equal(one, two), "the one-launch combine differs from the ARRIVE path"
    assert float(one.float().abs().sum()) > 0
    sd.check()
    dist.barrier()


def test_rank_that_skips_a_combine_is_an_error_not_a_hang(group):
    """Real ranks, the one-launch combine: rank 1 skips a combine. Rank 0's summing programs give up
    after timeout_s (1 s) instead of hanging, and check() names the combine, the rank and the peer."""
    import time

    import torch.distributed as dist

    from tlx_dist.comm import SymmDispatcher
    from tlx_dist.comm.symm.buffers import ExchangeError

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T = 4 * W, 2, 256, 64
    sd = SymmDispatcher(E, group, max_tokens=T, capacity=2.0, timeout_s=1.0, validate=False)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(K, device="cuda").repeat(T, 1) * (E // K)  # every token goes to every rank
    gate = torch.rand(T, K, device="cuda")
    with torch.no_grad():
        recv, h = sd.dispatch(x, idx, gate)
        torch.cuda.synchronize()
        dist.barrier()
        if r == 0:
            t0 = time.monotonic()
            sd.combine_weighted(recv, h, gate)
            torch.cuda.synchronize()
            waited = time.monotonic() - t0
            with pytest.raises(ExchangeError, match=r"rank 0 waited 1 s for the combine partial rows from rank 1"):
                sd.check()
            assert waited < 30, f"the combine returned after {waited:.1f} s"
    dist.barrier()
    sd.buffers.close()


def test_copy_engine_row_form_matches_the_sm_row_form(group):
    """The copy-engine row form (``copy_engine=True``: dense layout, rows and partial rows by
    cuMemcpyAsync into the peers' regions) against the SM row form on real ranks, three ops in a row
    with unequal T per rank (an owner with fewer tokens than a source: the fix-up kernel stores the
    rest of its partial rows): the expanded rows, gates and offsets, the combine's output and the
    gradients of x and the gates bit for bit; every counter back at zero after each op; then
    dispatch + combine captured in CUDA graphs (the copies become memcpy nodes) and replayed."""
    import torch.distributed as dist

    from tlx_dist.comm import SymmBuffers, SymmDispatcher
    from tlx_dist.comm.symm.policy import ce_mode

    W, r = dist.get_world_size(), dist.get_rank()
    E, K, D, T_max = 8 * W, 8, 2048, 1000
    res = {}
    for ce in (False, True):
        bufs = SymmBuffers(T_max, D, K, E, torch.bfloat16, group, row_regions=1)
        sd = SymmDispatcher(E, group, buffers=bufs, capacity=2.0, validate=False, copy_engine=ce)
        g = torch.Generator(device="cuda").manual_seed(10 + r)
        got = []
        for rep in range(3):
            T = T_max - 37 * r - rep
            idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
            gate = torch.rand(T, K, device="cuda", generator=g)
            xs, gs = x.clone().requires_grad_(True), gate.clone().requires_grad_(True)
            recv, src, gate_N, h = sd.dispatch_rows(xs, idx, gs, region=0)
            assert h.dense == ce and ce_mode(bufs) == ce
            n = int(h.offsets_e[-1])
            rows = recv[src[:n].long()]
            part = torch.zeros(recv.shape, device="cuda", dtype=torch.float32).index_add(
                0, src[:n].long(), gate_N[:n, None] * rows.float()).to(torch.bfloat16)
            out = sd.combine_rows(part, h)
            gy = torch.randn(out.shape, device="cuda", generator=g).to(torch.bfloat16)
            (out.float() * gy.float()).sum().backward()
            torch.cuda.synchronize()
            got.append((rows.detach().clone(), gate_N.detach()[:n].clone(), h.offsets_e.clone(), out.detach().clone(),
                        xs.grad.clone(), gs.grad.clone()))
            for name, c in (("region", bufs.region_counters()), ("CBLK", bufs.comb_block_counters()),
                            ("RBLK", bufs.recv_block_counters())):
                assert not c.any(), f"rep {rep}: a {name} counter was left non-zero"
            # no rank starts the next op before every rank has read its counters: a peer's next dispatch
            # adds to them as soon as this rank's GPU ended its last op (a rank ahead by its compile skew
            # in a cold process once added its rows before the other read them)
            dist.barrier()
        sd.check()
        # graph capture and replay of the no-grad pair
        T = T_max - 37 * r
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        gate = torch.rand(T, K, device="cuda", generator=g)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                recv, src, gate_N, h = sd.dispatch_rows(x, idx, gate, region=0)
                eager = sd.combine_rows(recv, h)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                recv, src, gate_N, h = sd.dispatch_rows(x, idx, gate, region=0)
                out_g = sd.combine_rows(recv, h)
            for _ in range(2):
                torch.cuda.synchronize()
                dist.barrier()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out_g, eager), "the replayed pair differs from the eager one"
        got.append((eager,))
        sd.check()
        res[ce] = got
        dist.barrier()
        bufs.close()
    names = ("expanded rows", "gates", "offsets", "combine", "dx", "dgate")
    for i, (a, b) in enumerate(zip(res[False], res[True])):
        for name, u, v in zip(names, a, b):
            assert torch.equal(u, v), f"op {i}: {name} of the copy-engine row form differs from the SM one"
