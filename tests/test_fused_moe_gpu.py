"""The fused expert pipeline on the GPU (tier T3): the TLX kernels of the GPU present (Hopper on sm_90,
Blackwell on sm_100: ``tlx_backend._tlx_prims``) primitive by primitive, the
whole pipeline fused vs separate vs the fp64 loop (forward and every gradient) on adversarial
routing, the portable kernels on odd shapes, and the layer captured in a CUDA graph with no host
sync.

Tolerances (STYLE.md 6): max|ours - ref64| <= 2 * max|same_dtype - ref64| + atol. For one primitive
``same_dtype`` is the portable Triton kernel on the same inputs; for the pipeline it is the
per-expert loop run in bf16. Tests that run a TLX kernel carry a thread-method timeout so that a hung
kernel ends the run with a stack dump instead of holding the GPU.
"""

from __future__ import annotations

import pytest
import torch

import tlx
from tlx_dist.fused import FusedConfig, fused_experts, fused_experts_ref
from tlx_dist.testing import assert_close_ksum_bf16, assert_close_to_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_tlx = pytest.mark.skipif(not (tlx.tlx_available() and tlx.gpu_arch() in ("sm_90", "sm_100")),
                               reason="the fused TLX kernels need TLX on sm_90 or sm_100")
DEV = "cuda"
BF16 = torch.bfloat16


def _prims():
    from tlx_dist.fused.backends import _Portable
    from tlx_dist.fused.tlx_backend import _tlx_prims

    return _tlx_prims(), _Portable


def _per_expert(offsets, fn):
    lo = 0
    for e, hi in enumerate(offsets.tolist()):
        if hi > lo:
            fn(e, lo, hi)
        lo = hi


# Tile-field overrides of the Hopper forms (``FusedConfig.from_dict``: fields replacing those of the
# form's base default). The epilogue warp group (EPI_WG; the scatter default) for the forms that take
# it (dSwiGLU from gathered dout rows and from dout's expert-major copy, the scatters), and the same
# forms with the epilogue inline (the consumers run it after their main loop).
_W1 = dict(EPI_WG=1, REGS=136, EPI_REGS=184, STAGES=4, LAG=2, EPI_COLS=32)
EPI_WG = dict(dswiglu=_W1, dswiglu_copy=_W1, scatter=dict(EPI_WG=1, REGS=152, EPI_REGS=152, EPI_COLS=32))
INLINE = dict(scatter=dict(EPI_WG=0, REGS=232, STAGES=4),
              dswiglu_copy=dict(EPI_WG=0, PINGPONG=0, REGS=216, STAGES=6, LAG=4))
# one epilogue warp group per consumer (EPI_WG=2, five warp groups)
_W2 = dict(EPI_WG=2, REGS=104, EPI_REGS=120, STAGES=4, LAG=2, EPI_COLS=16)
EPI_WG2 = dict(dswiglu=_W2, dswiglu_copy=_W2, scatter=dict(EPI_WG=2, REGS=104, EPI_REGS=120, EPI_COLS=32))


@needs_tlx
@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize("spec", [{}, INLINE, EPI_WG], ids=["default", "inline", "epi_wg"])
def test_tlx_primitives_vs_fp64(spec):
    """Each TLX kernel (Hopper or Blackwell) against its fp64 definition, bounded by the portable kernel's error on the
    same inputs. Routing has an empty expert, an expert of one row, a 300-row expert (three M
    tiles) and 40 padding rows whose indices are out of range (never read). ``epi_wg``: the Hopper
    scatter and dSwiGLU forms with their epilogue in its own warp group (config EPI_WG)."""
    if spec and tlx.gpu_arch() != "sm_90":
        pytest.skip("EPI_WG is a Hopper option")  # (the Hopper fields are unknown to the sm_100 configs)
    H, P = _prims()
    H, P = H(FusedConfig.from_dict(spec)), P()
    g = torch.Generator(DEV).manual_seed(0)
    T, D, F, counts = 256, 192, 128, [0, 1, 300, 99, 0, 112, 0, 0]
    E, live = len(counts), sum(counts)
    N = live + 40
    x = torch.randn(T, D, device=DEV, generator=g).to(BF16)
    w13 = (torch.randn(E, D, 2 * F, device=DEV, generator=g) / D ** 0.5).to(BF16)
    w2 = (torch.randn(E, F, D, device=DEV, generator=g) / F ** 0.5).to(BF16)
    src = torch.cat([torch.randint(0, T, (live,), device=DEV, generator=g), torch.full((40,), 1 << 30, device=DEV)])
    src = src.to(torch.int32)
    dst = torch.randint(0, T, (N,), device=DEV, generator=g).to(torch.int32)
    gate = torch.rand(N, device=DEV, generator=g)
    dout = torch.randn(T, D, device=DEV, generator=g).to(BF16)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    f64 = torch.float64

    outs = {}
    for name, p in (("tlx", H), ("portable", P)):
        tc = p.tile_cum(offs, N, x)
        h, a = p.gate_up_swiglu(x, src, w13, offs, tc)
        out = p.down_scatter(a, w2, offs, dst, gate, T, tc)
        dh, ag, dgate = p.down_dswiglu(dout, dst, w2, offs, h, gate, tc)
        dx = p.down_scatter(dh, w13.transpose(1, 2), offs, src, None, T, tc)
        dw13 = p.wgrad_gather(x, src, dh, None, offs, p.wgrad_order(offs))
        dw2 = p.wgrad_gather(ag, None, dout, dst, offs, p.wgrad_order(offs))
        outs[name] = dict(h=h, a=a, out=out, dh=dh, ag=ag, dgate=dgate, dx=dx, dw13=dw13, dw2=dw2)
    t = outs["tlx"]
    # fp64 definitions, each from the tlx kernel's own inputs (so errors do not compound).
    ref = {k: torch.zeros(v.shape, dtype=f64, device=DEV) for k, v in t.items()}
    hf, af, dhf, agf = (t[k].to(f64) for k in ("h", "a", "dh", "ag"))

    def expert(e, lo, hi):
        xs, ds = x[src[lo:hi].long()].to(f64), dout[dst[lo:hi].long()].to(f64)
        ref["h"][lo:hi] = xs @ w13[e].to(f64)
        hg, hu = hf[lo:hi, :F], hf[lo:hi, F:]
        sig = torch.sigmoid(hg)
        ref["a"][lo:hi] = hg * sig * hu
        ref["out"].index_add_(0, dst[lo:hi].long(), gate[lo:hi, None].to(f64) * (af[lo:hi] @ w2[e].to(f64)))
        gg = ds @ w2[e].to(f64).t()
        ref["dgate"][lo:hi] = (hg * sig * hu * gg).sum(1)
        da = gg * gate[lo:hi, None].to(f64)
        ref["dh"][lo:hi] = torch.cat([da * hu * sig * (1 + hg * (1 - sig)), da * hg * sig], 1)
        ref["ag"][lo:hi] = hg * sig * hu * gate[lo:hi, None].to(f64)
        ref["dx"].index_add_(0, src[lo:hi].long(), dhf[lo:hi] @ w13[e].to(f64).t())
        ref["dw13"][e] = xs.t() @ dhf[lo:hi]
        ref["dw2"][e] = agf[lo:hi].t() @ ds

    _per_expert(offs, expert)
    for k in ref:
        assert_close_to_ref(t[k], ref[k], outs["portable"][k], dtype=BF16, name=f"tlx {k}")
    for k in ("h", "a", "dh", "ag", "dgate"):
        assert torch.all(t[k][live:] == 0), f"padding rows of {k} must be zero"
    assert torch.all(t["dw13"][torch.tensor(counts) == 0] == 0)


@needs_tlx
@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize("spec", [EPI_WG, EPI_WG2], ids=["one_wg", "wg_per_consumer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_epilogue_warp_group_matches_the_inline_epilogue(dtype, spec):
    """EPI_WG moves the scatter and dSwiGLU epilogues into their own warp group, which reads each
    consumer's fp32 accumulator from shared memory in column chunks while the consumers run the
    next tile: the same fp32 values go through the same math, so dh and ag match the inline
    epilogue's to the rounding of one element (and almost always exactly), the scatter outputs and
    the gate-gradient partials up to fp32 summation order. F=192 and D=320 leave half-masked column
    tiles and chunks; routing with empty experts, a one-row expert, several M tiles per expert and
    padding rows whose indices are out of range; more tiles than SMs, so every consumer hands
    several tiles over (the barriers' phases turn)."""
    if tlx.gpu_arch() != "sm_90":
        pytest.skip("EPI_WG is a Hopper option")
    from tlx_dist.fused.tlx_backend import _tlx_prims

    g = torch.Generator(DEV).manual_seed(3)
    T, D, F = 3000, 320, 192
    counts = [0, 1, 2570, 0, 1300, 640, 0, 4000, 3, 129, 2000, 0]
    E, live = len(counts), sum(counts)
    N = live + 24
    x = torch.randn(T, D, device=DEV, generator=g).to(dtype)
    w13 = (torch.randn(E, D, 2 * F, device=DEV, generator=g) / D ** 0.5).to(dtype)
    w2 = (torch.randn(E, F, D, device=DEV, generator=g) / F ** 0.5).to(dtype)
    src = torch.cat([torch.randint(0, T, (live,), device=DEV, generator=g), torch.full((24,), 1 << 30, device=DEV)])
    src = src.to(torch.int32)
    dst = torch.randint(0, T, (N,), device=DEV, generator=g).to(torch.int32)
    gate = torch.rand(N, device=DEV, generator=g)
    dout = torch.randn(T, D, device=DEV, generator=g).to(dtype)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    got = {}
    for name, cfg in (("inline", INLINE), ("epi", spec)):
        p = _tlx_prims()(FusedConfig.from_dict(cfg))
        tc = p.tile_cum(offs, N, x)
        h, a = p.gate_up_swiglu(x, src, w13, offs, tc)
        out = p.down_scatter(a, w2, offs, dst, gate, T, tc)
        dh, ag, dgate = p.down_dswiglu(dout, dst, w2, offs, h, gate, tc)
        dx = p.down_scatter(dh, w13.transpose(1, 2), offs, src, None, T, tc)
        # dSwiGLU from dout's expert-major copy (dout_rows "copy": A by TMA, its own config)
        dhc, agc, dgatec = p.down_dswiglu(dout.index_select(0, dst.clamp(0, T - 1)), None, w2, offs, h, gate, tc)
        torch.cuda.synchronize()
        got[name] = dict(dh=dh, ag=ag, out=out, dx=dx, dgate=dgate, dhc=dhc, agc=agc, dgatec=dgatec)
    inline, epi = got["inline"], got["epi"]
    for k in ("dh", "ag", "dhc", "agc"):
        assert epi[k].dtype == dtype
        a_, b_ = epi[k].float(), inline[k].float()
        ulp = b_.abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        assert bool(((a_ - b_).abs() <= ulp).all()), f"EPI_WG {k}: more than one rounding from the inline epilogue"
        assert float((a_ != b_).float().mean()) < 1e-3, f"EPI_WG {k}: many elements differ from the inline epilogue"
        assert torch.all(epi[k][live:] == 0), f"EPI_WG {k}: padding rows must be zero"
    for k in ("out", "dx", "dgate", "dgatec"):
        ref = inline[k].float()
        err = float((epi[k].float() - ref).abs().max() / ref.abs().max())
        assert err <= 1e-5, f"EPI_WG {k}: relative difference {err:.2e} (fp32 summation order allows ~1e-6)"
    assert inline["out"].abs().sum() > 0 and inline["dgate"].abs().sum() > 0


def _separate(x, idx, gate, w13, w2):
    """The landed separate pipeline: permute -> grouped_mm -> SwiGLU -> grouped_mm -> combine -> k-sum."""
    from tlx_dist.comm import LocalDispatcher
    from tlx_dist.grouped_gemm import grouped_mm
    from tlx_dist.moe import swiglu

    disp = LocalDispatcher(w13.shape[0], validate=False)
    recv, handle = disp.dispatch(x, idx)
    y = grouped_mm(swiglu(grouped_mm(recv, w13, handle.offsets_e)), w2, handle.offsets_e)
    y_TKD = disp.combine(y, handle)
    return (y_TKD * gate.to(y.dtype).unsqueeze(-1)).sum(1, dtype=torch.float32).to(x.dtype)


# (id, T, D, F, E, K, routing, why)
CASES = [
    ("random", 1000, 256, 192, 8, 2, "random", "several M tiles per expert, N-tile tails of the 256-wide tiles"),
    ("zero_token_experts", 300, 128, 128, 16, 2, "even", "half the experts empty, between full ones"),
    ("one_expert_all", 700, 128, 64, 4, 1, "all0", "K=1, every token to expert 0: the others empty"),
    ("k_eq_e", 200, 128, 128, 4, 4, "random", "K=E: every token visits every expert"),
    ("single_token", 1, 128, 128, 8, 2, "random", "T=1: two rows, tiles almost entirely masked"),
]


def _routing(kind, T, E, K, g):
    if kind == "even":
        return torch.stack([torch.randperm(E // 2, generator=g)[:K] * 2 for _ in range(T)])
    if kind == "all0":
        return torch.stack([torch.tensor([0] + (torch.randperm(E - 1, generator=g)[:K - 1] + 1).tolist())
                            for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def _grads(fn, x, idx, gate, w13, w2, dout, dtype):
    ps = [t.to(dt).detach().requires_grad_(True) for t, dt in
          ((x, dtype), (gate, torch.float32 if dtype != torch.float64 else dtype), (w13, dtype), (w2, dtype))]
    out = fn(ps[0], idx, ps[1], ps[2], ps[3])
    return [out] + list(torch.autograd.grad(out, ps, dout.to(out.dtype)))


@needs_tlx
@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize("dout", ["gather", "copy", "copy_pingpong", "xcopy"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_vs_separate_vs_fp64(case, dout):
    """``dout``: how the backward reads the upstream gradient's rows (``FusedConfig.dout_rows``): by
    index in dSwiGLU and dW2, or from one expert-major copy that both read in place;
    ``copy_pingpong``: the copy with dSwiGLU's ping-pong consumers (Hopper config PINGPONG);
    ``xcopy``: both dout's and x's rows copied (``x_rows`` "copy": SwiGLU reads x's copy in place,
    dW13 is the plain grouped dW)."""
    tiles = {}
    if dout == "copy_pingpong":
        if tlx.gpu_arch() != "sm_90":
            pytest.skip("PINGPONG is a Hopper option")
        tiles = dict(dswiglu_copy=dict(EPI_WG=0, PINGPONG=1, REGS=232, EPI_COLS=32))
    config = FusedConfig.from_dict(dict(tiles, dout_rows="copy" if dout == "xcopy" else dout.split("_")[0],
                                        x_rows="copy" if dout == "xcopy" else "gather"))
    _, T, D, F, E, K, kind, _ = case
    _fused_separate_fp64(T, D, F, E, K, kind, config)


@needs_tlx
@pytest.mark.timeout(240, method="thread")
def test_fused_deep_reduction_defaults_vs_fp64():
    """The defaults at a deep reduction (D = 4096 >= DSWIGLU_PINGPONG_MIN_D) and a wide F (16 column
    tiles: GROUP_M 8): on Hopper dSwiGLU from the dout copy runs the ping-pong consumers
    (DSWIGLU_COPY_DEEP), as Mixtral and DeepSeek-V3 per rank do; nothing forced."""
    from tlx_dist.fused import fused_tile_config

    if tlx.gpu_arch() == "sm_90":
        cfg = fused_tile_config("dswiglu_copy", 2048, "sm_90", 4096)
        assert cfg.PINGPONG == 1 and cfg.GROUP_M == 8
    _fused_separate_fp64(260, 4096, 2048, 4, 2, "random")


def _fused_separate_fp64(T, D, F, E, K, kind, config=None):
    """fused (under ``config``: row modes, tile configs) vs separate vs the fp64 reference, forward
    and every gradient."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, dtype=torch.float64).to(DEV)
    w13 = (torch.randn(E, D, 2 * F, generator=g, dtype=torch.float64) / D ** 0.5).to(DEV)
    w2 = (torch.randn(E, F, D, generator=g, dtype=torch.float64) / F ** 0.5).to(DEV)
    gate = torch.rand(T, K, generator=g, dtype=torch.float64).to(DEV)
    idx = _routing(kind, T, E, K, g).to(DEV)
    dout = torch.randn(T, D, generator=g, dtype=torch.float64).to(DEV)
    ref = _grads(fused_experts_ref, x, idx, gate, w13, w2, dout, torch.float64)
    same = _grads(fused_experts_ref, x, idx, gate, w13, w2, dout, BF16)
    fused = _grads(lambda *a: fused_experts(*a, backend="tlx", config=config), x, idx, gate, w13, w2, dout, BF16)
    sep = _grads(_separate, x, idx, gate, w13, w2, dout, BF16)
    for i, name in enumerate(["out", "dx", "dgate", "dw13", "dw2"]):
        assert_close_to_ref(fused[i], ref[i], same[i], dtype=BF16, name=f"fused {name}")
        assert_close_to_ref(sep[i], ref[i], same[i], dtype=BF16, name=f"separate {name}")


@pytest.mark.timeout(240, method="thread")
def test_portable_backend_odd_shapes_on_gpu():
    """D, F not multiples of 64 (nor 8): the TLX path declines, the portable kernels run them."""
    from tlx_dist.fused import select_fused_backend

    g = torch.Generator().manual_seed(2)
    T, D, F, E, K = 77, 72, 40, 5, 3
    x = torch.randn(T, D, generator=g, dtype=torch.float64).to(DEV)
    w13 = (torch.randn(E, D, 2 * F, generator=g, dtype=torch.float64) / D ** 0.5).to(DEV)
    w2 = (torch.randn(E, F, D, generator=g, dtype=torch.float64) / F ** 0.5).to(DEV)
    gate = torch.rand(T, K, generator=g, dtype=torch.float64).to(DEV)
    idx = _routing("random", T, E, K, g).to(DEV)
    dout = torch.randn(T, D, generator=g, dtype=torch.float64).to(DEV)
    assert select_fused_backend(x.to(BF16), w13.to(BF16), w2.to(BF16)).name == "triton"
    ref = _grads(fused_experts_ref, x, idx, gate, w13, w2, dout, torch.float64)
    same = _grads(fused_experts_ref, x, idx, gate, w13, w2, dout, BF16)
    ours = _grads(fused_experts, x, idx, gate, w13, w2, dout, BF16)
    for i, name in enumerate(["out", "dx", "dgate", "dw13", "dw2"]):
        assert_close_to_ref(ours[i], ref[i], same[i], dtype=BF16, name=f"portable {name}")


@needs_tlx
@pytest.mark.timeout(240, method="thread")
def test_layer_fused_by_default_graph_capture_no_host_sync():
    """MoELayer picks the fused pipeline on sm_90 (on sm_100 it is asked for: ``auto`` waits until the
    Blackwell kernels have run on a B200); fwd + bwd run with host syncs made errors, then
    are captured in one CUDA graph and replayed on new inputs (outputs and gradients within one bf16
    ulp of eager: they are fp32 atomic k-sums, whose order may differ)."""
    from _util import make_cfg
    from tlx_dist import MoELayer

    torch.manual_seed(0)
    cfg = make_cfg(dim=256, moe_inter_dim=128, num_experts=16, top_k=4, num_shared_experts=1, dtype="bfloat16",
                   init_std=0.05)
    layer = MoELayer(cfg, pipeline="auto" if tlx.gpu_arch() == "sm_90" else "fused").to(DEV)
    params = list(layer.parameters())
    x_static = torch.randn(512, 256, device=DEV, dtype=BF16)
    g_static = torch.randn(512, 256, device=DEV, dtype=BF16)
    assert layer._fused(x_static), "auto pipeline should be fused on sm_90 with TLX"
    if tlx.gpu_arch() == "sm_100":
        from tlx_dist.fused import select_fused_backend

        assert select_fused_backend(x_static, layer.w13, layer.w2).name == "tlx"  # the Blackwell kernels

    def step(x):
        x = x.detach().requires_grad_(True)
        y = layer(x)
        return [y] + list(torch.autograd.grad((y * g_static).sum() + layer.aux_loss, [x] + params))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile kernels, fill caches outside the capture
            step(x_static)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync on the path raises
        try:
            step(x_static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(x_static)
    for seed in (1, 2):
        x_new = torch.randn(512, 256, device=DEV, dtype=BF16, generator=torch.Generator(DEV).manual_seed(seed))
        x_static.copy_(x_new)
        graph.replay()
        eager = step(x_new)
        for a, b in zip(static_out, eager):
            assert_close_ksum_bf16(b, a)


@needs_tlx
@pytest.mark.timeout(240, method="thread")
def test_layer_fused_vs_separate_bf16():
    """Same router, same weights: the two pipelines see identical routing; both within the bf16
    loop's error of the fp64 loop on the output."""
    from _util import clone_layer, make_cfg, reference_of
    from tlx_dist import MoELayer

    torch.manual_seed(0)
    cfg = make_cfg(dim=128, moe_inter_dim=64, num_experts=8, top_k=2, num_shared_experts=1, dtype="float64",
                   init_std=0.1)
    layer64 = MoELayer(cfg)
    x = torch.randn(200, 128, dtype=torch.float64)
    (ref, idx_ref, _, _), _ = reference_of(layer64, x)
    (same, idx_same, _, _), _ = reference_of(clone_layer(layer64, "bfloat16"), x.to(BF16))
    outs = {}
    for pipe in ("fused", "separate"):
        layer = clone_layer(layer64, "bfloat16").to(DEV)
        layer.pipeline = pipe
        outs[pipe] = layer(x.to(BF16).to(DEV)).cpu()
    idx_layer = layer.router(x.to(BF16).to(DEV)).idx_TK.cpu()
    agree = ((idx_same.sort(1).values == idx_ref.sort(1).values).all(1)
             & (idx_layer.sort(1).values == idx_ref.sort(1).values).all(1))
    assert agree.float().mean() > 0.8
    for pipe, out in outs.items():
        assert_close_to_ref(out[agree], ref[agree], same[agree], name=f"layer {pipe}")


@pytest.mark.parametrize("E,K", [(64, 8), (128, 8), (256, 8), (8, 2)])
def test_layout_kernel_matches_the_torch_sort_on_gpu(E, K):
    """The one-launch expert-major layout at training sizes (T = 16384) and skewed routing, against
    the torch sort it replaces in ``fused_experts``; the scheduler tables against their torch forms."""
    from tlx_dist.fused import expert_major_layout, expert_major_slots

    T = 16384
    g = torch.Generator(device="cuda").manual_seed(E)
    logits = torch.randn(T, E, device="cuda", generator=g)
    logits[:, :3] += 1.5  # three hot experts
    logits[:, -E // 4:] = -1e9  # a quarter of the experts get no token
    idx = logits.topk(K, -1).indices
    tok, order, offs, sched = expert_major_layout(idx, E)
    tok_r, order_r, offs_r = expert_major_slots(idx, E)
    assert torch.equal(order, order_r) and torch.equal(tok, tok_r) and torch.equal(offs, offs_r)
    from tlx_dist.fused.backends import sched_order_offset

    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    tiles = (counts + 127) // 128
    assert torch.equal(sched[:E + 1], torch.cat([tiles.cumsum(0), tiles.sum().reshape(1)]).int())
    o = sched_order_offset(E)
    assert torch.equal(sched[o:o + E], torch.argsort(-counts * (E + 1) + torch.arange(E, device="cuda")).int())
