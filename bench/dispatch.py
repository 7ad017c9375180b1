"""Dispatch/combine benchmark: symmetric-memory kernels vs NCCL all_to_all_single (torchtitan-style).

Anchor ("nccl"): AllToAllDispatcher on a one-rank NCCL group -- the torchtitan path: all-gather of
the counts, host-side split sizes (one .cpu() sync), all_to_all_single, expert-major index_select.
"symm": SymmDispatcher on torch symmetric memory (CUDA backend, same one-rank group), copying the
receive buffers out (what training uses). "symm_view": copy_out=False (views of the symmetric
buffers; inference / a fused consumer). "emu<W>": an emulated world of W virtual ranks on this one
GPU with T/W tokens each (the same total rows as W=1): every rank's kernels run one after another,
and "peer" stores are local HBM stores -- so it measures the kernels' efficiency and the per-rank
launch/signal overhead at W, not NVLink. Latency = whole op (all W ranks); bandwidth = payload rows
(T*K rows of D) per second.

HBM traffic: symm dispatch reads T*K token rows and writes them to the receive buffer, then the
copy-out reads and writes them again (4 row-passes; 2 with copy_out=False); combine likewise.
``hbm_frac`` = that traffic / time over the measured copy bandwidth (``torch.Tensor.copy_``,
read+write) of this GPU in the same run.

    python bench/dispatch.py [--json bench_dispatch.json] [--tokens 128,4096,16384] [--dims 2048,7168]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

E, K = 256, 8


def _routing(T, g):
    return torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices


def main() -> int:
    import torch.distributed as dist
    from triton.testing import do_bench

    from tlx_dist.comm import AllToAllDispatcher, SymmBuffers, SymmDispatcher
    from tlx_dist.comm.emulated import EmulatedWorld

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench_dispatch.json")
    ap.add_argument("--tokens", default="128,4096,16384")
    ap.add_argument("--dims", default="2048,7168")
    ap.add_argument("--emulated", default="8", help="comma-separated W of emulated worlds ('' for none)")
    ap.add_argument("--rep", type=int, default=40, help="ms per do_bench measurement")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    dev_name = torch.cuda.get_device_name()

    # HBM copy ceiling (read + write), 2 GiB buffers.
    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t_copy = do_bench(lambda: b.copy_(a), rep=200, return_mode="median") * 1e-3
    copy_bw = 2 * a.numel() * 2 / t_copy
    del a, b
    print(f"{dev_name}: HBM copy {copy_bw / 1e12:.2f} TB/s (read+write)")

    emus = [int(w) for w in args.emulated.split(",") if w]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for D in (int(d) for d in args.dims.split(",")):
        for T in (int(t) for t in args.tokens.split(",")):
            rb = D * 2
            payload = T * K * rb
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
            idx = _routing(T, g)
            res = {}
            with torch.no_grad():
                a2a = AllToAllDispatcher(E, group, validate=False)
                recv, h = a2a.dispatch(x, idx)
                res["nccl"] = (lambda: a2a.dispatch(x, idx), lambda: a2a.combine(recv, h), 6)
                bufs = SymmBuffers(T, D, K, E, torch.bfloat16, group)
                for name, copy in (("symm", True), ("symm_view", False)):
                    sd = SymmDispatcher(E, group, buffers=bufs, copy_out=copy, validate=False)
                    r_s, h_s = sd.dispatch(x, idx)
                    r_ref, _ = a2a.dispatch(x, idx)
                    n = r_ref.shape[0]
                    assert torch.equal(r_s[:n].clone() if not copy else r_s[:n], r_ref), f"{name} dispatch mismatch"
                    y_s = sd.combine(r_s.clone(), h_s)
                    assert torch.equal(y_s, x[:, None, :].expand(T, K, D)), f"{name} combine mismatch"
                    res[name] = ((lambda sd=sd: sd.dispatch(x, idx)), (lambda sd=sd, r=r_s.clone(), hh=h_s: sd.combine(r, hh)),
                                 4 if copy else 2)
                worlds = []
                for W in emus:
                    if T % W or T // W < 1:
                        continue
                    Tr = T // W
                    world = EmulatedWorld(W, Tr, D, K, E, torch.bfloat16, capacity=2 * Tr * K, device="cuda")
                    xs = list(x.view(W, Tr, D).unbind(0))
                    idxs = list(idx.view(W, Tr, K).unbind(0))
                    out = world.dispatch(xs, idxs)
                    ys = [r.clone() for r, _ in out]
                    hs = [hh for _, hh in out]
                    world.check()
                    res[f"emu{W}"] = ((lambda w=world, xs=xs, idxs=idxs: w.dispatch(xs, idxs)),
                                      (lambda w=world, ys=ys, hs=hs: w.combine(ys, hs)), 4)
                    worlds.append(world)
                for name, (fd, fc, passes) in res.items():
                    td = statistics.median(do_bench(fd, rep=args.rep, return_mode="all")) * 1e-3
                    tc = statistics.median(do_bench(fc, rep=args.rep, return_mode="all")) * 1e-3
                    row = dict(provider=name, T=T, D=D, K=K, E=E, dispatch_us=td * 1e6, combine_us=tc * 1e6,
                               dispatch_GBps=payload / td / 1e9, combine_GBps=payload / tc / 1e9,
                               hbm_frac=(passes * payload * 2) / (td + tc) / copy_bw if name != "nccl" else None)
                    rows.append(row)
                bufs.close()
                for w in worlds:
                    w.close()
                torch.cuda.empty_cache()

    base = {(r["T"], r["D"]): r for r in rows if r["provider"] == "nccl"}
    print(f"\n{'provider':10} {'T':>6} {'D':>5} {'disp us':>9} {'comb us':>9} {'disp GB/s':>10} {'comb GB/s':>10} "
          f"{'x nccl':>7} {'hbm%':>5}")
    for r in rows:
        ref = base[(r["T"], r["D"])]
        ratio = (ref["dispatch_us"] + ref["combine_us"]) / (r["dispatch_us"] + r["combine_us"])
        r["speedup_vs_nccl"] = ratio
        hbm = f"{100 * r['hbm_frac']:5.0f}" if r["hbm_frac"] is not None else "    -"
        print(f"{r['provider']:10} {r['T']:6d} {r['D']:5d} {r['dispatch_us']:9.1f} {r['combine_us']:9.1f} "
              f"{r['dispatch_GBps']:10.1f} {r['combine_GBps']:10.1f} {ratio:7.2f} {hbm}")
    with open(args.json, "w") as f:
        json.dump(dict(device=dev_name, copy_TBps=copy_bw / 1e12, rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
