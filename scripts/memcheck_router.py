"""Runs the one-launch router's kernels (tlx/portable/router.py, forward and backward) once per case,
for compute-sanitizer's memcheck:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python scripts/memcheck_router.py

Cases: a single token; T not a multiple of the block; E not a power of two; K = 1 and K = E;
E = 256 with sigmoid scores, the bias and the normalisation; a NaN row and a +inf row. Each is
compared with the torch ops (``Router(kernel=False)``). Exit 0 and a final
"memcheck router cases: all ok" line when done."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch

    from tlx_dist import MoEConfig, Router

    cases = [  # (T, E, K, score, norm, bias, poison)
        (1, 8, 2, "softmax", True, False, False), (37, 12, 3, "softmax", False, True, False),
        (1000, 64, 8, "softmax", True, False, True), (300, 6, 6, "sigmoid", True, False, False),
        (513, 256, 8, "sigmoid", True, True, True), (64, 16, 1, "softmax", False, False, False),
    ]
    for T, E, K, score, norm, bias, poison in cases:
        cfg = MoEConfig(dim=64, moe_inter_dim=32, num_experts=E, top_k=K, score_func=score, route_norm=norm,
                        load_balance_bias=bias, aux_loss_coef=0.01, z_loss_coef=1e-3, dtype="bfloat16")
        torch.manual_seed(T + E)
        r = Router(cfg).cuda()
        x = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16)
        if poison and T > 2:
            x[1, 0], x[2, 3] = float("nan"), float("inf")
        res = []
        for on in (True, False):
            r.kernel = on
            xx = x.clone().requires_grad_(True)
            out = r(xx)
            fin = torch.isfinite(out.gate_TK).all(-1)
            ((out.gate_TK[fin]).sum() + out.stats.aux_loss + out.stats.z_loss).backward()
            res.append((out.idx_TK, out.stats.aux_loss.detach(), out.stats.z_loss.detach(), fin))
        (i1, a1, z1, f1), (i0, a0, z0, f0) = res
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(a1)) and bool(torch.isfinite(z1))
        ok = ok and bool(((i1 >= 0) & (i1 < E)).all())
        ok = ok and abs(float(z1) - float(z0)) <= 1e-4 * max(1e-6, abs(float(z0)))
        print(f"T={T} E={E} K={K} {score} norm={norm} bias={bias} poison={poison}: {'ok' if ok else 'MISMATCH'}",
              flush=True)
        if not ok:
            return 1
    print("memcheck router cases: all ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
