"""FP8 rows of the grouped-GEMM benchmark (``bench/grouped_gemm.py --precision fp8``).

Per shape, routing and form (fwd y = x @ w[e], dX = dy @ w[e]^T, dW[e] = x[e]^T @ dy[e]), in one
process, medians of triton.testing.do_bench, TFLOP/s at 2 * N * D * F:
  tlx_fp8      the TLX FP8 grouped GEMM on pre-quantized operands (weights quantized once per
               optimizer step; activations as a fused producer would deliver them), one column per
               ``--fp8-configs`` config (tlx_dist/fp8/tlx_gemm.py CANDIDATES; the first is the host's
               default), each with the default tile walk for its form and width;
  tlx_fp8+q    the same plus the activation quantization the unfused op runs (fwd / dX: the rows
               of x / dy; dW: the column tiles of x and dy);
  scaled_mm    dense ``torch._scaled_mm`` on the shape of equal FLOPs (tensorwise scales, bf16 out,
               cuBLAS's default accumulation): the ceiling of the issue's target;
  scaled_mm_fast  the same with ``use_fast_accum=True`` (no promotion in cuBLAS);
  bf16_tlx     the bf16 TLX grouped GEMM on the same shape; bf16_torch: torch._grouped_mm.
Ratios tlx_fp8 / scaled_mm and tlx_fp8 / bf16_tlx are taken in the same process. ``fp8_relerr``:
``|tlx_fp8 - torch_fp8| / |torch_fp8|`` with torch's FP8 path on the same quantized operands
(tlx_dist/fp8/reference.py ``*_torch``), a sanity check on the benchmarked operands.
"""

from __future__ import annotations

import statistics

import torch

# name: (BN, SUBN, STAGES), tlx_dist/fp8/tlx_gemm.py CANDIDATES
CONFIG_NAMES = {"128x128": (128, 128, 5), "256x64": (256, 64, 3)}


def _configs(spec: str):
    from tlx_dist.fp8.tlx_gemm import Fp8GemmConfig

    out = []
    for name in spec.split(","):
        if name not in CONFIG_NAMES:
            raise SystemExit(f"--fp8-configs: {name!r} is not one of {sorted(CONFIG_NAMES)}")
        BN, SUBN, STAGES = CONFIG_NAMES[name]
        out.append((name, Fp8GemmConfig(BN, SUBN, STAGES)))
    return out


def run(args, shapes: dict, T: int, counts_for) -> tuple[list, dict]:
    import triton

    from tlx_dist import fp8
    from tlx_dist.fp8.tlx_gemm import default_config, mm_fp8_tlx, wgrad_fp8_tlx, with_default_raster
    from tlx_dist.grouped_gemm.backends import available_backends, get_backend

    dev = "cuda"
    cfgs = _configs(args.fp8_configs)
    one = torch.ones((), device=dev)
    rows = []
    for name in args.shapes.split(","):
        D, F, E, K = shapes[name]
        N = T * K
        torch.manual_seed(0)
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) / D ** 0.5
        dy = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
        wq = fp8.quantize_weight(w)
        xr, dyr = fp8.quantize_rows(x), fp8.quantize_rows(dy)
        # dense FP8 operands of equal FLOPs: [N, D] x [D, F] and its dX / dW counterparts
        xd, dyd = x.to(torch.float8_e4m3fn), dy.to(torch.float8_e4m3fn)
        w0 = w[0].to(torch.float8_e4m3fn)  # [D, F]
        dense = {"fwd": (xd, w0.t().contiguous().t()), "dX": (dyd, w0.contiguous().t()),
                 "dW": (xd.t().contiguous(), dyd.t().contiguous().t())}
        for routing in args.routings.split(","):
            off = torch.tensor(counts_for(N, E, routing), device=dev).cumsum(0).to(torch.int32)
            xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
            flops = 2.0 * N * D * F
            for form in ("fwd", "dX", "dW"):
                row = {"shape": name, "routing": routing, "form": form, "N": N, "D": D, "F": F, "E": E,
                       "precision": "fp8"}
                fns = {}
                for cname, cfg in cfgs:
                    cfg = with_default_raster(cfg, "dW" if form == "dW" else "mm", D if form == "dX" else F)
                    if form == "fwd":
                        fns[f"tlx_fp8[{cname}]"] = lambda cfg=cfg: mm_fp8_tlx(xr.q_MC, xr.s_MCb, wq.q_EFD, wq.s_EFbDb,
                                                                             off, cfg=cfg)
                    elif form == "dX":
                        fns[f"tlx_fp8[{cname}]"] = lambda cfg=cfg: mm_fp8_tlx(dyr.q_MC, dyr.s_MCb, wq.q_EDF,
                                                                             wq.s_EDbFb, off, cfg=cfg)
                    else:
                        fns[f"tlx_fp8[{cname}]"] = lambda cfg=cfg: wgrad_fp8_tlx(xc, dyc, cfg=cfg)
                if form == "fwd":
                    fns["tlx_fp8+q"] = lambda: fp8.mm_fp8(fp8.quantize_rows(x), wq.q_EFD, wq.s_EFbDb, off, backend="tlx")
                elif form == "dX":
                    fns["tlx_fp8+q"] = lambda: fp8.mm_fp8(fp8.quantize_rows(dy), wq.q_EDF, wq.s_EDbFb, off,
                                                          backend="tlx")
                else:
                    fns["tlx_fp8+q"] = lambda: fp8.wgrad_fp8(fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off),
                                                             backend="tlx")
                a, b = dense[form]
                fns["scaled_mm"] = lambda a=a, b=b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
                fns["scaled_mm_fast"] = lambda a=a, b=b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16,
                                                                          use_fast_accum=True)
                if "tlx" in available_backends():
                    bt = get_backend("tlx")
                    fns["bf16_tlx"] = {"fwd": lambda: bt.mm(x, w, off), "dX": lambda: bt.mm(dy, w.transpose(1, 2), off),
                                       "dW": lambda: bt.wgrad(x, dy, off)}[form]
                fns["bf16_torch"] = {"fwd": lambda: torch._grouped_mm(x, w, off),
                                     "dX": lambda: torch._grouped_mm(dy, w.transpose(1, 2), off),
                                     "dW": lambda: torch._grouped_mm(x.t(), dy, off)}[form]
                first = f"tlx_fp8[{cfgs[0][0]}]"
                ref = {"fwd": lambda: fp8.mm_fp8_torch(xr, wq.q_EFD, wq.s_EFbDb, off),
                       "dX": lambda: fp8.mm_fp8_torch(dyr, wq.q_EDF, wq.s_EDbFb, off),
                       "dW": lambda: fp8.wgrad_fp8_torch(xc, dyc)}[form]().float()
                for cname, _ in cfgs:  # every config against torch's FP8 path (a sanity check)
                    ours = fns[f"tlx_fp8[{cname}]"]()
                    row[f"fp8_relerr[{cname}]"] = ((ours.float() - ref).norm() / ref.norm()).item()
                    del ours
                row["fp8_relerr"] = max(row[f"fp8_relerr[{c}]"] for c, _ in cfgs)
                del ref
                for p, f in fns.items():
                    ms = triton.testing.do_bench(f, warmup=25, rep=args.rep, return_mode="median")
                    row[p] = flops / ms * 1e-9
                row["tlx_fp8"] = row[first]
                row["default_config"] = str(default_config("dW" if form == "dW" else "mm", D if form == "dX" else F))
                row["fp8_vs_scaled_mm"] = row["tlx_fp8"] / row["scaled_mm"]
                if "bf16_tlx" in row:
                    row["fp8_vs_bf16_tlx"] = row["tlx_fp8"] / row["bf16_tlx"]
                rows.append(row)
                cells = "  ".join(f"{p}={row[p]:6.1f}" for p in fns)
                print(f"{name:18s} {routing:8s} {form:3s}  {cells}  fp8/scaled_mm={row['fp8_vs_scaled_mm']:.3f}  "
                      f"relerr={row['fp8_relerr']:.1e}", flush=True)
            del xc, dyc
        del x, w, dy, wq, xr, dyr, xd, dyd, w0, dense
        torch.cuda.empty_cache()

    providers = [p for p in rows[0] if p.startswith(("tlx_fp8[", "tlx_fp8+q", "scaled_mm", "bf16_"))] if rows else []
    print("\n| shape | routing | form | " + " | ".join(f"{p} TFLOP/s" for p in providers) + " | fp8/scaled_mm |")
    print("|" + "---|" * (4 + len(providers)))
    for r in rows:
        print(f"| {r['shape']} | {r['routing']} | {r['form']} | " + " | ".join(f"{r.get(p, float('nan')):.1f}"
                                                                            for p in providers)
              + f" | {r['fp8_vs_scaled_mm']:.3f} |")
    summary = {}
    for form in ("fwd", "dX", "dW"):
        for key in ("fp8_vs_scaled_mm", "fp8_vs_bf16_tlx"):
            v = [r[key] for r in rows if r["form"] == form and key in r]
            if v:
                summary[f"{form} {key} median"] = statistics.median(v)
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    return rows, summary
