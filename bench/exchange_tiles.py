"""Launch-shape sweep of the exchange's row-moving kernels (send, reduce_send, reduce_recv).

Run under torchrun on real ranks (W >= 2; the launch shape that moves rows fastest over the link is
what this looks for, so the emulated world is no guide):

    torchrun --nproc-per-node=2 bench/exchange_tiles.py [--tokens 4096,16384] [--dim 7168] [--experts 64]

For each candidate (an :class:`tlx_dist.comm.ExchangeConfig` in ``--configs`` syntax, see ``parse``:
rows x columns per tile, warps, programs per SM, tokens per route block, the combine's and the copy
engines' settings; ``default`` = what the library launches today) the row-form dispatch into a
per-layer receive region and its combine (what the fused EP pipeline runs) are captured in CUDA
graphs and replayed; each op's median over ``--iters`` replays, the ranks aligned on the device
before each, and the bytes this rank sends to other ranks per second. Each shape is first checked
against the all-to-all anchor (same rows, same combine), so a shape that breaks the kernels fails
loudly instead of timing garbage; ``x first`` = the first candidate's dispatch + combine time over
this one's (the grid starts with ``default``). ``--configs "send:8x512w4p4,reduce_send:8x1024w8p2;..."`` sets
the shapes to try (``;`` between candidates, ``default`` for none); without it a built-in grid.
``--timeline`` also prints rank 0's GPU timeline (kernels and copies on every stream, ``_profile.gpu_timeline``)
of one dispatch and one combine per candidate: where an op's time goes when its parts run on several streams.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from tlx_dist.comm import ExchangeConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from _profile import gpu_timeline  # noqa: E402
from dispatch import K, _aligned_sync, _graphs_rows, _median_ms, rows_check  # noqa: E402

_SHAPE = re.compile(r"^(\d+)x(\d+)(?:w(\d+))?(?:p(\d+))?$")
KINDS = ("send", "reduce_send", "reduce_recv", "expand")

# rows x cols, warps, programs per SM; the send and both reduce kernels take the same shape
GRID = ["default", "send:4x1024w4p8,reduce_send:8x1024w8p8", "send:2x2048w4p8,reduce_send:4x1024w4p16",
        "send:8x512w4p8,reduce_send:8x512w8p8",
        "route:16", "route:32", "route:64"]


def parse(spec: str) -> ExchangeConfig:
    """One ``--configs`` candidate as the :class:`ExchangeConfig` it runs: ``"default"`` ->
    ``ExchangeConfig()``; ``"8x512w4p4"`` -> that :class:`Tile` (rows x columns, warps, programs
    per SM) for send / reduce_send / reduce_recv; ``"send:8x512w4,route:16,..."`` -> per kernel
    (``route:N``: N tokens per route block; ``comb:after`` / ``comb:overlap``: ``comb_overlap``
    off / on; ``comb_recv:RxS``: the one-launch combine's summing and sending programs per SM;
    ``ce:on`` / ``ce:off``: ``copy_engine``; ``ce_chunk:N`` / ``ce_tail:N``: rows per copy-engine
    combine copy / of its last cut; ``ce_sum:N``: its summing programs per SM). A warp or
    programs-per-SM count left out keeps the kernel's default."""
    if spec == "default":
        return ExchangeConfig()
    ch = {}
    for part in spec.split(","):
        kind, _, shape = part.rpartition(":")
        if kind == "comb":
            if shape not in ("after", "overlap"):
                raise ValueError(f"--configs: comb:{shape!r} must be after or overlap")
            ch["comb_overlap"] = "off" if shape == "after" else "on"
            continue
        if kind == "ce":
            if shape not in ("on", "off"):
                raise ValueError(f"--configs: ce:{shape!r} must be on or off")
            ch["copy_engine"] = shape
            continue
        if kind in ("ce_chunk", "ce_tail"):
            if not shape.isdigit() or int(shape) < 32 or int(shape) % 32:
                raise ValueError(f"--configs: {kind}:{shape!r} must be a multiple of 32 (rows per copy)")
            ch["ce_chunk_rows" if kind == "ce_chunk" else "ce_tail_rows"] = int(shape)
            continue
        if kind == "ce_sum":
            if not shape.isdigit() or not 1 <= int(shape) <= 8:
                raise ValueError(f"--configs: ce_sum:{shape!r} must be 1 to 8 (summing programs per SM)")
            ch["ce_sum_per_sm"] = int(shape)
            continue
        if kind == "comb_recv":  # the one-launch combine: summing / sending programs per SM
            m = re.match(r"^(\d+)x(\d+)$", shape)
            if not m:
                raise ValueError(f"--configs: comb_recv:{shape!r} must be RxS (summing x sending programs per SM)")
            ch.update(comb_sum_per_sm=int(m.group(1)), comb_send_per_sm=int(m.group(2)))
            continue
        if kind == "route":
            if not shape.isdigit() or int(shape) < 1 or int(shape) & (int(shape) - 1):
                raise ValueError(f"--configs: route:{shape!r} must be a power of two (tokens per route block)")
            ch["route_block"] = int(shape)
            continue
        m = _SHAPE.match(shape)
        if not m:
            raise ValueError(f"--configs: bad shape {shape!r} (want ROWSxCOLS[wWARPS][pPER_SM])")
        br, bd, w, p = (int(v) if v else None for v in m.groups())
        if br & (br - 1) or bd & (bd - 1):
            raise ValueError(f"--configs: {shape!r}: rows and columns must be powers of two")
        for k in ([kind] if kind else ("send", "reduce_send", "reduce_recv")):
            if k not in KINDS:
                raise ValueError(f"--configs: unknown kernel {k!r} (one of {', '.join(KINDS)})")
            ch[k] = dict(rows=br, cols=bd, **({"warps": w} if w else {}), **({"per_sm": p} if p else {}))
    return ExchangeConfig.from_dict(ch, prefix="--configs")  # (a tile's left-out fields: the kernel's defaults)


def main() -> int:
    import torch.distributed as dist

    from tlx_dist.comm import AllToAllDispatcher, SymmDispatcher

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,4096,16384")
    ap.add_argument("--dim", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", default=";".join(GRID))
    ap.add_argument("--json", default="bench_exchange_tiles.json")
    ap.add_argument("--timeline", action="store_true",
                    help="print rank 0's GPU timeline (every stream) of one dispatch and one combine per config")
    _results.add_args(ap)
    args = ap.parse_args()
    specs = args.configs.split(";")
    configs = [parse(s) for s in specs]  # bad specs fail before any process group exists
    rec = _results.Recorder("exchange", args, enabled=os.environ.get("RANK", "0") == "0",
                            world=_results.env_world())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W, r = dist.get_world_size(), dist.get_rank()
    if W < 2:
        raise SystemExit("bench/exchange_tiles.py needs real ranks: torchrun --nproc-per-node=2 (or more)")
    group = dist.group.WORLD
    sync = lambda: (torch.cuda.synchronize(), dist.barrier())  # noqa: E731
    E, D = args.experts, args.dim
    e = E // W
    rows = []
    for T in [int(v) for v in args.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(1000 * r + T)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        gate, idx = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(K, dim=1)
        mask_TW = torch.zeros(T, W, dtype=torch.bool, device="cuda").scatter_(1, idx // e, True)
        others = torch.arange(W, device="cuda") != r
        token_rows = int((mask_TW & others).sum())
        anchor = AllToAllDispatcher(E, group, validate=False)
        ra, _ = anchor.dispatch(x, idx, gate)
        disp = SymmDispatcher(E, group, max_tokens=T, capacity=2.0, validate=False, row_regions=1)
        disp._buffers_for(x, K)  # (collective) the buffers exist before the first spec sets their config
        aligned = _aligned_sync(sync, disp) or sync
        base = None
        for spec, cfg in zip(specs, configs):
            disp.buffers.reconfigure(cfg)  # every rank runs the same specs, between ops
            rows_check(disp, x, idx, gate, ra, mask_TW.sum(1), region=0)
            fd, fc = _graphs_rows(disp, x, idx, gate, region=0)
            td = _median_ms(fd, args.iters, aligned) * 1e3
            tc = _median_ms(fc, args.iters, aligned) * 1e3
            disp.check()
            if args.timeline:
                for name, fn in (("dispatch", fd), ("combine", fc)):
                    text = gpu_timeline(fn, 7, aligned)
                    if r == 0:
                        print(f"-- {spec} T={T} {name} timeline\n{text}", flush=True)
            row = dict(config=spec, W=W, T=T, D=D, E=E, K=K, dispatch_us=td, combine_us=tc,
                       dispatch_GBps=token_rows * D * 2 / td / 1e3, combine_GBps=token_rows * D * 2 / tc / 1e3)
            base = base or row
            row["pair_vs_first"] = (base["dispatch_us"] + base["combine_us"]) / (td + tc)
            rows.append(row)
            if r == 0:
                print(f"{spec:>24} T={T:6d}  disp {td:8.1f} us {row['dispatch_GBps']:6.1f} GB/s   "
                      f"comb {tc:8.1f} us {row['combine_GBps']:6.1f} GB/s   x first {row['pair_vs_first']:.3f}",
                      flush=True)
        disp.buffers.close()
    if r == 0:
        print(f"\nW={W} E={E} D={D} K={K}, row form into a receive region, graph-replayed, ranks aligned")
        print("| config | T | disp us | disp GB/s | comb us | comb GB/s | x first |\n|---|---|---|---|---|---|---|")
        for v in rows:
            print(f"| {v['config']} | {v['T']} | {v['dispatch_us']:.1f} | {v['dispatch_GBps']:.1f} | "
                  f"{v['combine_us']:.1f} | {v['combine_GBps']:.1f} | {v['pair_vs_first']:.3f} |")
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        for v in rows:  # medians over --iters replays: no spread kept; provider = the launch-shape spec
            shape = {k: v[k] for k in ("W", "T", "D", "E", "K")}
            for op in ("dispatch", "combine"):
                rec.row(op, v["config"], shape, v[f"{op}_us"], unit="us", link_GBps=v[f"{op}_GBps"],
                        pair_vs_first=v["pair_vs_first"])
        rec.write()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
