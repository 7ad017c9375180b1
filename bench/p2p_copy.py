"""Copy-engine bandwidth between two GPUs of one host (the measurement behind the exchange's
"copy-engine pull" design note in the README): ``dst.copy_(src)`` across devices with peer access
is a cudaMemcpyPeerAsync, moved by the copy engines (no SM busy). One direction, then both at once
(each GPU pulls from the other on its own stream). Medians of ``--reps`` runs, GB/s per direction.

``--sm`` adds the same transfers moved by SM kernels (what the exchange's send and reduce kernels
do): a persistent Triton copy over ``--programs`` programs per SM, 16-byte vectors, ``push`` (each
GPU stores into the other's buffer through its peer address) and ``pull`` (each loads from the
other's), one way and both ways at once -- the ceiling an SM-driven exchange can reach per direction
when both GPUs send, as the dispatch and the combine do (issue 8's 350 GB/s target).

    python bench/p2p_copy.py [--mb 64,235] [--reps 9] [--sm] [--programs 4]
"""

from __future__ import annotations

import argparse
import statistics

import torch

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _sm_copy_kernel(src_addr, dst_addr, n, BLOCK: tl.constexpr):
        """``dst[0:n] = src[0:n]`` (bf16) by a persistent grid; either address may be a peer's."""
        src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.bfloat16)), 16)
        dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.bfloat16)), 16)
        for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
except ImportError:  # pragma: no cover - no Triton: the copy-engine rows only
    triton = None


def _time(fn, reps):
    times = []
    for _ in range(reps):
        for d in range(2):
            torch.cuda.synchronize(d)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)]
        ends = fn(ev)
        for d in range(2):
            torch.cuda.synchronize(d)
        times.append(max(a.elapsed_time(b) for a, b in ends))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="64,235")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sm", action="store_true", help="also the SM copy kernel, push and pull")
    ap.add_argument("--programs", type=int, default=4, help="--sm: programs per SM")
    args = ap.parse_args()
    if args.sm and triton is None:
        print("--sm needs triton")
        return 1
    sm_rows = []
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return 1
    print(f"peer access 0<->1: {torch.cuda.can_device_access_peer(0, 1)}, {torch.cuda.can_device_access_peer(1, 0)}")
    print("| MB | one way ms | one way GB/s | both ways ms | both ways GB/s per direction |")
    print("|---|---|---|---|---|")
    for mb in (int(m) for m in args.mb.split(",")):
        n = mb * (1 << 20) // 2
        src = [torch.randn(n, device=f"cuda:{d}").bfloat16() for d in range(2)]
        dst = [torch.empty(n, device=f"cuda:{d}", dtype=torch.bfloat16) for d in range(2)]
        streams = [torch.cuda.Stream(device=d) for d in range(2)]

        def one(ev):
            with torch.cuda.device(0), torch.cuda.stream(streams[0]):
                ev[0][0].record(streams[0])
                dst[0].copy_(src[1], non_blocking=True)  # GPU 0 pulls GPU 1's rows
                ev[0][1].record(streams[0])
            return ev[:1]

        def both(ev):
            for d in range(2):
                with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                    ev[d][0].record(streams[d])
                    dst[d].copy_(src[1 - d], non_blocking=True)
                    ev[d][1].record(streams[d])
            return ev

        for fn in (one, both):
            fn([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)])
        t1, t2 = _time(one, args.reps), _time(both, args.reps)
        assert torch.equal(dst[0], src[1].to("cuda:0")) and torch.equal(dst[1], src[0].to("cuda:1"))
        gb = n * 2 / 1e9
        print(f"| {mb} | {t1:.3f} | {gb / t1 * 1e3:.1f} | {t2:.3f} | {gb / t2 * 1e3:.1f} |")
        if args.sm:
            sm_rows.append((mb, _sm_rows(src, dst, streams, n, args)))
    if sm_rows:
        print(f"\nSM kernels ({args.programs} programs per SM, 4096-element blocks): GB/s per direction")
        print("| MB | push one way | push both ways | pull one way | pull both ways |")
        print("|---|---|---|---|---|")
        for mb, r in sm_rows:
            print(f"| {mb} | " + " | ".join(f"{r[k]:.1f}" for k in ("push1", "push2", "pull1", "pull2")) + " |")
    return 0


def _sm_rows(src, dst, streams, n, args) -> dict:
    """GB/s per direction of the SM copy kernel: push (the kernel runs on the GPU that holds the source,
    stores to the peer) and pull (runs on the destination's GPU, loads from the peer), GPU 0 -> 1 alone
    and both directions at once; each result checked against the source."""
    out = {}
    grid = [(torch.cuda.get_device_properties(d).multi_processor_count * args.programs,) for d in range(2)]
    for mode in ("push", "pull"):
        def launch(d, mode=mode):
            # direction d -> 1 - d: src[d] lands in dst[1 - d]
            run_on = d if mode == "push" else 1 - d
            with torch.cuda.device(run_on), torch.cuda.stream(streams[run_on]):
                _sm_copy_kernel[grid[run_on]](src[d].data_ptr(), dst[1 - d].data_ptr(), n, BLOCK=4096)

        def one(ev, launch=launch, mode=mode):
            r = 0 if mode == "push" else 1  # the GPU the 0 -> 1 kernel runs on
            with torch.cuda.device(r):
                ev[0][0].record(streams[r])
            launch(0)
            with torch.cuda.device(r):
                ev[0][1].record(streams[r])
            return ev[:1]

        def both(ev, launch=launch, mode=mode):
            runs = []
            for d in range(2):
                r = 1 - d if mode == "pull" else d
                with torch.cuda.device(r):
                    ev[d][0].record(streams[r])
                runs.append(r)
            for d in range(2):
                launch(d)
            for d, r in enumerate(runs):
                with torch.cuda.device(r):
                    ev[d][1].record(streams[r])
            return ev

        for t in dst:
            t.zero_()
        for fn in (one, both):  # compile and warm up
            fn([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)])
        t1, t2 = _time(one, args.reps), _time(both, args.reps)
        assert torch.equal(dst[0], src[1].to("cuda:0")) and torch.equal(dst[1], src[0].to("cuda:1")), mode
        gb = n * 2 / 1e9
        out[mode + "1"], out[mode + "2"] = gb / t1 * 1e3, gb / t2 * 1e3
    return out


if __name__ == "__main__":
    raise SystemExit(main())
