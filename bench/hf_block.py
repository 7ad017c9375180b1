"""Hugging Face block benchmark: a transformers Qwen3-MoE sparse-MoE block vs the same block patched
to tlx_dist (``HFMoELayer.from_hf_block``), forward + backward on one GPU, in one process.

Block: Qwen3-30B-A3B's MoE shape (D=2048, F=768, E=128, K=8, norm_topk_prob) in bf16, one sequence
of T tokens ([1, T, D]). Anchors ("hf:<impl>"): transformers' own block with each requested experts
implementation (``grouped_mm``: torch._grouped_mm, what a model gets by default on a recent torch;
``eager``: its per-expert loop). Ours ("tlx_dist:<variant>"): the patched block, ``auto`` as a user
gets it (the fused TLX pipeline where it runs, the path taken is printed), or the separate pipeline
with the grouped-GEMM backend pinned (``tlx``: the TLX kernels; ``torch``: torch._grouped_mm).
Fwd+bwd = output and the gradients of x and every parameter (``torch.autograd.grad``, nothing
accumulated between repeats). Medians of triton.testing.do_bench, the providers interleaved over
``--rounds`` rounds and the median of the rounds' medians reported; ratios are taken against the
first anchor in the same process (> 1: faster than it). TFLOP/s counts the expert GEMMs only:
fwd 6·T·K·D·F, fwd+bwd 18·T·K·D·F. Also printed: peak memory of one fwd+bwd and, as a sanity check
(the tests are tests/test_hf*.py), each provider's output against the first anchor's: the tokens
whose top-K expert set differs between transformers' bf16 router logits and tlx_dist's fp32 ones
("flips": at this near-uniform initialisation a few percent of tokens have near-tied scores), and the
max relative difference over the other tokens.

    python bench/hf_block.py [--tokens 4096,16384] [--hf-impls grouped_mm,eager] [--ours auto,tlx,torch]
                             [--json bench_hf_block.json] [--rounds 3] [--rep 100]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys

import torch

import _results  # bench/_results.py (the script's directory is on sys.path)

D, F, E, K = 2048, 768, 128, 8


def make_block(impl: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True, experts_implementation=impl)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.02)  # initializer_range: near-uniform routing, as at init
        block.experts.gate_up_proj.normal_(0.0, D ** -0.5)
        block.experts.down_proj.normal_(0.0, F ** -0.5)
    return block.to("cuda", torch.bfloat16)


def routing_flips(x_TD: torch.Tensor, gate_w_ED: torch.Tensor, k: int) -> torch.Tensor:
    """``[T]`` bool: tokens whose top-``k`` expert set differs between bf16 logits (transformers:
    ``F.linear`` in the weight's dtype) and fp32 logits (tlx_dist's router)."""
    lo = torch.nn.functional.linear(x_TD, gate_w_ED).float()
    hi = x_TD.float() @ gate_w_ED.float().t()
    a = lo.topk(k, dim=-1).indices.sort(-1).values
    b = hi.topk(k, dim=-1).indices.sort(-1).values
    return (a != b).any(-1)


def compare(out: torch.Tensor, ref: torch.Tensor, flips_T: torch.Tensor) -> tuple[float, int]:
    """(max |out - ref| / max |ref| over the tokens not in ``flips_T``, number of flipped tokens)."""
    d_T = (out.float() - ref.float()).reshape(flips_T.numel(), -1).abs().amax(-1)
    scale = float(ref.float().abs().max())
    keep = d_T[~flips_T]
    return (float(keep.max()) / scale if keep.numel() else 0.0), int(flips_T.sum())


def main() -> int:
    from triton.testing import do_bench

    from tlx_dist.integrations.hf import HFMoELayer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--hf-impls", default="grouped_mm,eager")
    ap.add_argument("--ours", default="auto,tlx,torch")
    ap.add_argument("--json", default="bench_hf_block.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=100, help="ms per do_bench measurement")
    _results.add_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    rec = _results.Recorder("hf_block", args)
    impls = [i for i in args.hf_impls.split(",") if i]
    models = {f"hf:{i}": make_block(i) for i in impls}
    base = models[f"hf:{impls[0]}"]
    for v in (v for v in args.ours.split(",") if v):
        kw = dict(pipeline="auto") if v == "auto" else dict(gemm_backend=v, pipeline="separate")
        models[f"tlx_dist:{v}"] = HFMoELayer.from_hf_block(copy.deepcopy(base), **kw)
    names = list(models)
    anchor = names[0]
    dev_name = torch.cuda.get_device_name()
    print(f"{dev_name} | torch {torch.__version__} | Qwen3-MoE block D={D} F={F} E={E} K={K} bf16")

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        xg = x.clone().requires_grad_(True)

        def fwd(m):
            with torch.no_grad():
                return m(x)

        def fwd_bwd(m):
            out = m(xg)
            return torch.autograd.grad(out, [xg] + [p for p in m.parameters() if p.requires_grad], dy)

        ref_out = fwd(models[anchor]).float()
        flips = routing_flips(x.view(T, D), base.gate.weight, K)
        for n, m in models.items():
            if isinstance(m, HFMoELayer):
                print(f"T={T} {n}: {'fused' if m._fused(x.view(T, D)) else 'separate'} pipeline")
        res = {n: {"fwd": [], "fwd_bwd": []} for n in names}
        extra = {}
        for n in names:  # warm-up (compiles kernels), memory and sanity check outside the timing
            m = models[n]
            fwd_bwd(m)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fwd_bwd(m)
            torch.cuda.synchronize()
            # the anchors share transformers' router; ours route with fp32 logits
            err, nflip = compare(fwd(m), ref_out, flips if n.startswith("tlx_dist") else torch.zeros_like(flips))
            extra[n] = dict(peak_gib=(torch.cuda.max_memory_allocated() - before) / 2**30, rel_diff=err,
                            routing_flips=nflip)
        for _ in range(args.rounds):
            for n in names:
                m = models[n]
                res[n]["fwd"].append(do_bench(lambda: fwd(m), rep=args.rep, return_mode="median"))
                res[n]["fwd_bwd"].append(do_bench(lambda: fwd_bwd(m), rep=args.rep, return_mode="median"))
        flops = {"fwd": 6 * T * K * D * F, "fwd_bwd": 18 * T * K * D * F}
        med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
        for n in names:
            row = dict(T=T, provider=n, **{f"{k}_ms": med[n][k] for k in flops},
                       **{f"{k}_tflops": flops[k] / (med[n][k] * 1e-3) / 1e12 for k in flops},
                       **{f"{k}_vs_{anchor}": med[anchor][k] / med[n][k] for k in flops},
                       **{f"{k}_rounds_ms": res[n][k] for k in flops}, **extra[n])
            rows.append(row)

    print(f"\n| T | provider | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | fwd x{anchor} | fwd+bwd x{anchor} "
          f"| peak GiB | flips | rel diff (others) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['provider']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} "
              f"| {r[f'fwd_vs_{anchor}']:.2f} | {r[f'fwd_bwd_vs_{anchor}']:.2f} | {r['peak_gib']:.2f} "
              f"| {r['routing_flips']} | {r['rel_diff']:.1e} |")
    with open(args.json, "w") as fh:
        json.dump({"device": dev_name, "torch": torch.__version__, "shape": dict(D=D, F=F, E=E, K=K),
                   "anchor": anchor, "rows": rows}, fh, indent=1)
    print(f"\nwrote {args.json}")
    for r in rows:  # median / p20 / p80 over the rounds' do_bench medians
        for op in ("fwd", "fwd_bwd"):
            q = _results.spread(r[f"{op}_rounds_ms"])
            rec.row(op, r["provider"], dict(block="qwen3_moe", T=r["T"], D=D, F=F, E=E, K=K), r[f"{op}_ms"],
                    q["p20"], q["p80"], unit="ms", tflops=r[f"{op}_tflops"], vs_anchor=r[f"{op}_vs_{anchor}"],
                    anchor=anchor, rounds_ms=r[f"{op}_rounds_ms"], peak_gib=r["peak_gib"],
                    routing_flips=r["routing_flips"], rel_diff=r["rel_diff"])
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
