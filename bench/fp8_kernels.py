"""The FP8 layer's memory-bound kernels at MoE shapes: time, bytes moved, effective bandwidth, and
(``--sweep``) their launch configs.

Outside its GEMMs the FP8 layer (tlx_dist/fp8/experts.py) runs plain-Triton passes whose speed is
the bytes they move. Per shape (bench/grouped_gemm.py SHAPES, ``counts_for`` balanced and Zipf
loads), T tokens (``--tokens``), N = T*K expert-major rows, medians of triton.testing.do_bench of
each wrapper on what the layer gives it (bf16 activations, fp32 gates, int64 slot indices):

  quantize_rows            x_TD [T, D] -> Fp8Rows (the FP8 dispatch quantizes the token rows)
  quantize_cols            x [N, D] -> Fp8Cols (the weight gradient's 128-row expert tiles)
  quantize_both            dy [N, D] -> both forms, one read (the backward's dy)
  quantize_cols_from_rows  the dispatched rows (unpack_rows(pack_rows(...))) -> Fp8Cols of x
  dequantize_rows_rounded  the dispatched rows -> x [N, D] bf16
  swiglu_quant_both        h [N, 2F] -> a = silu(gate) * up, both forms
  swiglu_bwd_quant_both    h [N, 2F], dA [N, F] -> dh, both forms
  combine_fwd              y [N, D], gate [T, K] -> [T, D]: the gate-weighted k-sum (_gather_ksum)
  combine_bwd              g [T, D], y, gate -> g_y [N, D], g_gate [T, K] (_combine_bwd)
  dispatch_bwd             g [N, D] -> [T, D]: the k-sum, the dispatch's backward (_gather_ksum)

Printed per kernel: ms, MB read and written (``bytes_moved``: each tensor once, from the shapes and
dtypes; E-sized offset vectors left out), GB/s and its fraction of ``--peak-gbs`` (default: the
anchor, a device-to-device copy ``torch.empty_like(x).copy_(x)`` of 1 GiB timed here). Then the
pairs the layer replaced, with their ratio: quantize_cols_from_rows vs
quantize_cols(dequantize_rows_rounded(rows)) (checked bit for bit); swiglu_quant_both vs the fp32
torch SwiGLU + quantize_both.

``--sweep``: each kernel launched through its wrapper with other meta-parameters (``_launch=``;
``SWEEP`` below, the wrappers' constants first, the default) at each shape on the first routing.
A candidate's outputs are compared with the default's before it is timed, bit for bit, except
combine_bwd's g_gate: an fp32 sum over D whose order follows the launch, held to twice the bound
of any summation order (2 * D * 2^-24 * sum_d |g y|) plus one rounding of the gate's dtype. A
candidate off (MISMATCH) or failing (ERROR) is reported and not timed, and the exit status is 1.
The 128 x 128-tile kernels (quantize_both, the SwiGLU ones) have no loop: num_stages does not apply.
Before each shape is timed its kernels, every candidate's included, are compiled in
``--compile-workers`` processes (bench/_precompile.py), the compile time spread over the host's cores.

    python bench/fp8_kernels.py [--shapes olmoe,qwen3-30b-a3b,mixtral] [--tokens 16384]
        [--routings balanced,zipf] [--kernels quantize_rows,...] [--sweep] [--peak-gbs GBS]
        [--rep 100] [--sweep-rep 25] [--compile-workers 16] [--no-results]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

import _results  # bench/_results.py (the script's directory is on sys.path)
from _precompile import Precompiler  # bench/_precompile.py
from grouped_gemm import SHAPES, T as T_DEFAULT, counts_for  # bench/grouped_gemm.py: the shape table, loads

G = 128  # the FP8 scale group (tlx_dist/fp8/quant.py GROUP)
ACT, Q8, S32, GATE, IDX = 2, 1, 4, 4, 8  # bytes: bf16 activation, e4m3 value, fp32 scale, fp32 gate, int64 index
KERNELS = ("quantize_rows", "quantize_cols", "quantize_both", "quantize_cols_from_rows", "dequantize_rows_rounded",
           "swiglu_quant_both", "swiglu_bwd_quant_both", "combine_fwd", "combine_bwd", "dispatch_bwd")
ROUTINGS = ("balanced", "zipf")
_ROWS = {"BLOCK_M": (16, 32, 64), "num_warps": (2, 4, 8, 16)}
_COLS = {"BLOCK_C": (32, 64, 128), "num_warps": (2, 4, 8, 16)}
_TILE = {"num_warps": (4, 8, 16)}  # 2 warps: 256 values of each fp32 128 x 128 tile a thread, past its 255 registers
_GATHER = {"BLOCK_R": (2, 4, 8), "BLOCK_D": (256, 512), "num_warps": (4, 8)}
# kernel -> the meta-parameter values its sweep tries (their product; the default is added first)
SWEEP = {"quantize_rows": _ROWS, "dequantize_rows_rounded": _ROWS, "quantize_cols": _COLS,
         "quantize_cols_from_rows": _COLS, "quantize_both": _TILE, "swiglu_quant_both": _TILE,
         "swiglu_bwd_quant_both": _TILE, "combine_fwd": _GATHER, "combine_bwd": _GATHER, "dispatch_bwd": _GATHER}


def default_launch(kernel: str) -> dict:
    """The wrapper's launch constants for ``kernel`` (what ``_launch=None`` launches)."""
    from tlx_dist.comm import local_combine as lc
    from tlx_dist.fp8 import quant as q, swiglu as s

    return dict({"quantize_rows": q._ROWS_LAUNCH, "dequantize_rows_rounded": q._DEQUANT_ROWS_LAUNCH,
                 "quantize_cols": q._COLS_LAUNCH, "quantize_cols_from_rows": q._COLS_FROM_ROWS_LAUNCH,
                 "quantize_both": q._BOTH_LAUNCH, "swiglu_quant_both": s._TILES_LAUNCH,
                 "swiglu_bwd_quant_both": s._BWD_TILES_LAUNCH, "combine_fwd": lc._KSUM_LAUNCH,
                 "combine_bwd": lc._COMBINE_BWD_LAUNCH, "dispatch_bwd": lc._KSUM_LAUNCH}[kernel])


def candidates(kernel: str) -> list[dict]:
    """Launch configs to time for ``kernel``: its default first, then every other combination of
    ``SWEEP[kernel]``'s values, each a full dict of the wrapper's meta-parameters."""
    default, axes = default_launch(kernel), SWEEP[kernel]
    out = [default]
    for combo in itertools.product(*axes.values()):
        c = {**default, **dict(zip(axes, combo))}
        if c not in out:
            out.append(c)
    return out


def label(launch: dict) -> str:  # "BLOCK_M=32 num_warps=4"
    return " ".join(f"{k}={v}" for k, v in launch.items())


def tiles_used(counts: list) -> int:
    """Expert-aligned 128-row tiles of these loads (the column forms' padded width / 128)."""
    return sum(-(-c // G) for c in counts)


def _rows_w(M: int, C: int) -> int:  # Fp8Rows: q [M, C] e4m3 + s [M, cdiv(C, G)] fp32
    return M * C * Q8 + M * -(-C // G) * S32


def _cols_w(C: int, n_tiles: int) -> int:  # Fp8Cols: q [C, G * tiles] e4m3 (zero past each expert) + s [tiles, C]
    return C * G * n_tiles * Q8 + n_tiles * C * S32


def bytes_moved(kernel: str, *, T: int, K: int, D: int, F: int, n_tiles: int) -> tuple[int, int]:
    """(bytes read, bytes written) of one call of ``kernel`` (module docstring): each tensor once."""
    N = T * K
    return {"quantize_rows": (T * D * ACT, _rows_w(T, D)),
            "quantize_cols": (N * D * ACT, _cols_w(D, n_tiles)),
            "quantize_both": (N * D * ACT, _rows_w(N, D) + _cols_w(D, n_tiles)),
            "quantize_cols_from_rows": (_rows_w(N, D), _cols_w(D, n_tiles)),
            "dequantize_rows_rounded": (_rows_w(N, D), N * D * ACT),
            "swiglu_quant_both": (N * 2 * F * ACT, _rows_w(N, F) + _cols_w(F, n_tiles)),
            "swiglu_bwd_quant_both": (N * 3 * F * ACT, _rows_w(N, 2 * F) + _cols_w(2 * F, n_tiles)),
            "combine_fwd": (N * D * ACT + N * (GATE + IDX), T * D * ACT),
            "combine_bwd": (T * D * ACT + N * D * ACT + N * (GATE + IDX), N * D * ACT + N * GATE),
            "dispatch_bwd": (N * D * ACT + N * IDX, T * D * ACT)}[kernel]


def mismatch(ref: tuple, out: tuple, bounds: dict | None = None) -> str:
    """'' when every output equals the default's bit for bit -- output i in ``bounds`` within
    ``bounds[i] + eps * |ref|`` (eps of its dtype: one rounding) -- else what differs."""
    if len(ref) != len(out):
        return f"{len(out)} outputs, the default gave {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, out)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {tuple(b.shape)} {b.dtype}, the default's {tuple(a.shape)} {a.dtype}"
        if bounds and i in bounds:
            lim = bounds[i] + torch.finfo(a.dtype).eps * a.float().abs()
            bad = int((~((b.float() - a.float()).abs() <= lim)).sum())  # NaN counts as off
            what = "beyond the summation-order bound"
        else:
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            bad = int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())
            what = "not bit-equal"
        if bad:
            return f"output {i}: {bad} of {a.numel()} values {what}"
    return ""


def run_sweep(call, extract, cands: list, time_ms, bounds: dict | None = None) -> list[dict]:
    """Each candidate launch (``cands[0]`` the default): ``{"launch", "ms", "error"}``; ``call(launch)``
    runs the kernel, ``extract`` takes the outputs to compare from its result, ``time_ms(fn)`` times
    ``fn``. A candidate whose outputs differ from the default's, or that fails, is not timed."""
    ref = extract(call(cands[0]))
    rows = []
    for launch in cands:
        try:
            why = mismatch(ref, extract(call(launch)), bounds)
            err = f"MISMATCH {why}" if why else ""
        except Exception as e:  # e.g. a config past the GPU's registers / shared memory
            err = f"ERROR {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        rows.append({"launch": launch, "ms": None if err else time_ms(lambda launch=launch: call(launch)),
                     "error": err})
    return rows


class Case:
    """One shape, token count and routing's inputs (random values: the kernels' time is their bytes).
    ``dims``: (D, F, E, K) in place of ``SHAPES[shape]``; ``device``: where (tests: CPU, interpreted)."""

    def __init__(self, shape: str, T: int, routing: str, dims: tuple | None = None, device: str = "cuda"):
        from tlx_dist.comm.dispatcher import inverse_permutation
        from tlx_dist.comm.layout import sort_slots
        from tlx_dist.fp8.dispatch import pack_rows, unpack_rows
        from tlx_dist.fp8.quant import quantize_rows

        self.shape, self.T, self.routing = shape, T, routing
        self.D, self.F, self.E, self.K = D, F, E, K = dims or SHAPES[shape]
        self.N = N = T * K
        dev, bf = device, torch.bfloat16
        torch.manual_seed(0)
        self.counts = counts_for(N, E, routing)
        self.n_tiles = tiles_used(self.counts)
        self.off = torch.tensor(self.counts, device=dev).cumsum(0).to(torch.int32)
        self.x_TD = torch.randn(T, D, device=dev, dtype=bf)
        self.x = torch.randn(N, D, device=dev, dtype=bf)
        self.rows = unpack_rows(pack_rows(quantize_rows(self.x), bf), D)  # as an FP8 dispatch delivers them
        self.dy = torch.randn(N, D, device=dev, dtype=bf)
        self.y = self.dy  # the expert outputs the combine reads: [N, D] bf16
        self.h = torch.randn(N, 2 * F, device=dev, dtype=bf)
        self.dA = torch.randn(N, F, device=dev, dtype=bf)
        # slots of the loads in a random order -> the single-rank dispatch's permutation
        expert_S = torch.repeat_interleave(torch.arange(E, device=dev), torch.tensor(self.counts, device=dev))
        slots = sort_slots(expert_S[torch.randperm(N, device=dev)].view(T, K), E)
        self.order, self.inverse = slots.order_S, inverse_permutation(slots.order_S)
        self.gate = torch.rand(T, K, device=dev)
        self.g_TD = torch.randn(T, D, device=dev, dtype=bf)

    def head(self) -> str:
        return (f"{self.shape} T={self.T} {self.routing}: N={self.N} D={self.D} F={self.F} E={self.E} K={self.K}, "
                f"{self.n_tiles} expert tiles")

    def info(self) -> dict:
        return {"shape": self.shape, "routing": self.routing, "T": self.T, "N": self.N, "D": self.D, "F": self.F,
                "E": self.E, "K": self.K, "tiles": self.n_tiles}

    def ops(self) -> dict:
        """kernel -> (call(launch), extract(result) -> the outputs a sweep compares, () -> their bounds
        for :func:`mismatch`)."""
        from tlx_dist.comm.local_combine import _combine_bwd, _gather_ksum
        from tlx_dist.fp8 import quant as q, swiglu as s

        bf, n, T, K = torch.bfloat16, self.n_tiles, self.T, self.K

        def rows(r):
            return r.q_MC.view(torch.uint8), r.s_MCb

        def cols(c):  # the written part: the experts' tiles (slack tiles past them are left unwritten)
            return c.q_CP.view(torch.uint8)[:, :G * n], c.s_TC[:n]

        def both(r, c):
            return rows(r) + cols(c)

        return {
            "quantize_rows": (lambda L: q.quantize_rows(self.x_TD, _launch=L), rows, dict),
            "quantize_cols": (lambda L: q.quantize_cols(self.x, self.off, _launch=L), cols, dict),
            "quantize_both": (lambda L: q.quantize_both(self.dy, self.off, _launch=L), lambda o: both(*o), dict),
            "quantize_cols_from_rows": (lambda L: q.quantize_cols_from_rows(self.rows, self.off, dtype=bf, _launch=L),
                                        cols, dict),
            "dequantize_rows_rounded": (lambda L: q.dequantize_rows_rounded(self.rows, bf, _launch=L),
                                        lambda o: (o,), dict),
            "swiglu_quant_both": (lambda L: s.swiglu_quant_both(self.h, self.off, _launch=L),
                                  lambda o: both(*o[1:]), dict),
            "swiglu_bwd_quant_both": (lambda L: s.swiglu_bwd_quant_both(self.h, self.dA, self.off, _launch=L),
                                      lambda o: both(*o[1:]), dict),
            "combine_fwd": (lambda L: _gather_ksum(self.y, self.gate, self.inverse, T, K, _launch=L),
                            lambda o: (o,), dict),
            "combine_bwd": (lambda L: _combine_bwd(self.g_TD, self.y, self.gate, self.order, _launch=L),
                            tuple, lambda: {1: self.g_gate_bound()}),
            "dispatch_bwd": (lambda L: _gather_ksum(self.y, None, self.inverse, T, K, _launch=L),
                             lambda o: (o,), dict),
        }

    def g_gate_bound(self) -> torch.Tensor:
        """[T, K]: 2 * D * 2^-24 * sum_d |g[t] y[n]| at slot s = order[n]: two fp32 summation orders of
        the D products differ by at most this (each within (D - 1) u sum |terms| of the exact sum)."""
        t_N = torch.div(self.order, self.K, rounding_mode="floor")
        mag = (self.g_TD.index_select(0, t_N).float().abs() * self.y.float().abs()).sum(1)
        out = torch.empty(self.N, device=mag.device)
        out[self.order] = 2 * self.D * 2.0 ** -24 * mag
        return out.view(self.T, self.K)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"names from bench/grouped_gemm.py: {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default=str(T_DEFAULT), help="token counts T, comma-separated (N = T * K rows)")
    ap.add_argument("--routings", default=",".join(ROUTINGS), help="expert loads: balanced, zipf (the sweep: the first)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="a subset of " + ", ".join(KERNELS))
    ap.add_argument("--sweep", action="store_true", help="also time each kernel's candidate launch configs")
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="the bandwidth the fractions are of (default: the device-to-device copy measured here)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) of the kernel table")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms) of the kernel table")
    ap.add_argument("--sweep-rep", type=int, default=25, help="do_bench rep (ms) of each sweep candidate")
    ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes compiling each shape's kernels before it is timed (bench/_precompile.py; "
                         "0: each compiles at its first call)")
    _results.add_args(ap)
    args = ap.parse_args(argv)

    def names(opt: str, known) -> list:
        got = [v for v in getattr(args, opt.replace("-", "_")).split(",") if v]
        bad = [v for v in got if v not in known]
        if bad or not got:
            ap.error(f"--{opt}: {bad or 'nothing'} not among {', '.join(known)}")
        return got

    args.shapes, args.routings, args.kernels = names("shapes", SHAPES), names("routings", ROUTINGS), names(
        "kernels", KERNELS)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens={args.tokens!r} must be comma-separated integers")
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens={args.tokens} must be positive")
    if args.peak_gbs is not None and not args.peak_gbs > 0:
        ap.error(f"--peak-gbs={args.peak_gbs} must be positive")
    for opt, least in (("rep", 1), ("warmup", 1), ("sweep_rep", 1), ("compile_workers", 0)):
        if getattr(args, opt) < least:
            ap.error(f"--{opt.replace('_', '-')}={getattr(args, opt)} must be >= {least}")
    return args


def cuda_missing() -> str:
    """Why this machine cannot run the bench ('' when it can)."""
    ok = torch.cuda.is_available()
    return "" if ok else "bench/fp8_kernels.py times Triton kernels on a CUDA GPU; torch.cuda.is_available() is False here"


def measure(args, rec) -> int:
    """Runs the tables (module docstring) and records their rows; returns the exit status."""
    import triton

    def bench(fn, rep=args.rep, warmup=args.warmup) -> float:
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    t0 = time.time()
    big = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    copy_ms = bench(lambda: torch.empty_like(big).copy_(big))
    copy_gbs = 2 * big.numel() / copy_ms * 1e-6
    del big
    peak = args.peak_gbs or copy_gbs
    print(f"anchor: device-to-device copy of 1 GiB (empty_like(x).copy_(x)): {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s; "
          f"fractions below are of {peak:.0f} GB/s ({'--peak-gbs' if args.peak_gbs else 'the copy'})")
    rec.row("d2d_copy", "torch", {"bytes": 1 << 30}, copy_gbs, unit="GB/s", ms=copy_ms, peak_gbs=peak)
    failed, best, pre = 0, [], Precompiler(args.compile_workers)
    try:
        for shape, T in itertools.product(args.shapes, args.tokens):
            for ri, routing in enumerate(args.routings):
                failed, best = _case(args, Case(shape, T, routing), ri == 0 and args.sweep, bench, peak, pre, rec,
                                     failed, best)
                torch.cuda.empty_cache()
    finally:
        pre.close()
    if best:
        print("\n## sweep summary: each kernel's fastest config per shape\n\n"
              "| kernel | shape | default | fastest | default ms / fastest ms |\n|---|---|---|---|---|")
        for k, head, d, b, ratio in best:
            print(f"| {k} | {head} | {label(d)} | {label(b)} | {ratio:.3f} |")
    print(f"\nwall: {time.time() - t0:.0f} s" + (f"; {failed} launch configs or pairs did not match (above)"
                                                  if failed else ""))
    return 1 if failed else 0


def _case(args, c: Case, sweep: bool, bench, peak: float, pre: Precompiler, rec, failed: int, best: list):
    """One case's kernel table, pairs and (``sweep``) sweep tables; returns the updated (failed, best)."""
    from tlx_dist.fp8.quant import tile_grid

    ops = c.ops()
    tile_grid(c.off, c.N)  # the tile kernels' offsets prep, run for real before record() (bench/_precompile.py)
    t0 = time.time()

    def every_launch():  # each default launch, and each candidate's when sweeping
        for k in args.kernels:
            for launch in candidates(k) if sweep else [None]:
                ops[k][0](launch)

    specs = pre.record(every_launch)
    bad = pre.compile(specs)
    torch.cuda.synchronize()
    print(f"\n{len(specs)} kernels precompiled by {pre.workers} workers" if pre.workers else "\nfirst calls",
          f"in {time.time() - t0:.1f} s" + (f" ({bad} failed there, they compile here; first: {pre.errors[-bad][0]}: "
                                            f"{str(pre.errors[-bad][1])[:160]})" if bad else ""))
    print(f"\n## {c.head()}\n\n| kernel | ms | MB read | MB written | GB/s | of peak |\n|---|---|---|---|---|---|")
    ms = {}
    for k in args.kernels:
        call = ops[k][0]
        ms[k] = bench(lambda call=call: call(None))
        r, w = bytes_moved(k, T=c.T, K=c.K, D=c.D, F=c.F, n_tiles=c.n_tiles)
        gbs = (r + w) / ms[k] * 1e-6
        print(f"| {k} | {ms[k]:.4f} | {r / 1e6:.1f} | {w / 1e6:.1f} | {gbs:.0f} | {gbs / peak:.3f} |")
        rec.row(k, "tlx_dist", c.info(), ms[k], bytes_read=r, bytes_written=w, gbs=gbs, of_peak=gbs / peak,
                peak_gbs=peak, launch=default_launch(k))
    failed += _pairs(c, ops, bench, ms, rec)
    for k in args.kernels if sweep else []:
        f, b = _sweep_table(c, k, ops[k], lambda fn: bench(fn, rep=args.sweep_rep, warmup=5), rec)
        failed, best = failed + f, best + [b]
    return failed, best


def _pairs(c: Case, ops: dict, bench, ms: dict, rec) -> int:
    """The anchor pairs (module docstring); returns how many did not match."""
    import torch.nn.functional as F

    from tlx_dist.fp8 import quant as q

    bf, pairs, bad = torch.bfloat16, [], 0
    if "quantize_cols_from_rows" in ms:
        fused = q.quantize_cols_from_rows(c.rows, c.off, dtype=bf)
        two = q.quantize_cols(q.dequantize_rows_rounded(c.rows, bf), c.off)
        cols = ops["quantize_cols"][1]
        why = mismatch(cols(fused), cols(two))
        del fused, two
        bad += bool(why)
        pairs.append(("quantize_cols_from_rows", "quantize_cols(dequantize_rows_rounded(rows))",
                      bench(lambda: q.quantize_cols(q.dequantize_rows_rounded(c.rows, bf), c.off)), why))
    if "swiglu_quant_both" in ms:
        def torch_swiglu_both():
            a = (F.silu(c.h[:, :c.F].float()) * c.h[:, c.F:].float()).to(bf)
            return q.quantize_both(a, c.off)

        pairs.append(("swiglu_quant_both", "torch SwiGLU (fp32) + quantize_both", bench(torch_swiglu_both), ""))
    if pairs:
        print("\n| fused | anchor (what it replaced) | fused ms | anchor ms | anchor / fused |\n|---|---|---|---|---|")
    for k, name, a_ms, why in pairs:
        print(f"| {k} | {name} | {ms[k]:.4f} | {a_ms:.4f} | {a_ms / ms[k]:.2f} |" + (f" MISMATCH {why}" if why else ""))
        rec.row(k, f"anchor: {name}", c.info(), a_ms, fused_ms=ms[k], anchor_vs_fused=a_ms / ms[k], mismatch=why)
    return bad


def _sweep_table(c: Case, k: str, op, time_ms, rec) -> tuple[int, tuple]:
    call, extract, bounds = op
    rows = run_sweep(call, extract, candidates(k), time_ms, bounds())
    r, w = bytes_moved(k, T=c.T, K=c.K, D=c.D, F=c.F, n_tiles=c.n_tiles)
    d_ms = rows[0]["ms"]
    print(f"\n### sweep {k}: {c.head()}\n\n| config | ms | GB/s | default ms / ms |\n|---|---|---|---|")
    for i, row in enumerate(rows):
        name = label(row["launch"]) + (" (default)" if i == 0 else "")
        if row["ms"] is None:
            print(f"| {name} | {row['error']} | | |")
        else:
            print(f"| {name} | {row['ms']:.4f} | {(r + w) / row['ms'] * 1e-6:.0f} | "
                  f"{d_ms / row['ms'] if d_ms else float('nan'):.3f} |")
        rec.row(k, "sweep", c.info(), row["ms"], launch=row["launch"], default=i == 0, error=row["error"],
                gbs=(r + w) / row["ms"] * 1e-6 if row["ms"] else None,
                vs_default=d_ms / row["ms"] if row["ms"] and d_ms else None)
    timed = [row for row in rows if row["ms"] is not None]
    fast = min(timed, key=lambda row: row["ms"]) if timed else rows[0]
    ratio = d_ms / fast["ms"] if d_ms and fast["ms"] else float("nan")
    return sum(bool(row["error"]) for row in rows), (k, f"{c.shape} T={c.T}", rows[0]["launch"], fast["launch"], ratio)


def main(argv=None) -> int:
    args = parse_args(argv)
    why = cuda_missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    rec = _results.Recorder("fp8_kernels", args)
    try:
        rc = measure(args, rec)
    except BaseException:
        rec.close()
        raise
    rec.write()
    return rc


if __name__ == "__main__":
    sys.exit(main())
