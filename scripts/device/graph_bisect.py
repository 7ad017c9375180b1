"""Which part of bench/moe_layer.py's fwd+bwd invalidates its CUDA-graph capture (session 7: all three
providers failed, the pure-torch anchor included, while the library's own layer-capture tests pass).

Each piece is captured in a child process of its own (a failed capture poisons the CUDA context):

    python scripts/device/graph_bisect.py [--T 1024] [--mode global]

Pieces, OLMoE shape (D=2048, F=1024, E=64, K=8), bf16: the router GEMM alone (torch.mm, out_dtype=fp32); the router forward; router fwd+bwd; the
torchtitan-style experts on fixed routing, fwd and fwd+bwd; the fused and separate MoELayer,
forward only and fwd+bwd; the same layer at the shape of the passing GPU test (D=256, T=512).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

PIECES = ("mm_f32", "router_fwd", "router_fwd_bwd", "tt_fwd", "tt_fwd_bwd", "fused_fwd", "fused_fwd_bwd", "separate_fwd",
          "separate_fwd_bwd", "fused_fwd_bwd_small")


def child(piece: str, T: int, mode: str) -> None:
    import os
    from unittest import mock

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    from moe_layer import capture, torchtitan_experts

    from tlx_dist import MoEConfig, MoELayer

    small = piece.endswith("_small")
    D, Fe, E, K = (256, 128, 16, 4) if small else (2048, 1024, 64, 8)
    T = 512 if small else T
    cfg = MoEConfig(dim=D, moe_inter_dim=Fe, num_experts=E, top_k=K, dtype="bfloat16", aux_loss_coef=0.0,
                    z_loss_coef=0.0, init_std=D ** -0.5)
    with mock.patch.object(MoELayer, "reset_parameters", lambda self, seed=None: None):
        layer = MoELayer(cfg, device="cuda", pipeline="fused")
    with torch.no_grad():
        layer.router.weight.normal_(std=D ** -0.5)
        layer.w13.normal_(std=D ** -0.5)
        layer.w2.normal_(std=Fe ** -0.5)
    if piece.startswith("separate"):
        layer.pipeline = "separate"
    x0 = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # a live graph here broke every later backward capture (see bench/moe_layer.py)
        r0 = layer.router(x0)
    idx, gate = r0.idx_TK.clone(), r0.gate_TK.clone()
    del r0
    params = list(layer.parameters())
    bwd = "bwd" in piece

    def step():
        x = x0.detach().requires_grad_(True)
        if piece == "mm_f32":  # the router's GEMM alone: torch.mm with out_dtype=float32
            out = torch.mm(x, layer.router.weight.t(), out_dtype=torch.float32)
            gg, ins = torch.ones_like(out), [x]
        elif piece.startswith("router"):
            out = layer.router(x).gate_TK
            gg = torch.ones_like(out)
            ins = [x, layer.router.weight]
        elif piece.startswith("tt"):
            out = torchtitan_experts(x, idx, gate, layer.w13, layer.w2)
            gg, ins = g, [x, layer.w13, layer.w2]
        else:
            out = layer(x)
            gg, ins = g, [x] + params
        return torch.autograd.grad(out, ins, gg, allow_unused=True) if bwd else out

    capture(step, mode)  # the bench's own warm-up, sync check and capture
    print("CAPTURED")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--mode", default="global", choices=("global", "thread_local", "relaxed"))
    ap.add_argument("--pieces", default=",".join(PIECES))
    ap.add_argument("--child", default="")
    ap.add_argument("--log-dir", default="", help="write each child's whole output there (<piece>_<mode>.log)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.T, args.mode)
        return 0
    for piece in args.pieces.split(","):
        p = subprocess.run([sys.executable, __file__, "--child", piece, "--T", str(args.T), "--mode", args.mode],
                           capture_output=True, text=True, timeout=300)
        ok = p.returncode == 0 and "CAPTURED" in p.stdout
        text = p.stdout + p.stderr
        if args.log_dir:
            with open(f"{args.log_dir}/{piece}_{args.mode}.log", "w") as f:
                f.write(text)
        # the first error names the cause; capture_end's "previous error during capture" only follows it
        errs = [ln.strip() for ln in text.splitlines() if "Error" in ln and "previous error during capture" not in ln]
        why = "" if ok else " | " + (errs[0] if errs else " ".join(text.strip().splitlines()[-3:]))[-300:]
        print(f"{piece:<22} {'captured' if ok else 'FAILED'}{why}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
