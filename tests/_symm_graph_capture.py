"""Child of tests/test_symm_gpu.py::test_layer_fwd_bwd_cuda_graph_with_symm_dispatcher: captures a
MoELayer forward (then forward+backward) with the symm dispatcher in CUDA graphs and checks that
replays give what eager gives. Prints which capture step failed, if one does."""

import os
import tempfile

import torch
import torch.distributed as dist

from tlx_dist import MoEConfig, MoELayer


def main():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            run()
        finally:
            dist.destroy_process_group()


def run():
    cfg = MoEConfig(dim=512, moe_inter_dim=256, num_experts=16, top_k=4, dtype="bfloat16")
    torch.manual_seed(0)
    layer = MoELayer(cfg, dist.group.WORLD, device="cuda", dispatcher="symm", capacity=2.0)
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = list(layer.parameters()) + [x]

    def fwd_bwd():
        out = layer(x)
        out.float().square().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    eager = fwd_bwd().detach().clone()
    eager_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    stage = "forward"
    try:
        g_fwd = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g_fwd):
            out_f = layer(x)
        g_fwd.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_f, eager), "forward replay differs from eager"
        print("forward capture: replay equals eager", flush=True)
        stage = "forward+backward"
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_g = fwd_bwd()
        for _ in range(2):
            for p in params:
                p.grad.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out_g, eager), "replayed output differs"
            for p, ge in zip(params, eager_grads):
                assert torch.equal(p.grad, ge), "replayed gradient differs"
        layer.dispatcher.check()
        print("forward+backward capture: replays equal eager", flush=True)
    except Exception as exc:
        print(f"capture of {stage} failed: {type(exc).__name__}: {exc}", flush=True)
        raise


if __name__ == "__main__":
    main()
