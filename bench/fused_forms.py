"""Each fused expert kernel form against the plain grouped GEMM of the same FLOPs (one GPU).

Where the fused layer loses time, kernel by kernel: the six launches of one fused fwd+bwd
(tlx_dist/fused/backends.py ``compose_forward`` / ``compose_backward``), each timed alone and beside
the landed TLX grouped GEMM (``grouped_mm`` / ``grouped_mm_wgrad``, backend "tlx") on operands that
are already gathered -- the same FLOPs without the gather, the epilogue or the atomics:

    form        fused kernel                                  anchor (pre-gathered operands)
    swiglu      h, a = SwiGLU(x[src] @ w13)                   x_perm @ w13
    swiglu_copy   the same from x_perm = x[src] read in place     x_perm @ w13
                  (x_rows "copy"; the index_select timed with it)
    scatter     out[dst] += gate * (a @ w2)   (fp32 atomics)  a @ w2
    dswiglu     dh, ag, dgate from dout[dst] @ w2^T           dout_perm @ w2^T
    dswiglu_copy  the same, dout_perm read in place             dout_perm @ w2^T
    scatter_dx  dx[src] += dh @ w13^T         (fp32 atomics)  dh @ w13^T
    wgrad_a     dW13 = x[src]^T @ dh          (gathered A)    x_perm^T @ dh
    wgrad_a_copy  the same from x_perm = x[src] (index_select timed) x_perm^T @ dh
    wgrad_b     dW2 = ag^T @ dout[dst]        (gathered B)    ag^T @ dout_perm

The fused times include what each launch allocates and fills (the scatter forms' fp32 zeros, the
dSwiGLU partials' sum); the anchors allocate only their output. Routing: softmax top-K of random
logits (seeded). Medians of triton.testing.do_bench (ms);
TFLOP/s = 2 * rows * in * out / time; "x anchor" = anchor time / fused time (> 1: fused faster).

    python bench/fused_forms.py [--shapes olmoe,qwen3-30b-a3b] [--tokens 16384] [--json out.json]

``--rounds R`` times each form's variants R times, interleaved, and reports each variant's median
(the GPU's clock drifts by up to ~10% between back-to-back timings). ``--variant NAME=JSON`` (repeatable)
times the fused kernels under each config (JSON: a ``FusedConfig.from_dict`` mapping, e.g.
``lag1={"swiglu": {"LAG": 1}}``: tile fields replacing those of the form's base default; ``{}`` is
the defaults) in one process, and checks each variant's outputs against the first variant's: the
largest difference relative to the output's largest value (0 where a variant changes only how the
same values are stored; the scatter forms' fp32 atomics add in a different order each run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from tlx_dist.fused import expert_major_slots

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from moe_layer import SHAPES  # noqa: E402  name: (D, F, E, K), one table for the benches


def routing(T: int, E: int, K: int, device, seed: int = 0):
    """(src_N == dst_N token of each expert-major row, gate_N, offsets_E int32), as fused_experts."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(T, E, generator=g).to(device)
    gate_TK, idx_TK = torch.softmax(logits, -1).topk(K, -1)
    tok_N, order_S, offsets_E = expert_major_slots(idx_TK, E)
    return tok_N, gate_TK.reshape(-1)[order_S].contiguous(), offsets_E


def forms(prims, T, D, F, E, K, device, dtype=torch.bfloat16):
    """{form: (fused callable taking a FusedConfig, anchor callable, rows, in_dim, out_dim)}; ``prims``:
    the TLX primitives class of this GPU (instantiated with each variant's config)."""
    from tlx_dist.grouped_gemm.api import grouped_mm, grouped_mm_wgrad

    tok_N, gate_N, offsets_E = routing(T, E, K, device)
    N = tok_N.shape[0]
    s = 0.05
    x = torch.randn(T, D, device=device, dtype=dtype)
    dout = torch.randn(T, D, device=device, dtype=dtype)
    w13 = torch.randn(E, D, 2 * F, device=device, dtype=dtype) * s
    w2 = torch.randn(E, F, D, device=device, dtype=dtype) * s
    p = prims()
    tile_cum = p.tile_cum(offsets_E, N, x)
    order = p.wgrad_order(offsets_E)
    h, a = p.gate_up_swiglu(x, tok_N, w13, offsets_E, tile_cum)
    dh, ag, _ = p.down_dswiglu(dout, tok_N, w2, offsets_E, h, gate_N, tile_cum)
    x_perm, dout_perm = x[tok_N.long()], dout[tok_N.long()]
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    tlx = dict(backend="tlx")
    return {
        "swiglu": (lambda c: prims(c).gate_up_swiglu(x, tok_N, w13, offsets_E, tile_cum),
                   lambda: grouped_mm(x_perm, w13, offsets_E, **tlx), N, D, 2 * F),
        # x_rows "copy": one index_select of x's rows, then A by TMA (the copy timed with it)
        "swiglu_copy": (lambda c: prims(c).gate_up_swiglu(x.index_select(0, tok_N), None, w13, offsets_E, tile_cum),
                        lambda: grouped_mm(x_perm, w13, offsets_E, **tlx), N, D, 2 * F),
        "scatter": (lambda c: prims(c).down_scatter(a, w2, offsets_E, tok_N, gate_N, T, tile_cum),
                    lambda: grouped_mm(a, w2, offsets_E, **tlx), N, F, D),
        "dswiglu": (lambda c: prims(c).down_dswiglu(dout, tok_N, w2, offsets_E, h, gate_N, tile_cum),
                    lambda: grouped_mm(dout_perm, w2_t, offsets_E, **tlx), N, D, F),
        # the same from the expert-major copy of dout (dout_rows "copy"; the copy not timed)
        "dswiglu_copy": (lambda c: prims(c).down_dswiglu(dout_perm, None, w2, offsets_E, h, gate_N, tile_cum),
                         lambda: grouped_mm(dout_perm, w2_t, offsets_E, **tlx), N, D, F),
        "scatter_dx": (lambda c: prims(c).down_scatter(dh, w13_t, offsets_E, tok_N, None, T, tile_cum),
                       lambda: grouped_mm(dh, w13_t, offsets_E, **tlx), N, 2 * F, D),
        "wgrad_a": (lambda c: prims(c).wgrad_gather(x, tok_N, dh, None, offsets_E, order),
                    lambda: grouped_mm_wgrad(x_perm, dh, offsets_E, **tlx), N, D, 2 * F),
        "wgrad_a_copy": (lambda c: prims(c).wgrad_gather(x.index_select(0, tok_N), None, dh, None, offsets_E, order),
                         lambda: grouped_mm_wgrad(x_perm, dh, offsets_E, **tlx), N, D, 2 * F),
        "wgrad_b": (lambda c: prims(c).wgrad_gather(ag, None, dout, tok_N, offsets_E, order),
                    lambda: grouped_mm_wgrad(ag, dout_perm, offsets_E, **tlx), N, F, D),
    }


def check_wgrad(p, T, D, F, E, K, device) -> float:
    """Max relative error of both gathered dW forms against the anchor on the same operands."""
    from tlx_dist.grouped_gemm.api import grouped_mm_wgrad

    p = p()
    tok_N, _, offsets_E = routing(T, E, K, device, seed=1)
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    dy = torch.randn(tok_N.shape[0], 2 * F, device=device, dtype=torch.bfloat16)
    order = p.wgrad_order(offsets_E)
    worst = 0.0
    for got, want in (
        (p.wgrad_gather(x, tok_N, dy, None, offsets_E, order), grouped_mm_wgrad(x[tok_N.long()], dy, offsets_E)),
        (p.wgrad_gather(dy, None, x, tok_N, offsets_E, order), grouped_mm_wgrad(dy, x[tok_N.long()], offsets_E)),
    ):
        err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)
        worst = max(worst, float(err))
    return worst


def _config(spec: str, arch: str):
    """The FusedConfig of one ``--variant`` (JSON of a ``FusedConfig.from_dict`` mapping)."""
    from tlx_dist.fused import FusedConfig

    return FusedConfig.from_dict(json.loads(spec or "{}"), arch=arch)


def _outputs(res) -> list:
    """The tensors a form's launcher returns, as a flat list."""
    res = res if isinstance(res, (tuple, list)) else (res,)
    return [t.detach().clone() for t in res if isinstance(t, torch.Tensor)]


def main() -> int:
    import triton

    from tlx_dist.fused.tlx_backend import _tlx_prims

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="olmoe,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--forms", default="swiglu,scatter,dswiglu,scatter_dx,wgrad_a,wgrad_b")
    ap.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the variants of a form this many times, interleaved; report each one's median")
    ap.add_argument("--json", default="")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: time the fused kernels under FusedConfig.from_dict(JSON) (repeatable)")
    _results.add_args(ap)
    args = ap.parse_args()
    rec = _results.Recorder("fused_forms", args)
    variants = [v.partition("=")[::2] for v in args.variant] or [("", "")]
    if not torch.cuda.is_available():
        print("bench/fused_forms.py needs a CUDA GPU with TLX (Hopper)", file=sys.stderr)
        return 2
    p = _tlx_prims()  # the launchers of this GPU generation's TLX fused kernels
    configs = {vname: _config(spec, p.ARCH) for vname, spec in variants}
    rows = []
    vcol = "variant | " if args.variant else ""
    print(f"| shape | T | form | {vcol}fused ms | fused TFLOP/s | anchor ms | anchor TFLOP/s | x anchor |"
          + (" rel diff |" if args.variant else ""))
    print("|---" * (8 + 2 * bool(args.variant)) + "|")
    for name in args.shapes.split(","):
        D, F, E, K = SHAPES[name]
        for T in (int(t) for t in args.tokens.split(",")):
            fs = forms(p, T, D, F, E, K, "cuda")
            for form in args.forms.split(","):
                fused, anchor, n, k_in, k_out = fs[form]
                fl = 2.0 * n * k_in * k_out
                ta_rounds = []
                first, outs, times = None, {}, {v: [] for v, _ in variants}
                for vname, spec in variants:  # outputs first, each against the first variant's
                    out = _outputs(fused(configs[vname]))
                    first = out if first is None else first
                    outs[vname] = max(float((a.float() - b.float()).abs().max()
                                            / b.float().abs().max().clamp_min(1e-30)) for a, b in zip(out, first))
                    del out
                for _ in range(max(1, args.rounds)):  # interleaved rounds: the GPU's drift hits every variant
                    ta_rounds.append(triton.testing.do_bench(anchor, rep=args.rep, return_mode="median"))
                    for vname, spec in variants:
                        c = configs[vname]
                        times[vname].append(triton.testing.do_bench(lambda: fused(c), rep=args.rep,
                                                                    return_mode="median"))
                ta = statistics.median(ta_rounds)
                for vname, spec in variants:
                    diff = outs[vname]
                    tf = statistics.median(times[vname])
                    r = dict(shape=name, T=T, form=form, variant=vname, spec=spec, fused_ms=tf, anchor_ms=ta,
                             fused_tflops=fl / tf / 1e9, anchor_tflops=fl / ta / 1e9, ratio=ta / tf, rel_diff=diff,
                             rounds_ms=times[vname])
                    rows.append(r)
                    vcell = f"{vname} | " if args.variant else ""
                    print(f"| {name} | {T} | {form} | {vcell}{tf:.3f} | {r['fused_tflops']:.0f} | {ta:.3f} | "
                          f"{r['anchor_tflops']:.0f} | {r['ratio']:.2f} |" + (f" {diff:.1e} |" if args.variant else ""),
                          flush=True)
                del first
            del fs
            torch.cuda.empty_cache()
    err = check_wgrad(p, 4096, 2048, 1024, 64, 8, "cuda")
    print(f"\ngathered dW vs grouped_mm_wgrad on pre-gathered rows: max rel err {err:.2e}")
    for form in sorted({r["form"] for r in rows}):
        for vname, _ in variants:
            sel = [r["ratio"] for r in rows if r["form"] == form and r["variant"] == vname]
            print(f"median x anchor {form}{' ' + vname if vname else ''}: {statistics.median(sel):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, wgrad_check_rel_err=err), f, indent=1)
    for r in rows:  # fused: median / p20 / p80 over --rounds do_bench medians; the anchor: its median
        shape = dict(shape=r["shape"], T=r["T"], D=SHAPES[r["shape"]][0], F=SHAPES[r["shape"]][1],
                     E=SHAPES[r["shape"]][2], K=SHAPES[r["shape"]][3])
        q = _results.spread(r["rounds_ms"])
        rec.row(r["form"], "fused" + (f":{r['variant']}" if r["variant"] else ""), shape, r["fused_ms"], q["p20"],
                q["p80"], unit="ms", spec=r["spec"], tflops=r["fused_tflops"], vs_anchor=r["ratio"],
                rel_diff=r["rel_diff"], rounds_ms=r["rounds_ms"], wgrad_check_rel_err=err)
        if r["variant"] == variants[0][0]:  # one anchor row per (shape, T, form)
            rec.row(r["form"], "grouped_mm:tlx", shape, r["anchor_ms"], unit="ms", tflops=r["anchor_tflops"])
    rec.write()
    return 0 if err < 1e-2 else 1  # two results of one fp32 sum round at most one bf16 ulp (2**-7 of the max) apart


if __name__ == "__main__":
    sys.exit(main())
