"""Dispatch/combine benchmark: the deduplicated symmetric exchange vs NCCL ``all_to_all_single``.

Run under torchrun (one process per GPU; the anchor is the NCCL path at the same W):

    torchrun --nproc-per-node=2 bench/dispatch.py [--tokens 128,512,4096,16384] [--dims 2048,7168]
             [--experts 64,256] [--json bench_dispatch.json]

or as one process: W = 1 (torch symmetric memory on a one-rank group, anchored by LocalDispatcher,
the one-rank permutation path: nothing crosses a link there), or ``--emulate W`` (W virtual ranks on
this GPU, every rank's kernels one after another; "peer" stores are local HBM stores, so this shows
kernel efficiency and per-op overhead at W, never NVLink speed).

Providers (K = 8, bf16, random top-K routing, gates from a softmax):
  nccl        AllToAllDispatcher: all-gather of counts, host split sizes (one .cpu()), all_to_all_single,
              expert-major gathers; combine = the reverse exchange + gate-weighted k-sum (torchtitan style)
  symm        SymmDispatcher(capacity="exact"): one host read of the row count per dispatch
  symm_graph  SymmDispatcher(capacity=2.0), dispatch and combine each captured in a CUDA graph and
              replayed (no host work per op: the latency a graph-captured training step sees)
  rows_graph  the same, in the row form the fused EP pipeline uses (``dispatch_rows`` /
              ``combine_rows``): the token rows stay as received (no expert-major copy), the
              combine sends per-(token, rank) partial rows the fused down GEMM has already summed
              (here the receive rows themselves stand in for them). Same link bytes as symm;
              the exchange's own cost in the fused pipeline (the expand and the gate-weighted
              k-sum it leaves out run inside the fused GEMMs there)
  regions_graph  rows_graph into a per-layer receive region (``SymmDispatcher(row_regions=1)``,
              ``dispatch_rows(region=0)``): the rows stay where they land, no receive-side copy (W > 1);
              SM stores (``copy_engine=False``)
  regions_ce_graph  the same by copy engines in the dense layout (``copy_engine=True``; what
              ``"auto"`` picks from T_max >= 8192 where nearly every token reaches every peer)
Per op: median latency over iterations (rank 0's clock; every op ends with every rank's rows in),
``link GB/s`` = bytes this rank sends to *other* ranks per second (token rows once per destination for
symm, once per (token, k) slot for nccl; combine: one partial row per (token, rank) vs one per slot),
and the ratio of nccl's dispatch+combine time to the provider's. ``disp al.`` / ``comb al.`` (W > 1): the
same per-op medians with the ranks aligned on the device first (a symmetric-memory barrier kernel after
the host barrier), so the ranks' launch skew is not counted as the op's time. ``pair us``: the steady-state time of one
dispatch+combine when ``--pair-reps`` pairs run back to back after one barrier (no per-op sync, so the
ranks' launch skew is not counted), with its own ratio. ``disp ss`` / ``comb ss``: the same steady
state for one op alone (``--pair-reps`` of it back to back): its latency once the GPU never waits for
the host to launch the next replay (which the per-op medians, one event pair per op, count). ``--profile`` prints rank 0's per-kernel GPU
time per pair for the symm providers (where the time goes: layout, barrier, send, expand, reduce).
NVSHMEM route: launch one process per GPU with ``LOCAL_WORLD_SIZE=1`` (as the ``per-gpu-node`` checks of
scripts/gpu_checks.toml do).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import _results  # bench/_results.py (the script's directory is on sys.path)
from _profile import kernel_profile  # bench/_profile.py (the script's directory is on sys.path)

K = 8


def _median_ms(fn, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


_ALIGN_HOLD_CYCLES = 200_000  # ~100 us at an H200's 1.98 GHz


def _aligned_sync(sync, symm_disp):
    """``sync`` followed by a device-side barrier of the ranks (torch symmetric memory's barrier
    kernel on the current stream), so a per-op timing starts when every rank's GPU is there: the
    per-op medians otherwise count the ranks' host launch skew after the host barrier (tens of us)
    as the op's own waiting. A spin kernel ahead of the barrier holds the stream until the host has
    queued what follows, so both ranks' ops start when the barrier ends. None where the buffers have no
    such handle (the emulated world)."""
    handle = getattr(getattr(symm_disp, "buffers", None), "_handle", None)
    if handle is None or not hasattr(handle, "barrier"):
        return None

    def run():
        sync()
        # the stream is held (~100 us) while the host queues the barrier, the timing's start event and the
        # op: without it the barrier could end before the later rank's host had queued its op, which then
        # started that much after the other rank's
        torch.cuda._sleep(_ALIGN_HOLD_CYCLES)
        handle.barrier(channel=1)
    return run


def _stream_us(fn, reps: int, sync) -> float:
    """Steady-state time of ``fn``: ``reps`` calls back to back after one sync (median of 5 such
    runs, divided by ``reps``): its own latency once the GPU is never waiting for the host to launch
    the next replay, which the per-op medians (one sync, one event pair per op) count."""
    def run():
        for _ in range(reps):
            fn()
    return _median_ms(run, 5, sync) * 1e3 / reps


def _pair_us(fd, fc, reps: int, sync) -> float:
    """Steady-state time of one dispatch+combine pair (``_stream_us`` of the pair). Unlike the
    per-op medians (one sync per op, so the ranks' launch skew after the barrier is counted as
    waiting), this is what a training step sees."""
    return _stream_us(lambda: (fd(), fc()), reps, sync)


def rows_check(disp, x, idx, gate, ra, n_ranks_T, region=None):
    """Row form against the anchor: the receive rows read through ``src_N`` are the anchor's
    expert-major rows, and combining the receive rows themselves gives ``x[t]`` times the number
    of ranks token t went to. Returns the receive rows and the handle."""
    recv, src, _gate_N, h = disp.dispatch_rows(x, idx, gate, region=region)
    n = ra.shape[0]
    if not torch.equal(recv[src[:n].long()], ra):
        raise AssertionError("rows: recv_RD[src_N] differs from the anchor's expert-major rows")
    out = disp.combine_rows(recv, h)
    want = (x.float() * n_ranks_T[:, None].float()).to(x.dtype)
    if not torch.equal(out, want):
        raise AssertionError(f"rows: combine_rows of the receive rows is not x * ranks reached "
                             f"(max diff {float((out.float() - want.float()).abs().max()):.3e})")
    return recv, h


def _graphs(disp, x, idx, gate):
    """CUDA graphs of one dispatch and one combine (buffers warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r, h = disp.dispatch(x, idx, gate)
        disp.combine_weighted(r, h, gate)
    torch.cuda.current_stream().wait_stream(side)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gd):
        r, h = disp.dispatch(x, idx, gate)
    with torch.cuda.graph(gc):
        disp.combine_weighted(r, h, gate)
    return gd.replay, gc.replay


def _graphs_rows(disp, x, idx, gate, region=None):
    """CUDA graphs of one ``dispatch_rows`` and one ``combine_rows`` (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        recv, _, _, h = disp.dispatch_rows(x, idx, gate, region=region)
        disp.combine_rows(recv, h)
    torch.cuda.current_stream().wait_stream(side)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gd):
        recv, _, _, h = disp.dispatch_rows(x, idx, gate, region=region)
    with torch.cuda.graph(gc):
        disp.combine_rows(recv, h)
    return gd.replay, gc.replay


def main() -> int:
    import torch.distributed as dist

    from tlx_dist.comm import AllToAllDispatcher, LocalDispatcher, SymmDispatcher
    from tlx_dist.comm.symm.buffers import SymmBuffers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,512,4096,16384")
    ap.add_argument("--dims", default="2048,7168")
    ap.add_argument("--experts", default="64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--emulate", type=int, default=0, metavar="W", help="W virtual ranks on this GPU")
    ap.add_argument("--ranks-per-node", type=int, default=0, metavar="L",
                    help="with --emulate: nodes of L virtual ranks, the hierarchical exchange across them (its "
                         "inter-node leg by pointer stores); prints each leg's rows per token from its device counters")
    ap.add_argument("--pair-reps", type=int, default=10, help="back-to-back pairs per steady-state sample")
    ap.add_argument("--profile", action="store_true", help="print rank 0's per-kernel GPU time of each symm provider")
    ap.add_argument("--no-rows", action="store_true", help="skip the row-form provider (rows_graph)")
    ap.add_argument("--no-regions", action="store_true",
                    help="skip the row form into a per-layer receive region (regions_graph; W > 1)")
    ap.add_argument("--json", default="bench_dispatch.json")
    _results.add_args(ap)
    args = ap.parse_args()
    rec = _results.Recorder("exchange", args, enabled=os.environ.get("RANK", "0") == "0",
                            world=_results.env_world())
    if args.emulate:
        return emulated(args, rec)

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    sync = lambda: (torch.cuda.synchronize(), dist.barrier())  # noqa: E731
    rows, symm_route = [], None
    for E in [int(v) for v in args.experts.split(",")]:
        if E % W:
            continue
        e = E // W
        for D in [int(v) for v in args.dims.split(",")]:
            for T in [int(v) for v in args.tokens.split(",")]:
                g = torch.Generator(device="cuda").manual_seed(1000 * r + T)
                x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
                logits = torch.randn(T, E, device="cuda", generator=g)
                gate, idx = torch.softmax(logits, -1).topk(K, dim=1)
                dest = idx // e
                others = (torch.arange(W, device="cuda") != r)
                mask_TW = torch.zeros(T, W, dtype=torch.bool, device="cuda").scatter_(1, dest, True)
                token_rows = int((mask_TW & others).sum())      # symm: a token once per other rank
                slot_rows = int((dest != r).sum())               # nccl: a row per (token, k) slot
                row_bytes = D * 2
                anchor = LocalDispatcher(E, validate=False) if W == 1 else AllToAllDispatcher(E, group, validate=False)
                symm = SymmDispatcher(E, group, max_tokens=T, capacity="exact", validate=False)
                symm_g = SymmDispatcher(E, group, buffers=None, max_tokens=T, capacity=2.0, validate=False)
                # correctness first: the same expert-major rows and the same output (to bf16 rounding)
                ra, ha = anchor.dispatch(x, idx, gate)
                rs, hs = symm.dispatch(x, idx, gate)
                assert torch.equal(rs, ra), "symm dispatch differs from the anchor"
                ya = anchor.combine_weighted(ra * 2, ha, gate)
                ys = symm.combine_weighted(rs * 2, hs, gate)
                torch.testing.assert_close(ys.float(), ya.float(), rtol=2 ** -7, atol=2 ** -7 * float(ya.abs().max()))
                provs = {
                    ("nccl" if W > 1 else "local"): (lambda: anchor.dispatch(x, idx, gate),
                                                     lambda: anchor.combine_weighted(ra, ha, gate), slot_rows),
                    "symm": (lambda: symm.dispatch(x, idx, gate), lambda: symm.combine_weighted(rs, hs, gate), token_rows),
                }
                provs["symm_graph"] = (*_graphs(symm_g, x, idx, gate), token_rows)
                if not args.no_rows:
                    rows_check(symm_g, x, idx, gate, ra, mask_TW.sum(1))
                    provs["rows_graph"] = (*_graphs_rows(symm_g, x, idx, gate), token_rows)
                symm_r = symm_c = None
                if not args.no_rows and not args.no_regions and W > 1:
                    # the row form into a per-layer receive region: the rows stay where they land
                    # SM stores (regions_graph) and copy engines (regions_ce_graph, the dense layout); the
                    # library's "auto" picks the latter from T_max >= 4096 where nearly every token
                    # reaches every peer (ExchangeConfig.copy_engine)
                    symm_r = SymmDispatcher(E, group, max_tokens=T, capacity=2.0, validate=False, row_regions=1,
                                            copy_engine=False)
                    rows_check(symm_r, x, idx, gate, ra, mask_TW.sum(1), region=0)
                    provs["regions_graph"] = (*_graphs_rows(symm_r, x, idx, gate, region=0), token_rows)
                    # (its own buffer set: ep_buffers would hand back symm_r's, whose mode is fixed at first use)
                    symm_c = SymmDispatcher(E, group, capacity=2.0, validate=False, row_regions=1, copy_engine=True,
                                            buffers=SymmBuffers(T, D, K, E, x.dtype, group, device=x.device,
                                                                row_regions=1))
                    rows_check(symm_c, x, idx, gate, ra, mask_TW.sum(1), region=0)
                    provs["regions_ce_graph"] = (*_graphs_rows(symm_c, x, idx, gate, region=0), token_rows)
                res = {}
                aligned = _aligned_sync(sync, symm_g) if W > 1 else None
                for name, (fd, fc, link_rows) in provs.items():
                    td = _median_ms(fd, args.iters, sync) / 1e3
                    tc = _median_ms(fc, args.iters, sync) / 1e3
                    tp = _pair_us(fd, fc, args.pair_reps, sync)
                    ss = dict(dispatch_stream_us=_stream_us(fd, args.pair_reps, sync),
                              combine_stream_us=_stream_us(fc, args.pair_reps, sync))
                    al = {}
                    if aligned is not None:
                        try:
                            al = dict(dispatch_aligned_us=_median_ms(fd, args.iters, aligned) * 1e3,
                                      combine_aligned_us=_median_ms(fc, args.iters, aligned) * 1e3)
                        except RuntimeError as exc:  # a torch whose handle barrier refuses the channel
                            print(f"aligned timing off: {exc}", flush=True)
                            aligned = None
                    if args.profile and name != "nccl" and name != "local":
                        prof = kernel_profile(lambda: (fd(), fc()), args.iters, sync, top=14, per="pair")
                        if r == 0:
                            print(f"\n{name} E={E} D={D} T={T} W={W}: per-kernel GPU time\n{prof}", flush=True)
                    res[name] = dict(provider=name, W=W, T=T, D=D, E=E, K=K, dispatch_us=td * 1e6, combine_us=tc * 1e6,
                                     pair_us=tp, **al, **ss,
                                     link_rows=link_rows,
                                     dispatch_link_GBps=link_rows * row_bytes / td / 1e9,
                                     combine_link_GBps=(token_rows if name != ("nccl" if W > 1 else "local") else slot_rows)
                                     * row_bytes / tc / 1e9)
                base = res["nccl" if W > 1 else "local"]
                for v in res.values():
                    v["ratio_vs_anchor"] = (base["dispatch_us"] + base["combine_us"]) / (v["dispatch_us"] + v["combine_us"])
                    v["pair_ratio_vs_anchor"] = base["pair_us"] / v["pair_us"]
                    rows.append(v)
                symm.check()
                symm_g.check()
                if symm_r is not None:
                    symm_r.check()
                    symm_r.buffers.close()  # its own buffer set (row regions): free it too
                if symm_c is not None:
                    symm_c.check()
                    symm_c.buffers.close()
                symm_route = symm.buffers
                symm.buffers.close()  # shared by both (ep_buffers): free this size before the next
                del provs, symm, symm_g
    if r == 0:
        route = getattr(symm_route, "backend", "?")
        _print(rows, f"W={W} ({'torchrun' if W > 1 else 'one process'}, symm backend: {route})")
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        _record(rec, rows)
    dist.destroy_process_group()
    return 0


def _record(rec, rows) -> None:
    """Each provider's dispatch, combine and back-to-back pair times (medians; no spread kept)."""
    for v in rows:
        shape = {k: v[k] for k in ("W", "T", "D", "E", "K")}
        for op in ("dispatch", "combine"):
            rec.row(op, v["provider"], shape, v[f"{op}_us"], unit="us", link_GBps=v[f"{op}_link_GBps"],
                    aligned_us=v.get(f"{op}_aligned_us"), stream_us=v.get(f"{op}_stream_us"),
                    link_rows=v["link_rows"], pair_vs_anchor=v["ratio_vs_anchor"])
        if "pair_us" in v:
            rec.row("pair", v["provider"], shape, v["pair_us"], unit="us", vs_anchor=v["pair_ratio_vs_anchor"])
    rec.write()


def emulated(args, rec) -> int:
    from tlx_dist.comm.emulated import EmulatedWorld

    W, rows = args.emulate, []
    sync = torch.cuda.synchronize
    for E in [int(v) for v in args.experts.split(",")]:
        for D in [int(v) for v in args.dims.split(",")]:
            for T in [int(v) for v in args.tokens.split(",")]:
                world = EmulatedWorld(W, T, D, K, E, torch.bfloat16, capacity=2.0, device="cuda",
                                      ranks_per_node=args.ranks_per_node or None)
                g = torch.Generator(device="cuda").manual_seed(T)
                xs = [torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(W)]
                gi = [torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(K, dim=1) for _ in range(W)]
                gates, idxs = [v[0] for v in gi], [v[1] for v in gi]
                out = world.dispatch(xs, idxs, gates)
                ys, hs = [o[0] for o in out], [o[1] for o in out]
                td = _median_ms(lambda: world.dispatch(xs, idxs, gates), args.iters, sync) / 1e3
                tc = _median_ms(lambda: world.combine(ys, hs), args.iters, sync) / 1e3
                tok = sum(int(h.rows_to_W.sum()) for h in hs)
                legs = {}
                if world.hierarchical:  # one dispatch + combine's rows per leg, per token of the world
                    world.reset_leg_counters()
                    world.combine(ys, [o[1] for o in world.dispatch(xs, idxs, gates)])
                    c = world.leg_counters()
                    legs = {f"{k}_per_token": sum(v[k] for v in c) / (W * T) for k in
                            ("dispatch_nic_rows", "dispatch_nvl_rows", "combine_nic_rows", "combine_nvl_rows")}
                    tok = sum(v["dispatch_nic_rows"] + v["dispatch_nvl_rows"] for v in c)
                name = f"emu{W}" + (f"x{args.ranks_per_node}h" if world.hierarchical else "")
                rows.append(dict(provider=name, W=W, T=T, D=D, E=E, K=K, dispatch_us=td * 1e6, combine_us=tc * 1e6,
                                 link_rows=tok, dispatch_link_GBps=tok * D * 2 / td / 1e9,
                                 combine_link_GBps=tok * D * 2 / tc / 1e9, ratio_vs_anchor=float("nan"), **legs))
                if legs:
                    print(f"{name} E={E} D={D} T={T} rows per token: " +
                          ", ".join(f"{k[:-10]} {v:.3f}" for k, v in legs.items()))
                world.check()
                world.close()
    _print(rows, f"emulated W={W} on one GPU (rows 'sent' are local HBM stores)")
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    _record(rec, rows)
    return 0


def _print(rows, title):
    print(f"\n{title}: medians; link GB/s = bytes sent to other ranks per second; x anchor = anchor time / time")
    print(f"{'provider':13} {'E':>4} {'D':>5} {'T':>6} {'disp us':>9} {'comb us':>9} {'disp GB/s':>10} "
          f"{'comb GB/s':>10} {'x anchor':>8} {'pair us':>9} {'x anchor':>8} {'disp al.':>9} {'comb al.':>9}"
          f" {'disp ss':>9} {'comb ss':>9}")
    nan = float("nan")
    for v in rows:
        print(f"{v['provider']:13} {v['E']:4d} {v['D']:5d} {v['T']:6d} {v['dispatch_us']:9.1f} {v['combine_us']:9.1f} "
              f"{v['dispatch_link_GBps']:10.1f} {v['combine_link_GBps']:10.1f} {v['ratio_vs_anchor']:8.2f}"
              f" {v.get('pair_us', nan):9.1f} {v.get('pair_ratio_vs_anchor', nan):8.2f}"
              f" {v.get('dispatch_aligned_us', nan):9.1f} {v.get('combine_aligned_us', nan):9.1f}"
              f" {v.get('dispatch_stream_us', nan):9.1f} {v.get('combine_stream_us', nan):9.1f}")


if __name__ == "__main__":
    sys.exit(main())
