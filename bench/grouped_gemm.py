"""Grouped-GEMM benchmark: TFLOP/s of tlx, triton, torch._grouped_mm and dense cuBLAS (equal FLOPs).

Forms: forward y = x @ w[e], dX = dy @ w[e]^T (K-contiguous weight view), dW[e] = x[e]^T @ dy[e].
Routing: balanced (equal rows per expert) and Zipf-imbalanced (s=1.2, shuffled experts).
Shapes: T=16384 tokens, N = T*K rows. Every operand is > 60 MB (the H200's L2 is 60 MB), so the
same buffers are reused between repeats without measuring the cache. Medians of
triton.testing.do_bench; ratios vs torch._grouped_mm are taken in the same process.
Also checks each provider against torch._grouped_mm on the benchmarked operands (max rel error).

    python bench/grouped_gemm.py [--json out.json] [--shapes olmoe,qwen3] [--providers tlx,triton,torch,cublas]
    python bench/grouped_gemm.py --precision fp8 [--fp8-configs 128x128,256x64] [--routings balanced]
                                 (bench/grouped_gemm_fp8.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import _results  # bench/_results.py (the script's directory is on sys.path)

SHAPES = {  # name: (D, F, E, K)
    "olmoe": (2048, 1024, 64, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "mixtral": (4096, 14336, 8, 2),
    "deepseek-v3-rank": (7168, 2048, 32, 8),
}
T = 16384


def counts_for(N: int, E: int, routing: str, seed: int = 0) -> list[int]:
    if routing == "balanced":
        c = [N // E] * E
        c[0] += N - sum(c)
        return c
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p = p[torch.randperm(E, generator=g)]
    c = torch.floor(p / p.sum() * N).long()
    c[int(p.argmax())] += N - int(c.sum())
    return c.tolist()


def main() -> int:
    import triton

    from tlx_dist.grouped_gemm.backends import available_backends, get_backend

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench_grouped_gemm.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--providers", default="tlx,triton,torch,cublas")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--fp8-configs", default="128x128,256x64",
                    help="FP8 tile configs (bench/grouped_gemm_fp8.py CONFIG_NAMES; the first is the default)")
    ap.add_argument("--routings", default="balanced,zipf", help="fp8: expert loads to time (balanced, zipf)")
    _results.add_args(ap)
    args = ap.parse_args()
    rec = _results.Recorder("grouped_gemm", args)
    if args.precision == "fp8":
        import os

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from grouped_gemm_fp8 import run

        rows, summary = run(args, SHAPES, T, counts_for)
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "T": T, "precision": "fp8", "rows": rows, "summary": summary}, fh, indent=1)
        return 0
    providers = [p for p in args.providers.split(",") if p in ("torch", "cublas") or p in available_backends()]
    dev = "cuda"
    rows = []
    for name in args.shapes.split(","):
        D, F, E, K = SHAPES[name]
        N = T * K
        torch.manual_seed(0)
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) / D**0.5
        dy = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
        wt = w.transpose(1, 2)
        for routing in ("balanced", "zipf"):
            off = torch.tensor(counts_for(N, E, routing), device=dev).cumsum(0).to(torch.int32)
            flops = 2.0 * N * D * F
            fns = {}
            for p in providers:
                if p == "torch":
                    fns[p] = {"fwd": lambda: torch._grouped_mm(x, w, off),
                              "dX": lambda: torch._grouped_mm(dy, wt, off),
                              "dW": lambda: torch._grouped_mm(x.t(), dy, off)}
                elif p == "cublas":  # dense GEMMs with the same FLOPs
                    w0 = w[0]
                    fns[p] = {"fwd": lambda w0=w0: x @ w0, "dX": lambda w0=w0: dy @ w0.t(),
                              "dW": lambda: x[: N].t() @ dy}
                else:
                    b = get_backend(p)
                    fns[p] = {"fwd": lambda b=b: b.mm(x, w, off), "dX": lambda b=b: b.mm(dy, wt, off),
                              "dW": lambda b=b: b.wgrad(x, dy, off)}
            for form in ("fwd", "dX", "dW"):
                ref = fns["torch"][form]().float() if "torch" in fns else None
                row = {"shape": name, "routing": routing, "form": form, "N": N, "D": D, "F": F, "E": E}
                for p in fns:
                    f = fns[p][form]
                    t0 = time.time()
                    out = f()
                    if ref is not None and p not in ("cublas", "torch"):
                        row[f"{p}_relerr"] = ((out.float() - ref).norm() / ref.norm()).item()
                    del out
                    ms = triton.testing.do_bench(f, warmup=25, rep=args.rep, return_mode="median")
                    row[p] = flops / ms * 1e-9
                    row[f"{p}_first_s"] = time.time() - t0
                if "torch" in row:
                    for p in fns:
                        row[f"{p}_vs_torch"] = row[p] / row["torch"]
                rows.append(row)
                cells = "  ".join(f"{p}={row[p]:6.1f}" for p in fns)
                errs = "  ".join(f"{p}_err={row[p + '_relerr']:.1e}" for p in fns if p + "_relerr" in row)
                print(f"{name:18s} {routing:8s} {form:3s}  {cells}  {errs}", flush=True)
        del x, w, dy, wt
        torch.cuda.empty_cache()

    # Table + summary.
    hdr = f"| shape | routing | form | " + " | ".join(f"{p} TFLOP/s" for p in providers) + " | " + \
        " | ".join(f"{p}/torch" for p in providers if p != "torch") + " |"
    print("\n" + hdr)
    print("|" + "---|" * (3 + len(providers) + len(providers) - 1))
    for r in rows:
        print(f"| {r['shape']} | {r['routing']} | {r['form']} | " + " | ".join(f"{r[p]:.1f}" for p in providers)
              + " | " + " | ".join(f"{r.get(p + '_vs_torch', float('nan')):.3f}" for p in providers if p != "torch")
              + " |")
    summary = {}
    for p in providers:
        if p == "torch":
            continue
        for form in ("fwd", "dX", "dW"):
            for routing in ("balanced", "zipf"):
                v = [r[f"{p}_vs_torch"] for r in rows if r["form"] == form and r["routing"] == routing
                     and f"{p}_vs_torch" in r]
                if v:
                    summary[f"{p} {form} {routing} median vs torch"] = statistics.median(v)
            bal = {r["shape"]: r[p] for r in rows if r["form"] == form and r["routing"] == "balanced"}
            imb = [r[p] / bal[r["shape"]] for r in rows if r["form"] == form and r["routing"] == "zipf"
                   and r["shape"] in bal]
            if imb:
                summary[f"{p} {form} zipf/balanced median"] = statistics.median(imb)
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    dev_name = torch.cuda.get_device_name()
    with open(args.json, "w") as fh:
        json.dump({"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "T": T,
                   "rows": rows, "summary": summary}, fh, indent=1)
    for r in rows:  # TFLOP/s of do_bench's median time: no spread kept
        shape = {k: r[k] for k in ("shape", "routing", "N", "D", "F", "E")}
        for p in providers:
            rec.row(r["form"], p, shape, r[p], unit="TFLOP/s", vs_torch=r.get(f"{p}_vs_torch"),
                    rel_err=r.get(f"{p}_relerr"), first_call_s=r.get(f"{p}_first_s"))
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
