"""The fused EP pipeline on one GPU (tier T4): W virtual ranks of the symmetric exchange's row form
(``dispatch_rows`` -> ``fused_experts_rows`` on the receive rows -> ``combine_rows``) with the real
kernels (TLX fused GEMMs on sm_90, the portable Triton ones elsewhere), forward and every gradient,
against the fp64 MoE of the whole world; and the layer on one rank (``MoELayer(pipeline="fused",
dispatcher="symm")``) against the separate path.

Tolerances (STYLE.md 6): max|ours - ref64| <= 2 * max|one-rank fused bf16 - ref64| + atol. The gates
travel in bf16 under EP, so every reference gets the bf16-rounded gates.

    pytest -m gpu tests/test_fused_ep_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tlx_dist.comm.emulated import EmulatedWorld
from tlx_dist.fused import fused_experts, fused_experts_ref, fused_experts_rows
from tlx_dist.testing import assert_close_to_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV, BF16 = "cuda", torch.bfloat16


def _routing(g, T, K, E, kind):
    if kind == "heavy_imbalance":  # every slot to the first K+1 experts: rank 0 gets all, others none
        return torch.stack([torch.randperm(K + 1, device=DEV, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.long, device=DEV)
    return torch.rand(T, E, device=DEV, generator=g).topk(K, dim=1).indices


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("W,kind", [(2, "random"), (4, "random"), (4, "heavy_imbalance")])
def test_rows_world_fwd_bwd_vs_fp64(W, kind):
    E, K, D, Fe = 32, 4, 1024, 512
    e = E // W
    Ts = [256 - 61 * s for s in range(W)]  # 256, 195, 134, 73: no tile multiple but the first
    g = torch.Generator(DEV).manual_seed(W)
    xs = [torch.randn(T, D, device=DEV, generator=g).to(BF16) for T in Ts]
    idxs = [_routing(g, T, K, E, kind) for T in Ts]
    gates = [torch.softmax(torch.randn(T, K, device=DEV, generator=g), -1).to(BF16).float() for T in Ts]
    w13 = (torch.randn(E, D, 2 * Fe, device=DEV, generator=g) / D ** 0.5).to(BF16)
    w2 = (torch.randn(E, Fe, D, device=DEV, generator=g) / Fe ** 0.5).to(BF16)

    world = EmulatedWorld(W, max(Ts), D, K, E, BF16, device=DEV)
    rows = world.dispatch_rows(xs, idxs, gates)
    leaves, parts = [], []
    for d, (recv, src, gate_N, h) in enumerate(rows):
        lv = [recv.requires_grad_(True), gate_N.requires_grad_(True),
              w13[d * e:(d + 1) * e].clone().requires_grad_(True), w2[d * e:(d + 1) * e].clone().requires_grad_(True)]
        leaves.append(lv)
        parts.append(fused_experts_rows(lv[0], src, src, lv[1], lv[2], lv[3], h.offsets_e, recv.shape[0]))
    outs = world.combine_rows([p.detach() for p in parts], [h for *_, h in rows])
    gys = [torch.randn(T, D, device=DEV, generator=g).to(BF16) for T in Ts]
    g_parts = world.combine_rows_grad(gys, [h for *_, h in rows])
    for p, gp in zip(parts, g_parts):
        p.backward(gp)
    back = world.dispatch_rows_grad([lv[0].grad for lv in leaves], [lv[1].grad for lv in leaves],
                                    [h for *_, h in rows])

    # references over the whole world: fp64, and the one-rank fused pipeline in bf16
    r64 = [w13.double().requires_grad_(True), w2.double().requires_grad_(True)]
    rbf = [w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)]
    for s in range(W):
        x64, gt64 = xs[s].double().requires_grad_(True), gates[s].double().requires_grad_(True)
        xbf, gtbf = xs[s].clone().requires_grad_(True), gates[s].clone().requires_grad_(True)
        o64 = fused_experts_ref(x64, idxs[s], gt64, *r64)
        obf = fused_experts(xbf, idxs[s], gtbf, *rbf)
        assert_close_to_ref(outs[s], o64, obf, name=f"W={W} {kind}: output on rank {s}")
        (o64 * gys[s].double()).sum().backward()
        (obf.float() * gys[s].float()).sum().backward()
        assert_close_to_ref(back[s][0], x64.grad, xbf.grad, name=f"W={W} {kind}: dx on rank {s}")
        assert_close_to_ref(back[s][1].float(), gt64.grad, gtbf.grad, dtype=torch.float32,
                            name=f"W={W} {kind}: dgate on rank {s}")
    for d, lv in enumerate(leaves):
        sl = slice(d * e, (d + 1) * e)
        assert_close_to_ref(lv[2].grad, r64[0].grad[sl], rbf[0].grad[sl], name=f"W={W} {kind}: dw13 on rank {d}")
        assert_close_to_ref(lv[3].grad, r64[1].grad[sl], rbf[1].grad[sl], name=f"W={W} {kind}: dw2 on rank {d}")
    world.check()
    world.close()


@pytest.mark.timeout(300, method="thread")
def test_layer_fused_ep_one_rank_vs_separate():
    """MoELayer(pipeline="fused", dispatcher="symm") on one rank (torch symmetric memory needs a
    group here, so this is the "local" buffers path) vs the separate local layer, bf16 fwd+bwd."""
    from tlx_dist import MoEConfig, MoELayer

    cfg = MoEConfig(dim=1024, moe_inter_dim=512, num_experts=16, top_k=4, dtype="bfloat16")
    torch.manual_seed(0)
    a = MoELayer(cfg, dispatcher="local", pipeline="separate", device=DEV)
    b = MoELayer(cfg, dispatcher="symm", pipeline="fused", device=DEV)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 100, 1024, device=DEV, dtype=BF16)
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


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("W,kind", [(2, "random"), (4, "random"), (4, "heavy_imbalance")])
def test_overlapped_rows_world_equals_plain(W, kind):
    """``overlap=True`` in the emulated world with the real kernels: the split send,
    the region counters and, on sm_90, the gate/up GEMM in two launches over (before | own | after)
    runs -- forward output and every gradient bit for bit the plain region form's (same tiles'
    arithmetic, same fp32 atomics order is not guaranteed, so the k-sums are compared at one ulp)."""
    E, K, D, Fe = 32, 4, 1024, 512
    e = E // W
    Ts = [256 - 61 * s for s in range(W)]
    g = torch.Generator(DEV).manual_seed(10 + W)
    xs = [torch.randn(T, D, device=DEV, generator=g).to(BF16) for T in Ts]
    idxs = [_routing(g, T, K, E, kind) for T in Ts]
    gates = [torch.softmax(torch.randn(T, K, device=DEV, generator=g), -1).to(BF16).float() for T in Ts]
    w13 = (torch.randn(E, D, 2 * Fe, device=DEV, generator=g) / D ** 0.5).to(BF16)
    w2 = (torch.randn(E, Fe, D, device=DEV, generator=g) / Fe ** 0.5).to(BF16)
    gys = [torch.randn(T, D, device=DEV, generator=g).to(BF16) for T in Ts]
    res = {}
    for overlap in (False, True):
        world = EmulatedWorld(W, max(Ts), D, K, E, BF16, device=DEV, row_regions=1,
                              capacity="worst" if kind == "heavy_imbalance" else 1.5)
        rows = world.dispatch_rows(xs, idxs, gates, region=0, overlap=overlap)
        leaves, parts, hs = [], [], []
        for d, (recv, src, gate_N, h) in enumerate(rows):
            assert (h.overlap is not None) == overlap
            lv = [recv.detach().clone().requires_grad_(True), gate_N.detach().clone().requires_grad_(True),
                  w13[d * e:(d + 1) * e].clone().requires_grad_(True),
                  w2[d * e:(d + 1) * e].clone().requires_grad_(True)]
            leaves.append(lv)
            parts.append(fused_experts_rows(lv[0], src, src, lv[1], lv[2], lv[3], h.offsets_e, recv.shape[0],
                                            overlap=h.overlap))
            hs.append(h)
        outs = world.combine_rows([p.detach() for p in parts], hs)
        g_parts = world.combine_rows_grad(gys, hs)
        for p, gp in zip(parts, g_parts):
            p.backward(gp)
        world.check()
        res[overlap] = (outs, [[t.grad for t in lv] for lv in leaves], hs)
        world.close()
    for d in range(W):
        n = int(res[False][2][d].offsets_e[-1])
        torch.testing.assert_close(res[True][0][d].float(), res[False][0][d].float(), rtol=8e-3, atol=1e-3,
                                   msg=f"rank {d}: output")
        for name, a, b in zip(("recv", "gate", "w13", "w2"), res[True][1][d], res[False][1][d]):
            if name == "gate":
                a, b = a[:n], b[:n]
            torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-3, msg=f"rank {d}: d{name}")


@pytest.mark.timeout(300, method="thread")
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the phased gate/up GEMM is the Hopper TLX kernel's")
def test_phased_launches_equal_one_launch():
    """The overlapped forward's launches (``backends._forward_overlapped``: two of the gate/up
    GEMM over 3e virtual experts, the first on fewer SMs; two of the down GEMM, peers' runs first)
    against the one-launch kernels: h and a bit for bit, the fp32 scatter sums to fp32 rounding,
    for runs of every kind -- empty runs, runs shorter than a tile, runs that cut tiles anywhere, a
    whole expert in one run, padding rows."""
    from tlx_dist.fused.tlx_backend import _Hopper
    from tlx_dist.grouped_gemm.host import prep_tile_cum

    E, D, Fe, N, R = 6, 1024, 768, 2000, 1500
    g = torch.Generator(DEV).manual_seed(3)
    x = torch.randn(R, D, device=DEV, generator=g).to(BF16)
    src = torch.randint(0, R, (N,), device=DEV, generator=g, dtype=torch.int32)
    gate = torch.rand(N, device=DEV, generator=g)
    w13 = (torch.randn(E, D, 2 * Fe, device=DEV, generator=g) / D ** 0.5).to(BF16)
    w2 = (torch.randn(E, Fe, D, device=DEV, generator=g) / Fe ** 0.5).to(BF16)
    # expert e owns rows [starts[e], offs_E[e]); the last one none; 160 padding rows past 1840
    offs_E = torch.tensor([300, 301, 700, 1100, 1840, 1840], dtype=torch.int32, device=DEV)
    starts = [0, 300, 301, 700, 1100, 1840]
    cuts = [(0, 0), (120, 300), (301, 301), (301, 700), (700, 1100), (1333, 1555)]  # own run [a, b)
    V = []
    for j in range(E):
        a, b = (min(max(c, starts[j]), int(offs_E[j])) for c in cuts[j])
        V += [a, b, int(offs_E[j])]
    offs_V = torch.tensor(V, dtype=torch.int32, device=DEV)
    H = _Hopper()  # the primitives, bound to the default config
    tc = prep_tile_cum(offs_E, N, 128)
    h1, a1 = H.gate_up_swiglu(x, src, w13, offs_E, tc)
    o1 = H.down_scatter(a1, w2, offs_E, src, gate, R, tc)
    tc0, tc1 = H.phase_tile_cums(offs_V, N, x)
    cap = H.free_sms(x.device, 40)
    h2, a2 = H.gate_up_swiglu(x, src, w13, offs_V, tc0, virt=3, grid_cap=cap)
    H.gate_up_swiglu(x, src, w13, offs_V, tc1, virt=3, out=(h2, a2))
    o2 = H.down_scatter(a2, w2, offs_V, src, gate, R, tc1, virt=3)
    H.down_scatter(a2, w2, offs_V, src, gate, R, tc0, virt=3, grid_cap=cap, out=o2)
    torch.cuda.synchronize()
    assert torch.equal(h1, h2) and torch.equal(a1, a2)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
