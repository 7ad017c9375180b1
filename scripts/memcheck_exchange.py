"""Runs every symmetric-exchange kernel once per case, for compute-sanitizer's memcheck (tier T3).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python scripts/memcheck_exchange.py

Emulated worlds on one GPU (every virtual rank's symmetric region is a slice of one allocation, so
memcheck sees accesses outside the world's memory and outside every local operand): W = 1, 2, 4 with
random routing, all slots to one rank, zero-token experts, a rank with no tokens, odd D, and an
expanded-row capacity that overflows, E = 256 over many route blocks; dispatch, combine and both
gradient ops, the fused EP row form (dispatch_rows, combine_rows and their gradients) and its
overlapped form (split send, region counters, the arrival wait, partial rows sent early). Dispatch
rows are checked against the oracle exactly. Ends with "memcheck exchange cases: all ok".
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import torch

    from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch

    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1" and "--allow-caching" not in sys.argv:
        print("set PYTORCH_NO_CUDA_MEMORY_CACHING=1 (or pass --allow-caching): cached blocks hide stray accesses")
        return 2
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def idx_for(kind, T, K, E, W):
        if kind == "one_rank":      # every slot to rank 0's experts
            return torch.rand(T, E // W, device=dev, generator=g).topk(K, dim=1).indices
        if kind == "zero_experts":  # even experts only
            return torch.rand(T, E // 2, device=dev, generator=g).topk(K, dim=1).indices * 2
        return torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices

    cases = [(1, 8, 2, 256, [37], "random", "worst"), (2, 8, 4, 256, [33, 0], "random", "worst"),
             (2, 8, 2, 130, [20, 17], "one_rank", "worst"), (4, 16, 4, 256, [9, 31, 1, 16], "zero_experts", "worst"),
             (4, 16, 4, 256, [32, 32, 32, 32], "one_rank", 40),   # 40 rows: rank 0 overflows
             (2, 256, 8, 128, [600, 257], "random", "worst")]     # 75 / 33 route blocks: the look-back
    for W, E, K, D, Ts, kind, cap in cases:
        world = EmulatedWorld(W, max(max(Ts), 1), D, K, E, torch.bfloat16, capacity=cap, device=dev, timeout_s=5)
        xs = [torch.randn(T, D, device=dev, generator=g).bfloat16() for T in Ts]
        idxs = [idx_for(kind, T, K, E, W) for T in Ts]
        gates = [torch.rand(T, K, device=dev, generator=g) for T in Ts]
        res = world.dispatch(xs, idxs, gates)
        ref = reference_dispatch(xs, idxs, E)
        for d, (x_exp, h) in enumerate(res):
            n = min(ref[d][0].shape[0], x_exp.shape[0])
            assert torch.equal(x_exp[:n], ref[d][0][:n]), (W, kind, d)
        ys = [x_exp * 2 for x_exp, _ in res]
        world.combine(ys, [h for _, h in res])
        back = world.dispatch_grad([torch.randn_like(x) for x in xs], ys, [h for _, h in res])
        world.combine_grad([gy for gy, _ in back], [h for _, h in res])
        # the fused EP pipeline's row form: index pass, partial rows home, and both gradients
        rows = world.dispatch_rows(xs, idxs, gates)
        parts = [recv * 2 for recv, *_ in rows]
        world.combine_rows(parts, [h for *_, h in rows])
        g_parts = world.combine_rows_grad([torch.randn_like(x) for x in xs], [h for *_, h in rows])
        world.dispatch_rows_grad(g_parts, [torch.rand_like(gate_N) for _, _, gate_N, _ in rows], [h for *_, h in rows])
        torch.cuda.synchronize()
        overflowed = []
        for b in world.buffers:
            try:
                b.check()
            except RuntimeError as err:
                overflowed.append(str(err))
        assert bool(overflowed) == (cap != "worst"), (W, kind, cap, overflowed)
        world.close()
        if W > 1 and cap == "worst":  # the overlapped row form: split send, region counters, wait, early partials
            world = EmulatedWorld(W, max(max(Ts), 1), D, K, E, torch.bfloat16, capacity=cap, device=dev, timeout_s=5,
                                  row_regions=1)
            rows = world.dispatch_rows(xs, idxs, gates, region=0, overlap=True)
            parts = [recv * 2 for recv, *_ in rows]
            for p_, (*_, h) in zip(parts, rows):
                h.overlap.wait()
                h.overlap.send_partials(p_)
            world.combine_rows(parts, [h for *_, h in rows])
            torch.cuda.synchronize()
            for b in world.buffers:
                b.check()
                assert int(b.region_counters().abs().sum()) == 0, (W, kind)
            world.close()
        print(f"case W={W} E={E} K={K} D={D} T={Ts} {kind} capacity={cap}: ok", flush=True)
    print("memcheck exchange cases: all ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
