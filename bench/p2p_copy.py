"""Copy-engine bandwidth between two GPUs of one host (the measurement behind the exchange's
"copy-engine pull" design note in the README): ``dst.copy_(src)`` across devices with peer access
is a cudaMemcpyPeerAsync, moved by the copy engines (no SM busy). One direction, then both at once
(each GPU pulls from the other on its own stream). Medians of ``--reps`` runs, GB/s per direction.

``--sm`` adds the same transfers moved by SM kernels (what the exchange's send and reduce kernels
do): a persistent Triton copy over ``--programs`` programs per SM, 16-byte vectors, ``push`` (each
GPU stores into the other's buffer through its peer address) and ``pull`` (each loads from the
other's), one way and both ways at once. Its timing starts before the host launches the kernels one
GPU after the other, so its "both ways" columns also count that launch skew (well below the held runs
at small sizes); ``--sm-variants`` times the same kernel held, the figure to use for what an SM-driven
exchange can reach when both GPUs send, as the dispatch and the combine do.

``--ce-raw`` adds the copy-engine transfers issued through the CUDA driver API (ctypes on ``libcuda.so.1``:
``cuMemcpyPeerAsync`` on one dedicated stream per GPU, timed by events on those streams), with no torch
cross-device copy in between: torch's ``copy_`` across devices runs on the source device's current stream
and adds event barriers between the two devices' current streams, which may serialise or distort the two
directions (the first table's "both ways" column reads about half of NVIDIA's p2pBandwidthLatencyTest
figure, and of the driver API's).
"write" issues each copy on its source GPU's stream, "read" on its destination's; one way and both ways.
Each timed run starts behind a short spin kernel on every stream, so that the host's issue latency is not
timed and the two directions start together.

``--sm-variants`` adds other SM push kernels, one way and both ways, under the same spin-kernel start: the
``--sm`` kernel as it is (the reference), the same at 8 warps and 8192-element blocks, a kernel that copies
chunks of 4 consecutive 2048-element blocks with all 4 loads issued before the 4 stores, and one program
per SM at 16 warps with 8192-element blocks -- whether a wider, deeper or fewer-program copy moves more per
direction when both GPUs send.

``--mixed`` splits each direction between a copy engine and the SM push kernel running at once (copy-engine
shares 1.0 down to 0.0): whether the two together move more than either alone.

    python bench/p2p_copy.py [--mb 64,235] [--reps 9] [--sm] [--programs 4] [--ce-raw] [--sm-variants] [--mixed]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics

import torch

import _results  # bench/_results.py (the script's directory is on sys.path)

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

    @triton.jit
    def _sm_copy_x4_kernel(src_addr, dst_addr, n, BLOCK: tl.constexpr):
        """``dst[0:n] = src[0:n]`` (bf16) by a persistent grid over chunks of 4 consecutive BLOCK-element
        blocks: the chunk's 4 loads are issued before its 4 stores (more bytes in flight per thread)."""
        src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.bfloat16)), 16)
        dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.bfloat16)), 16)
        r = tl.arange(0, BLOCK)
        for c in range(tl.program_id(0), tl.cdiv(n, 4 * BLOCK), tl.num_programs(0)):
            o0 = c.to(tl.int64) * (4 * BLOCK) + r
            o1 = o0 + BLOCK
            o2 = o1 + BLOCK
            o3 = o2 + BLOCK
            x0 = tl.load(src + o0, mask=o0 < n)
            x1 = tl.load(src + o1, mask=o1 < n)
            x2 = tl.load(src + o2, mask=o2 < n)
            x3 = tl.load(src + o3, mask=o3 < n)
            tl.store(dst + o0, x0, mask=o0 < n)
            tl.store(dst + o1, x1, mask=o1 < n)
            tl.store(dst + o2, x2, mask=o2 < n)
            tl.store(dst + o3, x3, mask=o3 < n)
except ImportError:  # pragma: no cover - no Triton: the copy-engine rows only
    triton = None


# Cycles of the spin kernel queued on each stream before a held run (~0.5 ms at the H200's 1.98 GHz): longer
# than the host takes to queue the events, copies and kernels behind it.
_HOLD_CYCLES = 1_000_000


def _hold(streams):
    """Queue a spin kernel on each of ``streams``: what is queued behind it starts when the GPU gets there, not
    when the host does, so the host's issue latency stays out of the timed span and both directions start
    within the two spin kernels' launch skew."""
    for s in streams:
        with torch.cuda.device(s.device), torch.cuda.stream(s):
            torch.cuda._sleep(_HOLD_CYCLES)


def _time(fn, reps, hold=()):
    times = []
    for _ in range(reps):
        for d in range(2):
            torch.cuda.synchronize(d)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)]
        _hold(hold)
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
    ap.add_argument("--programs", type=int, default=4, help="--sm, --sm-variants: programs per SM")
    ap.add_argument("--ce-raw", action="store_true",
                    help="also copy-engine copies by cuMemcpyPeerAsync (driver API) on dedicated streams, "
                         "write and read")
    ap.add_argument("--mixed", action="store_true",
                    help="also each direction split between a copy engine (cuMemcpyPeerAsync) and the SM push kernel "
                         "at once, at several copy-engine shares")
    ap.add_argument("--sm-variants", action="store_true",
                    help="also other SM push kernels (wider blocks, 4-block unrolled, one program per SM)")
    _results.add_args(ap)
    args = ap.parse_args()
    rec = _results.Recorder("p2p_link", args, world=2)  # GPUs 0 and 1 of this host, one process
    if (args.sm or args.sm_variants or args.mixed) and triton is None:
        print("--sm, --sm-variants and --mixed need triton")
        return 1
    sm_rows, ce_rows, var_rows, mix_rows, drv = [], [], [], [], None
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
        for op, t in (("one_way", t1), ("both_ways", t2)):  # medians of --reps runs, GB/s per direction
            rec.row(op, "torch_copy", {"MB": mb}, gb / t * 1e3, unit="GB/s", ms=t)
        if args.sm:
            sm_rows.append((mb, _sm_rows(src, dst, streams, n, args)))
        if args.ce_raw:
            drv = drv or _Driver()  # after the torch copies above: both contexts exist, peer access is on
            ce_rows.append((mb, _ce_raw_rows(drv, src, dst, n, args.reps)))
        if args.sm_variants:
            var_rows.append((mb, _sm_variant_rows(src, dst, n, args)))
        if args.mixed:
            drv = drv or _Driver()
            mix_rows.append((mb, _mixed_rows(drv, src, dst, n, args)))
    if sm_rows:
        print(f"\nSM kernels ({args.programs} programs per SM, 4096-element blocks): GB/s per direction")
        print("| MB | push one way | push both ways | pull one way | pull both ways |")
        print("|---|---|---|---|---|")
        for mb, r in sm_rows:
            print(f"| {mb} | " + " | ".join(f"{r[k]:.1f}" for k in ("push1", "push2", "pull1", "pull2")) + " |")
    if ce_rows:
        print("\nCopy engines by cuMemcpyPeerAsync on dedicated streams (write: issued on the source GPU's stream,"
              " read: on the destination's): GB/s per direction")
        print("| MB | CE write one way | CE write both ways | CE read one way | CE read both ways |")
        print("|---|---|---|---|---|")
        for mb, r in ce_rows:
            print(f"| {mb} | " + " | ".join(f"{r[k]:.1f}" for k in ("write1", "write2", "read1", "read2")) + " |")
    if mix_rows:
        print(f"\nEach direction split: the first share by a copy engine (cuMemcpyPeerAsync on the source's stream), the "
              f"rest by the SM push kernel ({args.programs} programs per SM) on a second stream, at once: GB/s per direction")
        print("| MB | copy-engine share | one way | both ways |")
        print("|---|---|---|---|")
        for mb, rows in mix_rows:
            for share, g1, g2 in rows:
                print(f"| {mb} | {share:.3f} | {g1:.1f} | {g2:.1f} |")
    if var_rows:
        print("\nSM push kernel variants: GB/s per direction")
        print("| MB | variant | push one way | push both ways |")
        print("|---|---|---|---|")
        for mb, rows in var_rows:
            for label, g1, g2 in rows:
                print(f"| {mb} | {label} | {g1:.1f} | {g2:.1f} |")
    for mb, r in sm_rows:  # medians of --reps runs, GB/s per direction (no spread kept)
        for k, (op, prov) in {"push1": ("one_way", "sm_push"), "push2": ("both_ways", "sm_push"),
                              "pull1": ("one_way", "sm_pull"), "pull2": ("both_ways", "sm_pull")}.items():
            rec.row(op, prov, {"MB": mb}, r[k], unit="GB/s", programs_per_sm=args.programs)
    for mb, r in ce_rows:
        for k, (op, prov) in {"write1": ("one_way", "ce_write"), "write2": ("both_ways", "ce_write"),
                              "read1": ("one_way", "ce_read"), "read2": ("both_ways", "ce_read")}.items():
            rec.row(op, prov, {"MB": mb}, r[k], unit="GB/s")
    for mb, rows in mix_rows:
        for share, g1, g2 in rows:
            for op, g in (("one_way", g1), ("both_ways", g2)):
                rec.row(op, "ce+sm_push", {"MB": mb}, g, unit="GB/s", ce_share=share, programs_per_sm=args.programs)
    for mb, rows in var_rows:
        for label, g1, g2 in rows:
            for op, g in (("one_way", g1), ("both_ways", g2)):
                rec.row(op, f"sm_push:{label}", {"MB": mb}, g, unit="GB/s")
    rec.write()
    return 0


def _run_dirs(ev, dirs, streams, on, issue):
    """Start events for each direction in ``dirs`` (``d``: GPU d -> GPU 1 - d) on the stream that carries it,
    ``streams[on(d)]``, then every direction's transfer (``issue(d)``), then the end events: the directions
    run at once. Returns their event pairs."""
    for i, d in enumerate(dirs):
        with torch.cuda.device(on(d)):
            ev[i][0].record(streams[on(d)])
    for d in dirs:
        issue(d)
    for i, d in enumerate(dirs):
        with torch.cuda.device(on(d)):
            ev[i][1].record(streams[on(d)])
    return ev[:len(dirs)]


def _held_pair(src, dst, streams, on, issue, reps, hold=None) -> tuple[float, float]:
    """GB/s per direction of GPU 0 -> 1 alone and of both directions at once (``issue(d)`` moves
    ``src[d]`` into ``dst[1 - d]`` on ``streams[on(d)]``), each run held behind the spin kernels; the
    destinations are zeroed first and checked against the sources after."""
    for t in dst:
        t.zero_()
    for d in range(2):  # the zeroing ran on the devices' current streams, not on ``streams``
        torch.cuda.synchronize(d)
    runs = [functools.partial(_run_dirs, dirs=dirs, streams=streams, on=on, issue=issue) for dirs in ((0,), (0, 1))]
    for fn in runs:  # compile and warm up
        fn([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)])
    t1, t2 = (_time(fn, reps, hold=hold or streams) for fn in runs)
    assert torch.equal(dst[0], src[1].to("cuda:0")) and torch.equal(dst[1], src[0].to("cuda:1"))
    gb = src[0].numel() * src[0].element_size() / 1e9
    return gb / t1 * 1e3, gb / t2 * 1e3


class _Driver:
    """The CUDA driver entry points that ``--ce-raw`` uses, through ctypes; every CUresult is checked. Each
    GPU's context is its primary context (the runtime's, so torch's streams and allocations live in it),
    retained here for the life of the process."""

    PEER_ACCESS_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        ptr, u64, res = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int  # CUcontext / CUstream, CUdeviceptr, CUresult
        for name, argtypes in {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorName": [res, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ptr), ctypes.c_int],
            "cuCtxGetCurrent": [ctypes.POINTER(ptr)],
            "cuCtxEnablePeerAccess": [ptr, ctypes.c_uint],
            # dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream
            "cuMemcpyPeerAsync": [u64, ptr, u64, ptr, ctypes.c_size_t, ptr],
        }.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = argtypes, res
        self.call("cuInit", 0)
        self.ctx = []
        for d in range(2):
            dev, ctx, cur = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
            self.call("cuDeviceGet", ctypes.byref(dev), d)
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            with torch.cuda.device(d):
                self.call("cuCtxGetCurrent", ctypes.byref(cur))
            if not ctx.value or ctx.value != cur.value:
                raise RuntimeError(f"GPU {d}: primary context {ctx.value} is not the runtime's current {cur.value}")
            self.ctx.append(ctx)
        for d in range(2):  # torch's copies have normally enabled it already
            with torch.cuda.device(d):
                self.call("cuCtxEnablePeerAccess", self.ctx[1 - d], 0, ok=(0, self.PEER_ACCESS_ALREADY_ENABLED))

    def call(self, name, *args, ok=(0,)):
        r = getattr(self.lib, name)(*args)
        if r not in ok:
            s = ctypes.c_char_p()
            known = self.lib.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value
            raise RuntimeError(f"{name} failed: CUresult {r}" + (f" ({s.value.decode()})" if known else ""))
        return r


def _ce_raw_rows(drv, src, dst, n, reps) -> dict:
    """GB/s per direction of cuMemcpyPeerAsync copies on one dedicated stream per GPU: "write" issues the
    copy GPU d -> 1 - d on GPU d's stream, "read" on GPU 1 - d's; GPU 0 -> 1 alone and both at once."""
    streams = [torch.cuda.Stream(device=d) for d in range(2)]
    out = {}
    for orient in ("write", "read"):
        on = (lambda d: d) if orient == "write" else (lambda d: 1 - d)

        def issue(d, on=on):
            with torch.cuda.device(on(d)):  # the stream's context current, as the runtime would have it
                drv.call("cuMemcpyPeerAsync", dst[1 - d].data_ptr(), drv.ctx[1 - d], src[d].data_ptr(), drv.ctx[d],
                         n * 2, streams[on(d)].cuda_stream)

        out[orient + "1"], out[orient + "2"] = _held_pair(src, dst, streams, on, issue, reps)
    return out


def _mixed_rows(drv, src, dst, n, args) -> list:
    """(copy-engine share, GB/s one way, GB/s both ways): direction d moves its first ``share`` of the
    elements by cuMemcpyPeerAsync on GPU d's copy stream and the rest by the SM push kernel on GPU d's
    kernel stream, both at once; the direction ends when both have (the copy stream waits for the kernel
    stream before its end event)."""
    ce = [torch.cuda.Stream(device=d) for d in range(2)]
    sm = [torch.cuda.Stream(device=d) for d in range(2)]
    grid = [(torch.cuda.get_device_properties(d).multi_processor_count * args.programs,) for d in range(2)]
    rows = []
    for share in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.0):
        n_ce = int(n * share) // 4096 * 4096

        def issue(d, n_ce=n_ce):
            with torch.cuda.device(d):
                if n_ce:
                    drv.call("cuMemcpyPeerAsync", dst[1 - d].data_ptr(), drv.ctx[1 - d], src[d].data_ptr(), drv.ctx[d],
                             n_ce * 2, ce[d].cuda_stream)
                if n - n_ce:
                    with torch.cuda.stream(sm[d]):
                        _sm_copy_kernel[grid[d]](src[d].data_ptr() + n_ce * 2, dst[1 - d].data_ptr() + n_ce * 2,
                                                 n - n_ce, BLOCK=4096)
                    ce[d].wait_stream(sm[d])

        rows.append((n_ce / n, *_held_pair(src, dst, ce, lambda d: d, issue, args.reps, hold=ce + sm)))
    return rows


def _sm_variant_rows(src, dst, n, args) -> list:
    """(label, GB/s one way, GB/s both ways) of each SM push kernel variant: the kernel runs on the GPU
    that holds the source and stores into the peer's buffer; one dedicated stream per GPU."""
    streams = [torch.cuda.Stream(device=d) for d in range(2)]
    sms = [torch.cuda.get_device_properties(d).multi_processor_count for d in range(2)]
    p = args.programs
    variants = (  # label, kernel, BLOCK, num_warps, programs per SM
        (f"--sm kernel: {p}/SM, 4 warps, BLOCK 4096", _sm_copy_kernel, 4096, 4, p),
        (f"{p}/SM, 8 warps, BLOCK 8192", _sm_copy_kernel, 8192, 8, p),
        (f"x4 unrolled: {p}/SM, 4 warps, 4 x BLOCK 2048", _sm_copy_x4_kernel, 2048, 4, p),
        ("1/SM, 16 warps, BLOCK 8192", _sm_copy_kernel, 8192, 16, 1),
    )
    rows = []
    for label, kernel, block, warps, per_sm in variants:
        def issue(d, kernel=kernel, block=block, warps=warps, per_sm=per_sm):
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                kernel[(sms[d] * per_sm,)](src[d].data_ptr(), dst[1 - d].data_ptr(), n, BLOCK=block, num_warps=warps)

        rows.append((label, *_held_pair(src, dst, streams, lambda d: d, issue, reps=args.reps)))
    return rows


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
