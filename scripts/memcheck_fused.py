"""Runs every fused expert kernel (six launches of one forward + backward) once per case, for
compute-sanitizer's memcheck (tier T3 of the fused pipeline, issue 9).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python scripts/memcheck_fused.py

Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees an access one
byte outside any operand (the script refuses to run without it unless ``--allow-caching``). Cases
(row-index form, ``fused_experts_rows``): random softmax routing; zero-row experts; one expert with
every row; K = E; a single token; fewer rows than a tile; padding rows past the last expert; a
receive-buffer layout (source rows and destination rows in different, permuted index spaces, as
under expert parallelism); E = 256 tiny experts; D, F at the TLX minimum (64). Each backend (tlx,
triton -- whichever runs here) does forward and backward; the output and every gradient are compared
with the fp64 reference backend. Exit 0 and a final "memcheck fused cases: all ok" line when done.

``--device cpu`` runs the same cases on the portable kernels under ``TRITON_INTERPRET=1`` (fp32), a
dry run of the script itself.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def _cases(torch, cpu: bool):
    """(name, T rows of x, num_dst, D, F, E, K, kind) -- kind picks the routing below."""
    small = cpu  # the interpreter is slow: smaller shapes, same structure
    D, F = (64, 64) if small else (256, 192)
    return [
        ("random softmax routing", 96 if small else 1000, None, D, F, 8, 2, "random"),
        ("zero-row experts (half the experts unused)", 64 if small else 700, None, D, F, 8, 2, "half"),
        ("one expert owns every row (K=1)", 40 if small else 600, None, D, F, 4, 1, "one"),
        ("K = E", 24 if small else 300, None, D, F, 4, 4, "random"),
        ("a single token", 1, None, D, F, 8, 2, "random"),
        ("fewer rows than a tile", 5, None, D, F, 16, 3, "random"),
        ("padding rows past the last expert", 48 if small else 500, None, D, F, 8, 2, "padding"),
        ("receive-buffer layout (EP): src and dst permuted", 64 if small else 800, 29 if small else 333, D, F, 8,
         2, "ep"),
        ("E=256 tiny experts", 32 if small else 512, None, 64, 64, 256, 4, "random"),
        ("D = F = 64 (TLX minimum)", 64 if small else 384, None, 64, 64, 8, 2, "random"),
    ]


def _routing(torch, kind: str, T: int, E: int, K: int, num_dst, g):
    """(src_N, dst_N, gate_N, offsets_E, N, num_dst) in the row-index form fused_experts_rows takes."""
    if kind == "one":
        idx = torch.zeros(T, K, dtype=torch.int64)
    else:
        logits = torch.randn(T, E, generator=g)
        if kind == "half":
            logits[:, E // 2:] = -1e9
        idx = torch.softmax(logits, -1).topk(K, -1).indices
    from tlx_dist.fused import expert_major_slots

    gate = torch.rand(T, K, generator=g) + 0.05
    src, order, offsets = expert_major_slots(idx, E)
    src = src.long()
    n_out = T if num_dst is None else num_dst
    dst = src.clone()
    if kind == "ep":  # source rows in a receive buffer, destinations a permuted smaller space
        dst = torch.randperm(n_out, generator=g)[src % n_out]
        src = torch.randperm(T, generator=g)[src]
    N = src.shape[0]
    if kind == "padding":  # rows past offsets[-1]: never read, their indices deliberately out of range
        pad = 37
        src = torch.cat([src, torch.full((pad,), 10**6)])
        dst = torch.cat([dst, torch.full((pad,), 10**6)])
        N += pad
    gate_N = torch.cat([gate.reshape(-1)[order], torch.zeros(N - order.shape[0])])
    return src.to(torch.int32), dst.to(torch.int32), gate_N, offsets, N, n_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-caching", action="store_true", help="run with the caching allocator (weaker check)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if not cpu and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1" and not args.allow_caching:
        print("set PYTORCH_NO_CUDA_MEMORY_CACHING=1 (see the docstring) or pass --allow-caching", file=sys.stderr)
        return 2
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu runs the portable kernels under TRITON_INTERPRET=1; set it", file=sys.stderr)
        return 2

    import torch

    from tlx_dist.fused import fused_experts_rows
    from tlx_dist.fused import get_fused_backend
    from tlx_dist.testing import memcheck_mismatch

    if not cpu and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    dtype = torch.float32 if cpu else torch.bfloat16
    backends = []
    for name in (("triton",) if cpu else ("tlx", "triton")):
        try:
            backends.append(get_fused_backend(name))
        except ValueError as e:
            print(f"skip backend {name}: {e}", flush=True)
    print(f"backends: {[b.name for b in backends]}", flush=True)
    failures = []
    g = torch.Generator().manual_seed(0)
    for name, T, num_dst, D, F, E, K, kind in _cases(torch, cpu):
        src, dst, gate, offsets, N, n_out = _routing(torch, kind, T, E, K, num_dst, g)
        x = (torch.randn(T, D, generator=g)).to(dev, dtype)
        w13 = (torch.randn(E, D, 2 * F, generator=g) / math.sqrt(D)).to(dev, dtype)
        w2 = (torch.randn(E, F, D, generator=g) / math.sqrt(F)).to(dev, dtype)
        dout = torch.randn(n_out, D, generator=g).to(dev, dtype)
        idx = [t.to(dev) for t in (src, dst, offsets)]
        gate = gate.to(dev)

        def run(backend, cast):
            leaves = [t.detach().to(cast).requires_grad_() for t in (x, gate, w13, w2)]
            out = fused_experts_rows(leaves[0], idx[0], idx[1], leaves[1], leaves[2], leaves[3], idx[2], n_out,
                                     backend=backend)
            grads = torch.autograd.grad(out, leaves, dout.to(cast))
            return [out, *grads]

        ref = run("reference", torch.float64)
        for b in backends:
            reason = b.supports(x, w13, w2)
            if reason is not None:
                print(f"skip {b.name:6s} {name}: {reason}", flush=True)
                continue
            got = run(b.name, dtype)
            if not cpu:
                torch.cuda.synchronize()
            for what, a, r in zip(("out", "dx", "dgate", "dw13", "dw2"), got, ref):
                # padding rows' gates are zero and never read; their gradient is whatever the backend
                # leaves there (the reference: zero)
                if what == "dgate":
                    a, r = a[: int(offsets[-1])], r[: int(offsets[-1])]
                bad = memcheck_mismatch(a, r)  # loose: tests/test_fused_moe_gpu.py holds the accuracy
                if bad:
                    failures.append(f"{b.name} {what} {name}: {bad}")
            print(f"ran {b.name:6s} {name}", flush=True)
    failures += _check_layout_kernel(torch, dev, dtype, cpu, g)
    if failures:
        print("memcheck fused cases FAILED:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print("memcheck fused cases: all ok", flush=True)
    return 0


def _check_layout_kernel(torch, dev, dtype, cpu: bool, g) -> list:
    """The one-launch expert-major layout (tlx/common/routing.py) against the torch sort, and the
    one-rank fused layer that takes its scheduler tables (``fused_experts``), against the fp64
    reference."""
    from tlx_dist.fused import expert_major_layout, expert_major_slots, fused_experts

    failures = []
    for kind, T, E, K in (("random", 300, 64, 8), ("one", 257, 8, 1), ("half", 64, 256, 4), ("random", 1, 8, 8)):
        logits = torch.randn(T, E, generator=g)
        if kind == "half":
            logits[:, E // 2:] = -1e9
        idx = torch.zeros(T, K, dtype=torch.int64) if kind == "one" else logits.topk(K, -1).indices
        got = expert_major_layout(idx.to(dev), E)
        want = expert_major_slots(idx, E)
        for what, a, r in zip(("tok", "order", "offsets"), got, want):
            if not torch.equal(a.cpu(), r):
                failures.append(f"layout {what} {kind} T={T} E={E} K={K}")
        print(f"ran layout {kind} T={T} E={E} K={K}", flush=True)
    T, D, F, E, K = 96, 64, 64, 8, 2
    x = torch.randn(T, D, generator=g)
    idx = torch.randn(T, E, generator=g).topk(K, -1).indices
    gate = torch.rand(T, K, generator=g) + 0.05
    w13 = torch.randn(E, D, 2 * F, generator=g) / D ** 0.5
    w2 = torch.randn(E, F, D, generator=g) / F ** 0.5
    backend = "triton" if cpu else "tlx"
    from tlx_dist.fused import FusedConfig

    out = fused_experts(x.to(dev, dtype), idx.to(dev), gate.to(dev), w13.to(dev, dtype), w2.to(dev, dtype),
                        backend=backend, config=FusedConfig(layout_kernel=True))  # the layout kernel's path
    ref = fused_experts(x.double(), idx, gate.double(), w13.double(), w2.double(), backend="reference")
    from tlx_dist.testing import memcheck_mismatch

    bad = memcheck_mismatch(out, ref.to(dev))
    if bad:
        failures.append(f"fused_experts ({backend}, scheduler tables from the layout kernel): {bad}")
    print(f"ran fused_experts {backend} with the layout kernel's tables", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
