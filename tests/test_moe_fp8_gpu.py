"""MoELayer(precision="fp8") on the GPU (tier T3): the TLX FP8 kernels (sm_90) through the whole
layer against float64, bounded by torch's own FP8 path (tests/fp8_layer_cases.py), on random and
adversarial inputs and routings; the same layer over the symmetric exchange; the pinned candidate
tile configs; and the errors a GPU without FP8 tensor cores must give.
Run: ``pytest -m gpu tests/test_moe_fp8_gpu.py``."""

from __future__ import annotations

import pytest
import torch

import tlx
from _util import make_cfg
from fp8_layer_cases import EXPERT_CASES, LAYER_CASES, check_experts_fp8_vs_fp64, check_layer_fp8_vs_fp64
from tlx_dist import MoELayer
from tlx_dist.testing import assert_close_ksum_bf16

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
needs_tlx = pytest.mark.skipif(not (tlx.tlx_available() and tlx.gpu_arch() == "sm_90"),
                               reason="the TLX FP8 kernels need sm_90 with fbtriton")


@needs_tlx
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_fp8_tlx_vs_fp64(case):
    check_layer_fp8_vs_fp64(case, "tlx", DEV)


@needs_tlx
@pytest.mark.parametrize("case", EXPERT_CASES, ids=[c[4] for c in EXPERT_CASES])
def test_experts_fp8_tlx_vs_fp64(case):
    check_experts_fp8_vs_fp64(case, "tlx", DEV)


@needs_tlx
def test_auto_backend_is_tlx_and_pipeline_separate():
    cfg = make_cfg(dim=512, moe_inter_dim=256, num_experts=8, top_k=2, dtype="bfloat16", init_std=0.05)
    torch.manual_seed(0)
    auto = MoELayer(cfg, precision="fp8", device=DEV)
    pinned = MoELayer(cfg, precision="fp8", gemm_backend="tlx", device=DEV)
    pinned.load_state_dict(auto.state_dict())
    x = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    assert not auto._fused(x)
    torch.testing.assert_close(auto(x), pinned(x), rtol=0, atol=0)


@needs_tlx
def test_pinned_candidate_config_matches_the_default():
    # CANDIDATES[1]'s 64-wide wgmmas may sum a k32 chunk's products in another order inside the
    # tensor core than the default's 128-wide ones: its bf16 results may then differ by one bf16 ulp
    # (the fp32 promotion order per 128-wide k-step is the same).
    from tlx_dist.fp8.tlx_gemm import CANDIDATES

    cfg = make_cfg(dim=512, moe_inter_dim=384, num_experts=8, top_k=2, dtype="bfloat16", init_std=0.05)
    torch.manual_seed(0)
    base = MoELayer(cfg, precision="fp8", device=DEV)
    tuned = MoELayer(cfg, precision="fp8", device=DEV, gemm_config=CANDIDATES[1])
    tuned.load_state_dict(base.state_dict())
    x = torch.randn(300, 512, device=DEV, dtype=torch.bfloat16)
    outs = []
    for layer in (base, tuned):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.float().square().sum().backward()
        outs.append([out, xi.grad, layer.w13.grad, layer.w2.grad])
    for a, b in zip(*outs):
        assert_close_ksum_bf16(a, b)


@needs_tlx
def test_fp8_layer_over_the_symmetric_exchange_one_rank():
    # dispatcher="symm" on one rank delivers the local dispatcher's rows in its order: the FP8 GEMMs
    # see the same operands; only the combine's fp32 k-sum order may differ.
    cfg = make_cfg(dim=512, moe_inter_dim=256, num_experts=16, top_k=4, dtype="bfloat16", init_std=0.05)
    torch.manual_seed(0)
    a = MoELayer(cfg, dispatcher="local", precision="fp8", device=DEV)
    b = MoELayer(cfg, dispatcher="symm", precision="fp8", device=DEV)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 100, 512, device=DEV, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oa, ob = a(xa), b(xb)
    assert_close_ksum_bf16(oa, ob)
    oa.float().square().sum().backward()
    ob.float().square().sum().backward()
    assert_close_ksum_bf16(xa.grad, xb.grad)
    b.dispatcher.check()


def test_errors_on_this_gpu():
    cfg = make_cfg(dim=256, moe_inter_dim=128, dtype="bfloat16")
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match=r"precision='fp8'.*no FP8 tensor cores"):
            MoELayer(cfg, precision="fp8", device=DEV)
        return
    with pytest.raises(ValueError, match=r"precision='fp8'.*\(D, 2F\) = \(200, 256\).*multiples of 16"):
        MoELayer(make_cfg(dim=200, moe_inter_dim=128, dtype="bfloat16"), precision="fp8", device=DEV)
    # fp32 parameters are fine (train/ keeps fp32 masters and runs bf16 copies); fp32 activations
    # reach the FP8 GEMM, whose outputs are 16-bit: a TypeError naming precision
    fp32 = MoELayer(make_cfg(dim=256, moe_inter_dim=128), precision="fp8", device=DEV)
    with pytest.raises(TypeError, match=r"precision='fp8' backend='(tlx|torch)': x_ND must be bfloat16 or float16"):
        fp32(torch.randn(8, 256, device=DEV))
    # a layer built on the CPU and moved: the first forward names precision, no bf16 fallback
    layer = MoELayer(make_cfg(dim=200, moe_inter_dim=128, dtype="bfloat16"), precision="fp8").to(DEV)
    with pytest.raises(ValueError, match=r"precision='fp8'.*multiples of 16"):
        layer(torch.randn(8, 200, device=DEV, dtype=torch.bfloat16))


@pytest.mark.parametrize("case", [c for c in __import__("fp8_dispatch_cases").CASES if c[1] is None],
                         ids=lambda c: c[-1])
def test_fp8_dispatch_emulated_world_on_the_gpu(case):
    # tier T4: the real exchange kernels, W virtual ranks on this GPU (peer pointers; the NVSHMEM
    # route is emulated on CPU only), the quantization kernels on the GPU
    from fp8_dispatch_cases import check_fp8_dispatch_world

    check_fp8_dispatch_world(*case, device=DEV)


@needs_tlx
def test_eager_calls_run_the_op_bodies_bit_for_bit(monkeypatch):
    # eager calls run the FP8 and combine ops' bodies directly (tlx_dist/grouped_gemm/eager.py):
    # no registered op runs, and the layer's output and every gradient equal the ops' path bit for
    # bit on the TLX kernels and the fused combine kernel (the separate pipeline is deterministic)
    import collections

    from tlx_dist.comm import local_combine as LC
    from tlx_dist.fp8 import api as A
    from tlx_dist.fp8 import swiglu as S
    from tlx_dist.grouped_gemm import eager

    ops = collections.Counter()
    for e in [v for m in (A, S, LC) for v in vars(m).values() if isinstance(v, eager.EagerCustomOp)]:
        monkeypatch.setattr(e, "op", (lambda op, n: lambda *a, **k: ops.update([n]) or op(*a, **k))(e.op, e.name))
    cfg = make_cfg(dim=512, moe_inter_dim=256, num_experts=16, top_k=4, dtype="bfloat16", init_std=0.05)
    torch.manual_seed(0)
    layer = MoELayer(cfg, precision="fp8", device=DEV)
    x = torch.randn(300, 512, device=DEV, dtype=torch.bfloat16)

    def run():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        grads = torch.autograd.grad(out.float().square().sum(), [xi] + list(layer.parameters()), allow_unused=True)
        return [out] + [g for g in grads if g is not None]

    direct = run()
    assert not ops, dict(ops)
    with monkeypatch.context() as m:
        m.setattr(eager, "traced", lambda args, kwargs: True)
        via_op = run()
    assert {"tlx_dist::fp8_mm", "tlx_dist::local_combine_weighted", "tlx_dist::local_gather_ksum"} <= set(ops)
    assert len(direct) == len(via_op)
    for i, (a, b) in enumerate(zip(direct, via_op)):
        assert torch.equal(a, b), f"tensor {i} differs"
