"""MoELayer(precision="fp8") on CPU: configuration and argument errors (each names ``precision``),
devices and shapes the FP8 kernels cannot take (a ValueError, never a bf16 fallback), accuracy of
the reference path against float64 bounded by torch's own FP8 path (tests/fp8_layer_cases.py),
expert parallelism over gloo, and the weight cache: FP8 weight copies made once per optimizer step,
not once per micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _util import make_cfg
from fp8_layer_cases import EXPERT_CASES, LAYER_CASES, check_experts_fp8_vs_fp64, check_layer_fp8_vs_fp64
from tlx_dist import MoEConfig, MoELayer
from tlx_dist.fp8.tlx_gemm import Fp8GemmConfig
from tlx_dist.fused import FusedConfig
from tlx_dist.grouped_gemm import GroupedGemmConfig


# --- configuration and arguments -------------------------------------------------------------------


def test_config_precision_field():
    assert make_cfg().precision == "bf16"  # the default is unchanged
    assert make_cfg(precision="fp8").precision == "fp8"
    with pytest.raises(ValueError, match=r"moe\.precision='fp4' must be one of \('bf16', 'fp8'\)"):
        make_cfg(precision="fp4")
    with pytest.raises(ValueError, match=r"moe\.precision='fp8' needs dtype float32, bfloat16 or float16"):
        make_cfg(precision="fp8", dtype="float64")
    cfg = MoEConfig.from_dict(dict(dim=16, moe_inter_dim=8, num_experts=4, top_k=1, precision="fp8"))
    assert cfg.precision == "fp8"


def test_layer_precision_argument():
    cfg = make_cfg(dim=32, moe_inter_dim=16)
    assert MoELayer(cfg).precision == "bf16"
    layer = MoELayer(cfg, precision="fp8")
    assert layer.precision == "fp8" and layer.cfg.precision == "fp8" and "precision=fp8" in repr(layer)
    assert MoELayer(make_cfg(dim=32, moe_inter_dim=16, precision="fp8")).precision == "fp8"
    assert MoELayer(make_cfg(dim=32, moe_inter_dim=16, precision="fp8"), precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match=r"precision='int8' must be one of"):
        MoELayer(cfg, precision="int8")
    with pytest.raises(ValueError, match=r"moe\.precision='fp8' needs dtype"):
        MoELayer(make_cfg(dim=32, moe_inter_dim=16, dtype="float64"), precision="fp8")
    with pytest.raises(ValueError, match="fp8_refresh='always'"):
        MoELayer(cfg, precision="fp8", fp8_refresh="always")


@pytest.mark.parametrize("kw,exc,match", [
    (dict(pipeline="fused"), ValueError, r"precision='fp8' runs the separate pipeline.*pipeline='separate'"),
    (dict(fused_config=FusedConfig()), ValueError, r"fused_config .* precision='fp8' does not run"),
    (dict(gemm_backend="triton"), ValueError, r"precision='fp8' takes gemm_backend 'tlx', 'torch', 'reference'"),
    (dict(gemm_config=GroupedGemmConfig()), TypeError, r"precision='fp8' takes gemm_config as an Fp8GemmConfig"),
], ids=["fused_pipeline", "fused_config", "triton_backend", "bf16_tile_config"])
def test_fp8_argument_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        MoELayer(make_cfg(dim=32, moe_inter_dim=16), precision="fp8", **kw)


def test_bf16_layer_rejects_an_fp8_tile_config():
    with pytest.raises(TypeError, match=r"GroupedGemmConfig or None, got Fp8GemmConfig \(precision='bf16'.*needs precision='fp8'\)"):
        MoELayer(make_cfg(dim=32, moe_inter_dim=16), gemm_config=Fp8GemmConfig())
    with pytest.raises(ValueError, match=r"Fp8GemmConfig.precision='bf16' must be 'fp8'"):
        Fp8GemmConfig(precision="bf16")


def _fake_cuda(monkeypatch, cc, name, arch):
    import tlx

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    return tlx.override(arch=arch, tlx=True)


def test_devices_and_shapes_the_kernels_cannot_take(monkeypatch):
    # Checked before any parameter is allocated, so no GPU is needed to see the errors.
    cfg = make_cfg(dim=256, moe_inter_dim=128, dtype="bfloat16")
    with _fake_cuda(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB", "other"):
        with pytest.raises(ValueError, match=r"precision='fp8'.*A100.*sm_80.*no FP8 tensor cores"):
            MoELayer(cfg, precision="fp8", device="cuda")
    with _fake_cuda(monkeypatch, (9, 0), "NVIDIA H200", "sm_90"):
        with pytest.raises(ValueError, match=r"precision='fp8'.*w13's \(D, 2F\) = \(200, 256\).*multiples of 16"):
            MoELayer(make_cfg(dim=200, moe_inter_dim=128, dtype="bfloat16"), precision="fp8", device="cuda")
        with pytest.raises(ValueError, match=r"precision='fp8'.*w2's \(F, D\) = \(72, 256\).*multiples of 16"):
            MoELayer(make_cfg(dim=256, moe_inter_dim=72, dtype="bfloat16"), precision="fp8", device="cuda")
    monkeypatch.setattr(torch.version, "hip", "6.3")
    with pytest.raises(ValueError, match=r"precision='fp8': ROCm"):
        MoELayer(cfg, precision="fp8", device="cuda")


def test_cpu_runs_the_reference_path_on_any_shape():
    # CPU is the reference (dequantized operands, fp32 matmuls): odd dims are fine there.
    layer = MoELayer(make_cfg(dim=200, moe_inter_dim=72, num_experts=5, top_k=2), precision="fp8")
    x = torch.randn(19, 200, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match=r"precision='fp8' backend='tlx' needs a CUDA device"):
        MoELayer(make_cfg(dim=200, moe_inter_dim=72), precision="fp8", gemm_backend="tlx")(x.detach())


# --- accuracy against float64 (STYLE.md 6 with torch's FP8 path) -----------------------------------


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_fp8_vs_fp64(case):
    check_layer_fp8_vs_fp64(case, "reference", "cpu")


@pytest.mark.parametrize("case", EXPERT_CASES, ids=[c[4] for c in EXPERT_CASES])
def test_experts_fp8_vs_fp64(case):
    check_experts_fp8_vs_fp64(case, "reference", "cpu")


# --- expert parallelism ----------------------------------------------------------------------------

T_GLOBAL = 64


def _ep_batch(cfg):
    g = torch.Generator().manual_seed(3)
    return torch.randn(T_GLOBAL, cfg.dim, generator=g), torch.randn(T_GLOBAL, cfg.dim, generator=g)


def _ep_run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * dy).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _ep_cfg():
    return make_cfg(dim=160, moe_inter_dim=48, num_experts=4, top_k=2, init_std=0.1, precision="fp8")


def _fp8_ep_worker(rank, world):
    cfg = _ep_cfg()
    torch.manual_seed(0)
    layer = MoELayer(cfg, ep_group=dist.group.WORLD, dispatcher="all_to_all")
    x, dy = _ep_batch(cfg)
    n = T_GLOBAL // world
    out, dx, grads = _ep_run(layer, x[rank * n:(rank + 1) * n], dy[rank * n:(rank + 1) * n])
    return dict(out=out, dx=dx, grads=grads, expert_range=layer.expert_range)


def test_fp8_layer_ep2_all_to_all_matches_one_rank():
    # Every token's rows reach the expert's rank in the one-rank order (rank-major token ids), so
    # each GEMM sees the same rows, quantized alike: the results agree to fp32 rounding.
    res = run_world(_fp8_ep_worker, 2)
    torch.manual_seed(0)
    full = MoELayer(_ep_cfg())
    x, dy = _ep_batch(full.cfg)
    out1, dx1, grads1 = _ep_run(full, x, dy)
    close = dict(rtol=1e-5, atol=1e-6)
    n = T_GLOBAL // 2
    for r, rr in enumerate(res):
        rows = slice(r * n, (r + 1) * n)
        torch.testing.assert_close(rr["out"], out1[rows], **close)
        torch.testing.assert_close(rr["dx"], dx1[rows], **close)
        lo, hi = rr["expert_range"]
        torch.testing.assert_close(rr["grads"]["w13"], grads1["w13"][lo:hi], **close)
        torch.testing.assert_close(rr["grads"]["w2"], grads1["w2"][lo:hi], **close)
    torch.testing.assert_close(sum(rr["grads"]["router.weight"] for rr in res), grads1["router.weight"], **close)


# --- FP8 weight copies: once per optimizer step ----------------------------------------------------


def _micro_batches(layer, opt, n_micro, T=24, checkpoint=False):
    for i in range(n_micro):
        x = torch.randn(T, layer.cfg.dim)
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        else:
            out = layer(x)
        (out.square().mean() / n_micro).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "recomputed_forward"])
def test_weights_quantized_once_per_optimizer_step(checkpoint):
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(dim=64, moe_inter_dim=32), precision="fp8")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=True)
    before = layer.w13.detach().clone()
    _micro_batches(layer, opt, 3, checkpoint=checkpoint)
    assert layer.fp8_quantizations == 2  # w13 and w2, once for the three micro-batches (and the recomputation)
    _micro_batches(layer, opt, 3, checkpoint=checkpoint)
    assert layer.fp8_quantizations == 4  # the optimizer step changed them: quantized again, once
    assert not torch.equal(layer.w13.detach(), before)
    # the copy in use is the quantization of the current weight
    from tlx_dist.fp8 import quantize_weight

    cur = layer._fp8_weights()[0]
    assert torch.equal(cur.q_EDF.view(torch.uint8), quantize_weight(layer.w13.detach()).q_EDF.view(torch.uint8))


def test_step_refresh_ignores_rewrites_between_steps():
    # fp8_refresh="step": a weight rewritten with the same values between micro-batches (FSDP2's
    # per-micro-batch all-gather) is not requantized; invalidate_fp8_weights (once per step) and
    # load_state_dict are what make the copies stale.
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(dim=64, moe_inter_dim=32), precision="fp8", fp8_refresh="step")
    by_version = MoELayer(make_cfg(dim=64, moe_inter_dim=32), precision="fp8")
    x = torch.randn(8, 64)
    for lay in (layer, by_version):
        for _ in range(3):
            with torch.no_grad():
                lay.w13.copy_(lay.w13.clone())  # same values, a new version
            lay(x)
    # by version: w13 three times (each rewrite), w2 once
    assert layer.fp8_quantizations == 2 and by_version.fp8_quantizations == 4
    layer.invalidate_fp8_weights()
    layer(x)
    assert layer.fp8_quantizations == 4
    layer.load_state_dict(by_version.state_dict())
    torch.testing.assert_close(layer(x), by_version(x), rtol=0, atol=0)
    assert layer.fp8_quantizations == 6


def test_a_pinned_fp8_config_is_not_dropped():
    # on CPU the reference runs, which has no tiles: the pinned config is an error at the call
    layer = MoELayer(make_cfg(dim=32, moe_inter_dim=16), precision="fp8", gemm_config=Fp8GemmConfig(128, 128, 5))
    with pytest.raises(ValueError, match=r"config= pins the TLX FP8 kernel's tile config, but backend 'reference'"):
        layer(torch.randn(4, 32))


# --- FP8 dispatch: packed rows (the exchange itself: tests/symm_fp8_interpreted_cases.py) ----------


def test_pack_unpack_roundtrip_and_width():
    from tlx_dist.fp8.dispatch import pack_rows, packed_width, unpack_rows
    from tlx_dist.fp8.quant import quantize_rows

    x = torch.randn(7, 300).to(torch.bfloat16)
    r = quantize_rows(x)
    p = pack_rows(r, torch.bfloat16)
    assert p.shape == (7, packed_width(300, torch.bfloat16)) and (p.shape[1] * 2) % 16 == 0
    assert packed_width(4096, torch.bfloat16) == 2112  # 4096 + 128 bytes: 0.52 of the bf16 row
    u = unpack_rows(p, 300)
    assert torch.equal(u.q_MC.view(torch.uint8), r.q_MC.view(torch.uint8)) and torch.equal(u.s_MCb, r.s_MCb)
    assert u.q_MC.stride() == (p.shape[1] * 2, 1)  # a view of the packed rows, read in place
    with pytest.raises(ValueError, match=r"packed_NP must be \[N, "):
        unpack_rows(p[:, :-8], 300)


@pytest.mark.parametrize("dispatcher", ["local", "all_to_all"])
def test_fp8_layer_dispatches_packed_rows(dispatcher, monkeypatch):
    # The FP8 layer sends packed FP8 rows (dispatch_payload), never the bf16 rows, and its gate/up
    # GEMM reads the received FP8 rows: the same output as the bf16 dispatch's rows quantized where
    # they arrive (the quantization is per row), and a gradient back to x.
    from _train import one_rank_group
    from tlx_dist.comm import Dispatcher
    from tlx_dist.fp8 import swiglu_experts_fp8
    from tlx_dist.fp8.dispatch import packed_width

    cfg = make_cfg(dim=256, moe_inter_dim=64, num_experts=4, top_k=2, dtype="bfloat16", init_std=0.05)
    seen = []
    real = Dispatcher.dispatch_payload

    def spy(self, payload, idx, gate, x):
        seen.append(tuple(payload.shape))
        return real(self, payload, idx, gate, x)

    monkeypatch.setattr(Dispatcher, "dispatch_payload", spy)
    x = torch.randn(40, 256).to(torch.bfloat16)
    with one_rank_group():
        torch.manual_seed(0)
        kw = dict(ep_group=dist.group.WORLD, dispatcher="all_to_all") if dispatcher == "all_to_all" else {}
        layer = MoELayer(cfg, precision="fp8", **kw)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.float().square().sum().backward()
        assert seen == [(40, packed_width(256, torch.bfloat16))]
        assert xi.grad is not None and torch.isfinite(xi.grad).all() and xi.grad.abs().sum() > 0
        r = layer.router(x)
        recv, h = layer.dispatcher.dispatch(x, r.idx_TK, r.gate_TK)
        y = swiglu_experts_fp8(recv, layer.w13, layer.w2, h.offsets_e)
        want = layer.dispatcher.combine_weighted(y, h, r.gate_TK)
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
