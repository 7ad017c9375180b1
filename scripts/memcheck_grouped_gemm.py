"""Runs every GPU grouped-GEMM kernel once per case, for compute-sanitizer's memcheck (tier T3).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python scripts/memcheck_grouped_gemm.py

Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees an access one
byte outside any operand (with it, a stray access usually lands inside a cached block and goes
unseen; the script refuses to run without it unless ``--allow-caching``). Cases: random routing,
adversarial layouts (zero-row experts, one expert with every row, E=256 tiny experts, fewer rows
than a tile, padding rows) and deliberately bad offsets (decreasing, negative, past the end, int64
past 2**31). Each backend (tlx, triton, torch -- whichever run here) does forward, dX (transposed
weight) and dW; results are compared with the reference on the safe offsets, and the device offsets
flag must say exactly what was wrong. Exit 0 and a final "memcheck cases: all ok" line when done;
memcheck itself reports "ERROR SUMMARY: 0 errors".
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def _cases():
    import torch

    def cum(counts):
        return torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()

    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 300, (8,), generator=g).tolist()
    # (name, offsets, N, D, F)
    return [
        ("random counts, 8 experts, padding rows", cum(rand), sum(rand) + 37, 256, 384),
        ("zero-row experts among others", cum([300, 0, 517, 129, 1, 600]), 1547, 256, 384),
        ("one expert owns every row", cum([0, 0, 2000, 0]), 2000, 128, 256),
        ("E=256 tiny experts (deep search)", cum([8] * 256), 2048, 128, 128),
        ("fewer rows than a tile, F=8", cum([5, 3, 0, 9]), 17, 64, 8),
        ("bad: decreasing", [300, 100, 1000], 1000, 128, 256),
        ("bad: negative first offset", [-64, 500, 1000], 1000, 128, 256),
        ("bad: past the end", [200, 1500, 1700], 1000, 128, 256),
        ("bad: decreasing then one past the end", [1000, 0, 1000, 1001], 1000, 128, 256),
        ("bad: int64 past 2**31", [2**31 + 5, 2**31 + 9], 1000, 128, 256),
        ("bad: every offset negative", [-5, -3, -1], 64, 64, 64),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-caching", action="store_true", help="run with the caching allocator (weaker check)")
    args = ap.parse_args(argv)
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1" and not args.allow_caching:
        print("set PYTORCH_NO_CUDA_MEMORY_CACHING=1 (see the docstring) or pass --allow-caching", file=sys.stderr)
        return 2

    import torch

    from tlx_dist.grouped_gemm import check_offsets, grouped_mm, offsets_flag
    from tlx_dist.grouped_gemm.backends import available_backends, get_backend
    from tlx_dist.grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref, safe_offsets_ref
    from tlx_dist.testing import memcheck_mismatch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.pop("TLX_DIST_CHECK_OFFSETS", None)  # exercise the device guard, not the host check
    dev = torch.device("cuda", torch.cuda.current_device())
    backends = [b for b in ("tlx", "triton", "torch") if b in available_backends()]
    print(f"backends: {backends}", flush=True)
    flag = offsets_flag(dev)
    failures = []
    for name, offsets, N, D, F in _cases():
        torch.manual_seed(1)
        off = torch.tensor(offsets, dtype=torch.int64, device=dev)
        E = off.shape[0]
        safe, bits = safe_offsets_ref(off.cpu(), N)
        safe = safe.to(dev)
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) / math.sqrt(D)
        for bname in backends:
            b = get_backend(bname)
            if b.supports(x, w) is not None:
                print(f"skip {bname} / {name}: {b.supports(x, w)}", flush=True)
                continue
            flag.zero_()
            y = b.mm(x, w, off)
            dx = b.mm(dy, w.transpose(1, 2), off)
            dw = b.wgrad(x, dy, off)
            xg = x.detach().requires_grad_()
            grouped_mm(xg, w, off, backend=bname).float().sum().backward()
            torch.cuda.synchronize()
            checks = {
                "fwd": (y, grouped_mm_ref(x.double(), w.double(), safe)),
                "dX": (dx, grouped_mm_ref(dy.double(), w.double().transpose(1, 2), safe)),
                "dW": (dw, grouped_mm_wgrad_ref(x.double(), dy.double(), safe)),
            }
            for form, (got, ref) in checks.items():
                bad = memcheck_mismatch(got, ref)  # loose: tests/test_grouped_gemm_gpu.py holds the accuracy
                if bad:
                    failures.append(f"{bname} {form} {name}: {bad}")
            got_bits = int(flag)
            if got_bits != int(bits):
                failures.append(f"{bname} {name}: offsets flag {got_bits} != expected {int(bits)}")
            try:
                check_offsets(dev)
                raised = False
            except ValueError:
                raised = True
            if raised != bool(int(bits)):
                failures.append(f"{bname} {name}: check_offsets raised={raised}, expected {bool(int(bits))}")
            print(f"ran {bname:6s} {name}", flush=True)
    if failures:
        print("memcheck cases FAILED:\n  " + "\n  ".join(failures), flush=True)
        return 1
    print("memcheck cases: all ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
