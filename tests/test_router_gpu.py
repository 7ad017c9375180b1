"""The one-launch router (tlx/portable/router.py) on the GPU (tier T3): against the torch ops of
``Router`` at training shapes, forward and backward; no host sync and CUDA-graph capture of the
router's forward + backward; the bf16 MoELayer vs the fp64 loop with it on.
(CPU: tests/router_interpreted_cases.py checks the same kernels under the interpreter.)"""

from __future__ import annotations

import pytest
import torch

from _util import make_cfg
from tlx_dist import Router
from tlx_dist.router import _router_kernel_runs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fwd_bwd(r, x, w):
    """(out, dlogits fp32, dx, dW): dlogits is what the router kernel's backward computes; dx and dW
    come out of the bf16 router GEMM's backward."""
    x = x.detach().clone().requires_grad_(True)
    r.zero_grad(set_to_none=True)
    out = r(x)
    out.stats.logits_TE.retain_grad()
    loss = (out.gate_TK * w).sum() + out.stats.aux_loss + out.stats.z_loss
    loss.backward()
    return out, out.stats.logits_TE.grad, x.grad, r.weight.grad.clone()


@pytest.mark.parametrize("E,K,score,norm,bias", [(64, 8, "softmax", False, False), (128, 8, "softmax", True, True),
                                                 (256, 8, "sigmoid", True, True), (64, 6, "softmax", True, False)])
@pytest.mark.parametrize("T", [1, 333, 4096])
def test_router_kernel_matches_torch_ops_on_gpu(E, K, score, norm, bias, T):
    D = 512
    cfg = make_cfg(dim=D, num_experts=E, top_k=K, score_func=score, route_norm=norm, load_balance_bias=bias,
                   route_scale=1.0 if norm else 2.5, aux_loss_coef=0.01, z_loss_coef=1e-3, dtype="bfloat16",
                   init_std=0.02)
    torch.manual_seed(E + K + T)
    r = Router(cfg).cuda()
    if bias:
        with torch.no_grad():
            r.expert_bias.copy_(torch.randn(E, device="cuda") * 1e-3)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(T, K, device="cuda")
    assert r.kernel and _router_kernel_runs(torch.zeros(1, E, device="cuda"), cfg)  # on by default
    ko, kdl, kdx, kdw = _fwd_bwd(r, x, w)
    r.kernel = False  # the torch ops
    to, tdl, tdx, tdw = _fwd_bwd(r, x, w)
    # rows whose K-th and (K+1)-th selection scores are not (near-)equal must pick the same experts
    logits = to.stats.logits_TE.detach()
    sel = (torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)) + (r.expert_bias if bias else 0)
    top = sel.topk(min(K + 1, E), -1).values
    clear = (top[:, K - 1] - top[:, K]) > 1e-6 * top[:, K - 1].abs().clamp_min(1e-30)
    assert clear.float().mean() > 0.98
    assert torch.equal(ko.idx_TK[clear], to.idx_TK[clear])
    same = (ko.idx_TK == to.idx_TK).all(-1)
    torch.testing.assert_close(ko.gate_TK[same], to.gate_TK[same], rtol=1e-5, atol=1e-7)
    if bool(same.all()):
        assert torch.equal(ko.stats.tokens_per_expert, to.stats.tokens_per_expert)
        torch.testing.assert_close(ko.stats.aux_loss, to.stats.aux_loss, rtol=1e-4, atol=1e-7)
        # the kernel's own output, fp32, tight; then dW / dx after the bf16 GEMM: the same fp32-level
        # inputs may round to neighbouring bf16 values there, so one bf16 ulp (2^-7 relative) apart
        # (a dW entry in tens of thousands has been seen one ulp off under a 2e-3 bound)
        torch.testing.assert_close(kdl, tdl, rtol=1e-4, atol=1e-6 * float(tdl.abs().max()))
        torch.testing.assert_close(kdw.float(), tdw.float(), rtol=2 ** -7, atol=2e-3 * float(tdw.float().abs().max()))
        torch.testing.assert_close(kdx.float(), tdx.float(), rtol=2e-2, atol=2e-2 * float(tdx.float().abs().max()))
    torch.testing.assert_close(ko.stats.z_loss, to.stats.z_loss, rtol=1e-4, atol=1e-7)


def test_router_kernel_no_host_sync_and_graph_capture():
    """Forward + backward of the router with the kernel: no host sync (sync debug mode "error"),
    and a CUDA graph of it replays to the eager numbers."""
    cfg = make_cfg(dim=256, num_experts=64, top_k=8, aux_loss_coef=0.01, z_loss_coef=1e-3, dtype="bfloat16",
                   init_std=0.02, load_balance_bias=True)
    torch.manual_seed(0)
    r = Router(cfg, kernel=True).cuda()
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 8, device="cuda")

    def step():
        out = r(x)
        loss = (out.gate_TK * w).sum() + out.stats.aux_loss + out.stats.z_loss
        gx, gw = torch.autograd.grad(loss, (x, r.weight))
        return out.idx_TK, out.gate_TK.detach(), loss.detach(), gx, gw

    ref = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_layer_vs_fp64_with_router_kernel():
    """The bf16 MoELayer (fused pipeline where it runs) against the fp64 loop with the router kernel
    on (the default): output, x and every parameter gradient within the layer's own bounds."""
    from test_moe_gpu import check_bf16_fwd_bwd_vs_fp64

    check_bf16_fwd_bwd_vs_fp64()
