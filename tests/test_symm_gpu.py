"""Symmetric dispatch/combine on the GPU (tiers T3/T4): the compiled tlx/comm kernels in an emulated
world of W = 1, 2, 4, 8 virtual ranks on one GPU, torch symmetric memory at world size 1, CUDA-graph
capture and replay, and MoELayer with the symm dispatcher. Run: ``pytest -m gpu tests/test_symm_gpu.py``.

Dispatch moves bits (exact comparisons). Combine sums a token's slots where they live, then over
ranks, so its results and gradients are held to the STYLE.md 6 rule against fp64 formulas, with
the plain-torch bf16 computation as the scale.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 is set (a CPU interpreter test module sets it at collection): "
                              "run this file on its own"),
]

from tlx_dist.comm import LocalDispatcher, SymmBuffers, SymmDispatcher  # noqa: E402
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch  # noqa: E402
from tlx_dist.comm.symm.buffers import ExchangeError  # noqa: E402
from tlx_dist.testing import assert_close_ksum_bf16, assert_close_to_ref  # noqa: E402

DEV = "cuda"



def _idx(g, T, K, E, W, kind):
    if kind == "random":
        return torch.rand(T, E, generator=g, device=DEV).topk(K, dim=1).indices
    if kind == "zero_token_experts":  # only even experts used
        return torch.rand(T, E // 2, generator=g, device=DEV).topk(K, dim=1).indices * 2
    if kind == "heavy_imbalance":  # every slot to rank 0's experts
        return torch.rand(T, E // W, generator=g, device=DEV).topk(K, dim=1).indices
    if kind == "one_expert":  # first choice always the last expert
        rest = torch.rand(T, E - 1, generator=g, device=DEV).topk(K - 1, dim=1).indices
        return torch.cat([torch.full((T, 1), E - 1, device=DEV, dtype=torch.long), rest], 1)
    raise ValueError(kind)


def _check_world(W, E, K, D, Ts, kind, dtype=torch.bfloat16, capacity="worst"):
    g = torch.Generator(device=DEV).manual_seed(W * 100 + D)
    world = EmulatedWorld(W, max(Ts), D, K, E, dtype, capacity=capacity, device=DEV)
    xs = [torch.randn(T, D, device=DEV, generator=g).to(dtype) for T in Ts]
    idxs = [_idx(g, T, K, E, W, kind) for T in Ts]
    gates = [torch.rand(T, K, device=DEV, generator=g) for T in Ts]  # fp32, as the router gives them
    res = world.dispatch(xs, idxs, gates)
    ref = reference_dispatch(xs, idxs, E)
    e = E // W
    for d, (x_exp, h) in enumerate(res):
        rows, cnt = ref[d]
        n = rows.shape[0]
        assert h.offsets_e.tolist() == cnt.cumsum(0).tolist(), f"W={W} {kind}: rank {d} offsets"
        assert torch.equal(x_exp[:n], rows), f"W={W} {kind}: rank {d} rows"
        assert h.rows_from_W.tolist() == [int((i // e == d).any(1).sum()) for i in idxs]  # one row per token
    ys = [x_exp * (1.0 + d) for d, (x_exp, _) in enumerate(res)]
    outs = world.combine(ys, [h for _, h in res])
    gs = [torch.randn(T, D, device=DEV, generator=g).to(dtype) for T in Ts]
    back = world.dispatch_grad(gs, ys, [h for _, h in res])
    dxs = world.combine_grad([g_y * (1.0 + d) for d, (g_y, _) in enumerate(back)], [h for _, h in res])
    for s, (x, idx, gate, gy) in enumerate(zip(xs, idxs, gates, gs)):
        scale = (1.0 + idx // e)[..., None].to(dtype)
        y_slot = x[:, None, :] * scale                             # each slot's expert row, in dtype
        gd = gate.to(dtype)[..., None]
        ref64 = (gd.double() * y_slot.double()).sum(1)
        torch_dt = (y_slot * gd).sum(1, dtype=torch.float32).to(dtype)  # LocalDispatcher's combine
        assert_close_to_ref(outs[s], ref64, torch_dt, name=f"W={W} {kind}: combine on rank {s}")
        g_gate64 = (gy[:, None, :].double() * y_slot.double()).sum(-1)
        torch_gg = (gy[:, None, :] * y_slot).sum(-1).float()           # autograd of the local path
        assert_close_to_ref(back[s][1], g_gate64, torch_gg, dtype=torch.float32, name=f"W={W} {kind}: gate grad {s}")
        dx64 = (gd.double() * gy[:, None, :].double() * scale.double()).sum(1)
        dx_dt = ((gd * gy[:, None, :]) * scale).sum(1, dtype=torch.float32).to(dtype)
        assert_close_to_ref(dxs[s], dx64, dx_dt, name=f"W={W} {kind}: dispatch backward on rank {s}")
    slot_rows = reference_dispatch([(gt.to(dtype)[..., None] * gy[:, None, :]).reshape(-1, D) for gt, gy in zip(gates, gs)],
                                   [i.reshape(-1, 1) for i in idxs], E)
    for d, (g_y, _) in enumerate(back):
        n = slot_rows[d][0].shape[0]
        assert torch.equal(g_y[:n], slot_rows[d][0]), f"W={W} {kind}: combine backward rows on rank {d}"
    world.check()
    return world


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "zero_token_experts", "heavy_imbalance", "one_expert"])
def test_emulated_world(W, kind):
    """E = 256, K = 8, D = 7168 bf16 (DeepSeek-V3 rows); T differs per rank (1 .. 300 tokens):
    T = 1 is below every tile, the others are not multiples of the row block."""
    Ts = [300 - 37 * s if s else 1 for s in range(W)] if W > 1 else [300]
    _check_world(W, 256, 8, 7168, Ts, kind)


@pytest.mark.parametrize("W", [2, 4])
def test_copy_engine_row_form_on_one_gpu(W):
    """The copy-engine row form (``EmulatedWorld(copy_engine=True)``: cuMemcpyAsync between the virtual
    ranks' regions on one GPU, the dense layout) against the SM row form: the expanded rows, gates
    and offsets, the combine (copies in chunks with signals) and both backward ops bit for bit, two
    ops into two regions, T = 1 and counts off every block (an owner with fewer tokens than a source:
    the fix-up kernel), every counter zero after."""
    E, K, D = 64, 8, 2048
    Ts = [1300 - 311 * s if s else 1 for s in range(W)][::-1]
    T_MAX = max(Ts)
    g = torch.Generator(device=DEV).manual_seed(17 + W)
    ops = []
    for _ in range(2):
        xs = [torch.randn(T, D, device=DEV, generator=g).to(torch.bfloat16) for T in Ts]
        ops.append((xs, [_idx(g, T, K, E, W, "random") for T in Ts], [torch.rand(T, K, device=DEV, generator=g) for T in Ts]))
    got = {}
    for ce in (False, True):
        world = EmulatedWorld(W, T_MAX, D, K, E, torch.bfloat16, device=DEV, row_regions=2, copy_engine=ce)
        res = []
        for k, (xs, idxs, gates) in enumerate(ops):
            rows = world.dispatch_rows(xs, idxs, gates, region=k)
            hs = [r[3] for r in rows]
            assert all(h.dense == ce for h in hs)
            exp = [r[0][r[1][:int(r[3].offsets_e[-1])].long()].clone() for r in rows]
            outs = world.combine_rows([r[0] * 0.5 for r in rows], hs)
            gp = world.combine_rows_grad([o.clone() for o in outs], hs)
            gexp = [p[r[1][:int(r[3].offsets_e[-1])].long()].clone() for p, r in zip(gp, rows)]
            back = world.dispatch_rows_grad([r[0].clone() for r in rows], [None] * W, hs)
            torch.cuda.synchronize()
            res.append((exp, [r[2][:int(r[3].offsets_e[-1])].clone() for r in rows], [h.offsets_e.clone() for h in hs],
                        [o.clone() for o in outs], gexp, [b[0].clone() for b in back]))
            for d, b in enumerate(world.buffers):
                for name, c in (("region", b.region_counters()), ("CBLK", b.comb_block_counters()),
                                ("RBLK", b.recv_block_counters())):
                    assert not c.any(), f"op {k} rank {d}: a {name} counter was left non-zero"
        world.check()
        world.close()
        got[ce] = res
    names = ("expanded rows", "gates", "offsets", "combine", "combine grad rows", "dispatch grad")
    for k, (a, b) in enumerate(zip(got[False], got[True])):
        for name, u, v in zip(names, a, b):
            for d, (x, y) in enumerate(zip(u, v)):
                assert torch.equal(x, y), f"W={W} op {k} rank {d}: {name} of the copy-engine form differs"


def test_emulated_odd_shapes():
    """fp16 D = 3 (6-byte rows), fp32 D = 2049, K = 1, E = W; K = E (a token sends K slots to a rank, once)."""
    _check_world(2, 2, 1, 3, [5, 9], "random", torch.float16)
    _check_world(4, 8, 1, 2049, [33, 1, 64, 17], "random", torch.float32)
    _check_world(2, 6, 6, 1024, [40, 7], "random")


def test_capacity_overflow_on_gpu():
    """capacity=100 expanded rows while rank 0 gets 1024: rows past it are not computed, every
    op still finishes, and check() raises on rank 0 (then the flag clears)."""
    W, E, K, D, T = 4, 16, 4, 512, 64
    world = EmulatedWorld(W, T, D, K, E, torch.bfloat16, capacity=100, device=DEV)
    xs = [torch.randn(T, D, device=DEV, dtype=torch.bfloat16) for _ in range(W)]
    g = torch.Generator(device=DEV).manual_seed(0)
    idxs = [_idx(g, T, K, E, W, "heavy_imbalance") for _ in range(W)]  # W*T*K = 1024 rows to rank 0
    res = world.dispatch(xs, idxs)
    ref = reference_dispatch(xs, idxs, E)
    assert res[0][0].shape[0] == 100 and torch.equal(res[0][0], ref[0][0][:100])
    assert int(res[0][1].offsets_e[-1]) == 100
    world.combine([r for r, _ in res], [h for _, h in res])
    with pytest.raises(RuntimeError, match="rank 0 received more expert rows than"):
        world.buffers[0].check()
    world.check()


def test_bounded_wait_on_gpu():
    """A virtual rank skips a dispatch: the others' waits give up after 0.2 s (no hang) and check()
    names the op, the waiting rank and the missing peer."""
    from tlx_dist.comm.emulated import run_lockstep
    from tlx_dist.comm.symm import dispatch_steps
    W, E, K, D, T = 2, 8, 2, 256, 32
    world = EmulatedWorld(W, T, D, K, E, torch.bfloat16, device=DEV, timeout_s=0.2)
    x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
    idx = torch.rand(T, E, device=DEV).topk(K, dim=1).indices
    run_lockstep([dispatch_steps(world.buffers[0], x, idx)])  # rank 1 never joins
    torch.cuda.synchronize()
    with pytest.raises(ExchangeError, match=r"rank 0 waited 0.2 s for the barrier \(op start\) from rank 1"):
        world.buffers[0].check()


def test_cuda_graph_capture_and_replay():
    """Dispatch + combine of an emulated W = 4 world captured once, replayed with new tokens, gates
    and routing: device-side epochs and counters make every replay a fresh, correct exchange."""
    W, E, K, D, T = 4, 32, 4, 1024, 96
    world = EmulatedWorld(W, T, D, K, E, torch.bfloat16, capacity=2.0, device=DEV)
    xs = [torch.zeros(T, D, device=DEV, dtype=torch.bfloat16) for _ in range(W)]
    idxs = [torch.zeros(T, K, device=DEV, dtype=torch.long) for _ in range(W)]
    gates = [torch.zeros(T, K, device=DEV) for _ in range(W)]
    g = torch.Generator(device=DEV).manual_seed(1)

    def fill():
        for x, i, gt in zip(xs, idxs, gates):
            x.copy_(torch.randn(T, D, device=DEV, generator=g))
            i.copy_(_idx(g, T, K, E, W, "random"))
            gt.copy_(torch.rand(T, K, device=DEV, generator=g))

    def step():
        res = world.dispatch(xs, idxs, gates)
        return res, world.combine([r * 2 for r, _ in res], [h for _, h in res])

    fill()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, outs = step()
    for _ in range(3):
        fill()
        graph.replay()
        ref = reference_dispatch(xs, idxs, E)
        for d in range(W):
            n = ref[d][0].shape[0]
            assert torch.equal(res[d][0][:n], ref[d][0])
        for s_ in range(W):
            y_slot = xs[s_][:, None, :] * 2
            gd = gates[s_].to(torch.bfloat16)[..., None]
            ref64 = (gd.double() * y_slot.double()).sum(1)
            assert_close_to_ref(outs[s_], ref64, (y_slot * gd).sum(1, dtype=torch.float32).bfloat16(), name="replay")
    world.check()


@contextlib.contextmanager
def _one_rank_nccl():
    """A one-rank NCCL process group (torch symmetric memory's CUDA backend rendezvous over it),
    destroyed afterwards; skips when this process already has one."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device(DEV, 0))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_world_size_one_torch_symmetric_memory():
    """The real backend: torch symmetric memory (CUDA) rendezvous over a one-rank NCCL group; the
    dispatcher vs LocalDispatcher, forward and backward, plus MoELayer symm vs local."""
    import torch.distributed as dist

    from tlx_dist import MoEConfig, MoELayer

    with _one_rank_nccl():
        E, K, D, T = 64, 8, 2048, 512
        bufs = SymmBuffers(T, D, K, E, torch.bfloat16, dist.group.WORLD)
        assert bufs.backend == "cuda" and bufs.layout.recv_rows == T
        sd = SymmDispatcher(E, dist.group.WORLD, buffers=bufs, validate=False)
        x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        gate = torch.rand(T, K, device=DEV, requires_grad=True)
        gate2 = gate.detach().clone().requires_grad_(True)
        idx = torch.rand(T, E, device=DEV).topk(K, dim=1).indices
        recv, h = sd.dispatch(x, idx, gate)
        lrecv, lh = LocalDispatcher(E).dispatch(x2, idx)
        assert recv.shape[0] == T * K  # capacity="exact"
        assert torch.equal(recv, lrecv) and torch.equal(h.offsets_e, lh.offsets_e)
        # One rank: the same products in bf16 and the same fp32 k-sum as the local path.
        y, ly = sd.combine_weighted(recv * 3, h, gate), LocalDispatcher(E).combine_weighted(lrecv * 3, lh, gate2)
        assert_close_ksum_bf16(ly, y)
        gy = torch.randn_like(y)
        (y.float() * gy.float()).sum().backward()
        (ly.float() * gy.float()).sum().backward()
        assert_close_ksum_bf16(x2.grad, x.grad)
        # The local path rounds each gate gradient to bf16 (autograd of a bf16 product); ours
        # keeps fp32: they differ by up to one bf16 ulp (2**-8), bounded here with a factor 2.
        torch.testing.assert_close(gate.grad, gate2.grad, rtol=2 ** -7, atol=2 ** -7 * float(gate2.grad.abs().max()))

        cfg = MoEConfig(dim=512, moe_inter_dim=256, num_experts=16, top_k=4, dtype="bfloat16")
        torch.manual_seed(0)
        a = MoELayer(cfg, dist.group.WORLD, dispatcher="all_to_all", device=DEV)
        b = MoELayer(cfg, dist.group.WORLD, dispatcher="symm", device=DEV)
        b.load_state_dict(a.state_dict())
        xm = torch.randn(4, 64, 512, device=DEV, dtype=torch.bfloat16)
        xa, xb = xm.clone().requires_grad_(True), xm.clone().requires_grad_(True)
        oa, ob = a(xa), b(xb)
        assert_close_ksum_bf16(oa, ob)
        oa.float().square().sum().backward()
        ob.float().square().sum().backward()
        assert_close_ksum_bf16(xa.grad, xb.grad)
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=2e-2, atol=2e-2 * float(pa.grad.abs().max()), msg=n)

        # A whole MoELayer forward+backward on the symm dispatcher with a static capacity makes
        # no host sync (sync debug mode "error" raises on one).
        c = MoELayer(cfg, dist.group.WORLD, device=DEV, dispatcher="symm", capacity=2.0)
        c.load_state_dict(a.state_dict())
        xc = xm.clone().requires_grad_(True)
        c(xc).float().square().sum().backward()  # compile, build the buffers
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            c(xc).float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        c.dispatcher.check()
        bufs.close()
        b.dispatcher.buffers.close()


def test_launches_per_op_on_gpu():
    """The exchange's launch budget on the device, at world size 1 on torch symmetric memory: in
    steady state a dispatch (either form) launches exactly route, send and expand, and a combine
    (either form) reduce-send and reduce-receive -- no torch kernel besides (the expanded-row
    offsets are capped and the row form's gather index written by the kernels themselves, not by a
    clamp and a division as torch ops after every dispatch)."""
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _one_rank_nccl():
        E, K, D, T = 64, 8, 1024, 256
        sd = SymmDispatcher(E, dist.group.WORLD, max_tokens=T, capacity=2.0, validate=False)
        x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
        idx = torch.rand(T, E, device=DEV).topk(K, dim=1).indices
        gate = torch.rand(T, K, device=DEV)

        launched = {}

        def prof(name, fn):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                out = fn()
                torch.cuda.synchronize()
            launched[name] = [e.name for e in p.events() if e.device_type == DeviceType.CUDA
                              and getattr(e, "activity_type", "kernel") in ("kernel", "gpu_memcpy", "gpu_memset")]
            return out

        with torch.no_grad():
            for _ in range(2):  # compile, build the buffers; the second round is steady state
                launched.clear()
                r, h = prof("dispatch", lambda: sd.dispatch(x, idx, gate))
                prof("combine", lambda: sd.combine_weighted(r, h, gate))
                recv, src, gate_n, hr = prof("dispatch_rows", lambda: sd.dispatch_rows(x, idx, gate))
                prof("combine_rows", lambda: sd.combine_rows(recv, hr))
        want_d = ["_route_kernel", "_send_tokens_kernel", "_expand_kernel"]
        want_c = ["_reduce_send_kernel", "_reduce_recv_kernel"]
        assert launched == {"dispatch": want_d, "combine": want_c, "dispatch_rows": want_d,
                            "combine_rows": want_c}, launched
        sd.check()
        sd.buffers.close()


def test_layer_fwd_bwd_cuda_graph_with_symm_dispatcher():
    """A whole MoELayer forward+backward (symm dispatcher, static capacity, world size 1 on torch
    symmetric memory) captured in one CUDA graph; replays equal eager. In a child process: a failed
    capture leaves CUDA/RNG state that would fail every later test of this session."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "_symm_graph_capture.py")], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here,
                                                                                   os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "replays equal eager" in r.stdout, r.stdout[-3000:]
