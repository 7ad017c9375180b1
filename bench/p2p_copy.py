"""Copy-engine bandwidth between two GPUs of one host (the measurement behind the exchange's
"copy-engine pull" design note in the README): ``dst.copy_(src)`` across devices with peer access
is a cudaMemcpyPeerAsync, moved by the copy engines (no SM busy). One direction, then both at once
(each GPU pulls from the other on its own stream). Medians of ``--reps`` runs, GB/s per direction.

    python bench/p2p_copy.py [--mb 64,235] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics

import torch


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
    args = ap.parse_args()
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
