"""bench/fp8_kernels.py on CPU (the bench itself needs a GPU): its command line, the bytes-moved
model (exact numbers for a small shape, worked by hand), the sweep's candidate lists and its
check of each candidate against the default (stub launchers: a config whose outputs differ, bit
for bit or past the summation-order bound, is reported and not timed), the inputs it builds,
``--no-results``, the CPU-only exit, and the wrappers' ``_launch=`` plumbing (grouped_gemm/host.py
``launch_meta``); on the real kernels, under the interpreter in a child process
(tests/fp8_kernels_bench_interpreted_cases.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fp8_kernels as B  # noqa: E402
import grouped_gemm  # noqa: E402

from _interp import run_interpreted_suite  # noqa: E402
from tlx_dist.fp8.quant import tile_cum_ref  # noqa: E402
from tlx_dist.grouped_gemm.host import launch_meta  # noqa: E402


# --- command line ------------------------------------------------------------------------------------


def test_defaults_and_the_shared_shape_table():
    a = B.parse_args([])
    assert B.SHAPES is grouped_gemm.SHAPES and B.counts_for is grouped_gemm.counts_for  # reused, not copied
    assert a.shapes == list(grouped_gemm.SHAPES) and a.tokens == [grouped_gemm.T] == [16384]
    assert a.routings == ["balanced", "zipf"] and a.kernels == list(B.KERNELS)
    assert not a.sweep and a.peak_gbs is None and not a.no_results
    a = B.parse_args(["--shapes", "olmoe,mixtral", "--tokens", "4096,16384", "--routings", "zipf", "--sweep",
                      "--kernels", "combine_bwd", "--peak-gbs", "4000", "--no-results"])
    assert (a.shapes, a.tokens, a.routings, a.kernels) == (["olmoe", "mixtral"], [4096, 16384], ["zipf"],
                                                           ["combine_bwd"])
    assert a.sweep and a.peak_gbs == 4000.0 and a.no_results


@pytest.mark.parametrize("argv, names", [
    (["--shapes", "olmoe,llama"], "--shapes: ['llama']"),
    (["--routings", "uniform"], "--routings: ['uniform']"),
    (["--kernels", "quantize_weight"], "--kernels: ['quantize_weight']"),
    (["--kernels", ""], "--kernels: nothing"),
    (["--tokens", "16k"], "--tokens='16k'"),
    (["--tokens", "0"], "--tokens=[0]"),
    (["--peak-gbs", "-1"], "--peak-gbs=-1.0"),
    (["--sweep-rep", "0"], "--sweep-rep=0 must be >= 1"),
    (["--compile-workers", "-1"], "--compile-workers=-1 must be >= 0"),
])
def test_bad_arguments_name_the_option(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        B.parse_args(argv)
    assert e.value.code == 2 and names in capsys.readouterr().err


# --- bytes moved -------------------------------------------------------------------------------------


def test_bytes_moved_of_a_small_shape_by_hand():
    # T = 4 tokens, K = 2 (N = 8 rows), D = 256 (2 scale groups), F = 128, expert loads [3, 5]: 2 tiles.
    # rows(M, C) = M*C (e4m3) + 4*M*cdiv(C, 128) (fp32 scales); cols(C) = C*128*tiles + 4*tiles*C.
    rows_4x256 = 4 * 256 + 4 * 4 * 2  # 1056
    rows_8x256 = 8 * 256 + 4 * 8 * 2  # 2112
    rows_8x128 = 8 * 128 + 4 * 8 * 1  # 1056
    cols_256 = 256 * 128 * 2 + 4 * 2 * 256  # 67584
    cols_128 = 128 * 128 * 2 + 4 * 2 * 128  # 33792
    want = {
        "quantize_rows": (4 * 256 * 2, rows_4x256),  # x_TD, the token rows
        "quantize_cols": (8 * 256 * 2, cols_256),
        "quantize_both": (8 * 256 * 2, rows_8x256 + cols_256),
        "quantize_cols_from_rows": (rows_8x256, cols_256),
        "dequantize_rows_rounded": (rows_8x256, 8 * 256 * 2),
        "swiglu_quant_both": (8 * 256 * 2, rows_8x128 + cols_128),  # h [8, 2F] bf16 in
        "swiglu_bwd_quant_both": (8 * 256 * 2 + 8 * 128 * 2, rows_8x256 + cols_256),  # h and dA in, dh [8, 2F] out
        "combine_fwd": (8 * 256 * 2 + 8 * 4 + 8 * 8, 4 * 256 * 2),  # y, fp32 gates, int64 inverse
        "combine_bwd": (4 * 256 * 2 + 8 * 256 * 2 + 8 * 4 + 8 * 8, 8 * 256 * 2 + 8 * 4),  # g, y, gate, order
        "dispatch_bwd": (8 * 256 * 2 + 8 * 8, 4 * 256 * 2),
    }
    assert set(want) == set(B.KERNELS)
    for k, rw in want.items():
        assert B.bytes_moved(k, T=4, K=2, D=256, F=128, n_tiles=B.tiles_used([3, 5])) == rw, k
    assert want["quantize_both"] == (4096, 69696) and want["combine_bwd"] == (6240, 4128)


@pytest.mark.parametrize("counts", [[3, 5], [0, 128, 129, 1], [256], [0, 0, 7]])
def test_tiles_are_the_quantizers_tiles(counts):
    # zero-row experts own no tile, 129 rows take two: the width the column form writes
    N = sum(counts)
    _, tile_cum = tile_cum_ref(torch.tensor(counts).cumsum(0), N)
    assert B.tiles_used(counts) == int(tile_cum[len(counts) - 1])


# --- the sweep's candidates and its check ------------------------------------------------------------


@pytest.mark.parametrize("kernel", B.KERNELS)
def test_candidates_start_at_the_default_and_cover_the_grid_once(kernel):
    cands = B.candidates(kernel)
    default = B.default_launch(kernel)
    assert cands[0] == default
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)  # no config twice
    assert len(cands) == math.prod(len(v) for v in B.SWEEP[kernel].values())  # the default is in the grid
    assert all(c.keys() == default.keys() for c in cands)  # every meta-parameter named in each
    assert {c["num_warps"] for c in cands} == set(B.SWEEP[kernel]["num_warps"])
    if kernel == "quantize_cols_from_rows":
        assert all(128 % c["BLOCK_C"] == 0 for c in cands)  # the kernel refuses a block splitting a scale group
    default["num_warps"] = 99  # a copy: the wrapper's constants stay
    assert B.default_launch(kernel)["num_warps"] != 99


def test_tile_kernels_sweep_warps_only():
    for k in ("quantize_both", "swiglu_quant_both", "swiglu_bwd_quant_both"):
        c = B.candidates(k)
        assert c[0] == B.default_launch(k) and sorted(x["num_warps"] for x in c) == [4, 8, 16]
        assert all(set(x) == {"num_warps"} for x in c)


def test_mismatch_is_bitwise_and_bounded_where_asked():
    z = torch.zeros(4, dtype=torch.bfloat16)
    assert B.mismatch((z,), (z.clone(),)) == ""
    neg = z.clone()
    neg[2] = -0.0  # equal as a number, another bit pattern
    assert B.mismatch((z,), (neg,)) == "output 0: 1 of 4 values not bit-equal"
    nan = torch.full((3,), float("nan"))
    assert B.mismatch((nan,), (nan.clone(),)) == ""  # the same NaN bits
    assert B.mismatch((z,), (z, z)) == "2 outputs, the default gave 1"
    assert "torch.float32" in B.mismatch((z,), (z.float(),))
    ref = torch.tensor([1.0, 2.0, 3.0])
    bound = {0: torch.tensor([0.1, 0.1, 0.0])}
    ulp3 = 2.0 ** -22  # fp32 spacing at 3.0; eps * 3 = 1.5 of it
    assert B.mismatch((ref,), (torch.tensor([1.05, 2.0, 3.0 + ulp3]),), bound) == ""
    assert B.mismatch((ref,), (torch.tensor([1.0, 2.2, 3.0]),), bound) == \
        "output 0: 1 of 3 values beyond the summation-order bound"
    assert B.mismatch((ref,), (torch.tensor([1.0, 2.0, 3.0 + 2 * ulp3]),), bound) != ""
    assert B.mismatch((ref,), (torch.tensor([1.0, float("nan"), 3.0]),), bound) != ""


def test_a_wrong_or_failing_config_is_reported_and_not_timed():
    cands = [{"num_warps": 8}, {"num_warps": 2}, {"num_warps": 4}, {"num_warps": 16}]
    ran = []

    def call(launch):
        ran.append(launch["num_warps"])
        if launch["num_warps"] == 16:
            raise RuntimeError("out of resources: shared memory, Required: 300000\nmore detail")
        x = torch.arange(8, dtype=torch.float32)
        if launch["num_warps"] == 2:
            x[5] = torch.nextafter(x[5], torch.tensor(9.0))  # one unit in the last place
        return x

    timed = []
    rows = B.run_sweep(call, lambda o: (o,), cands, lambda fn: (timed.append(fn()), 0.25)[1])
    assert [r["launch"] for r in rows] == cands
    assert [r["ms"] for r in rows] == [0.25, None, 0.25, None]
    assert rows[1]["error"] == "MISMATCH output 0: 1 of 8 values not bit-equal"
    assert rows[3]["error"] == "ERROR RuntimeError: out of resources: shared memory, Required: 300000"
    assert rows[0]["error"] == rows[2]["error"] == ""
    assert [int(t[1]) for t in timed] == [1, 1]  # only the matching configs were timed, each its own launch
    assert ran[:1] == [8]  # the default ran first: the reference


def test_g_gate_bound_covers_another_summation_order():
    # the bench's inputs, built on CPU; g_gate summed in two orders (pairwise, sequential from the end)
    c = B.Case("wide", 64, "zipf", dims=(4096, 128, 8, 2), device="cpu")
    t_N = torch.div(c.order, c.K, rounding_mode="floor")
    prod = c.g_TD.index_select(0, t_N).float() * c.y.float()  # [N, D] fp32 products, as the kernel forms them
    ggate = [torch.empty(c.N), torch.empty(c.N)]
    ggate[0][c.order] = prod.sum(1)
    ggate[1][c.order] = prod.flip(1).cumsum(1)[:, -1]
    a, b = (g.view(c.T, c.K) for g in ggate)
    bound = c.g_gate_bound()
    want = torch.empty(c.N)
    want[c.order] = 2 * 4096 * 2.0 ** -24 * prod.abs().sum(1)
    torch.testing.assert_close(bound, want.view(c.T, c.K), rtol=1e-6, atol=0)
    assert B.mismatch((a,), (b,)) != ""  # the orders do round differently here...
    assert B.mismatch((a,), (b,), {0: bound}) == ""  # ...within the bound


def test_the_inputs_follow_the_routing():
    c = B.Case("qwen3-30b-a3b", 96, "zipf", device="cpu")
    D, F, E, K = grouped_gemm.SHAPES["qwen3-30b-a3b"]
    assert (c.D, c.F, c.E, c.K, c.N) == (D, F, E, K, 96 * K) and sum(c.counts) == c.N
    assert c.counts == grouped_gemm.counts_for(c.N, E, "zipf") and int(c.off[-1]) == c.N
    assert torch.equal(torch.sort(c.order).values, torch.arange(c.N))  # a permutation of the slots...
    assert torch.equal(c.order[c.inverse], torch.arange(c.N))  # ...and its inverse
    rows = c.rows
    assert rows.q_MC.shape == (c.N, D) and rows.q_MC.stride(0) > D  # the packed dispatch rows' strided view
    assert set(c.ops()) == set(B.KERNELS)


# --- main: no results without a GPU, none with --no-results -------------------------------------------


def _fake_measure(args, rec):
    print("| kernel | ms |\n|---|---|\n| quantize_rows | 1.0 |")
    rec.row("quantize_rows", "tlx_dist", {"shape": "olmoe"}, 1.0)
    return 0


def test_no_results_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "cuda_missing", lambda: "")
    monkeypatch.setattr(B, "measure", _fake_measure)
    off, on = tmp_path / "off", tmp_path / "on"
    assert B.main(["--no-results", "--results-dir", str(off)]) == 0
    assert not off.exists()
    assert B.main(["--results-dir", str(on)]) == 0  # the same run with results on writes both files
    files = sorted(p.suffix for p in on.iterdir())
    assert files == [".jsonl", ".md"]
    assert len(next(on.glob("*.jsonl")).read_text().splitlines()) == 1


def test_cpu_only_machine_exits_with_a_message(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU-only case")
    assert B.main(["--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "torch.cuda.is_available() is False" in err
    assert not (tmp_path / "r").exists()


# --- the wrappers' _launch= ----------------------------------------------------------------------------


def test_launch_meta_overrides_only_launch_parameters():
    d = {"BLOCK_M": 32, "num_warps": 4}
    got = launch_meta(d, None)
    assert got == d and got is not d
    assert launch_meta(d, {"num_warps": 8, "num_stages": 2}) == {"BLOCK_M": 32, "num_warps": 8, "num_stages": 2}
    with pytest.raises(ValueError, match=r"\['FMT'\] not launch parameters of this kernel"):
        launch_meta(d, {"FMT": 1})
    with pytest.raises(ValueError, match=r"_launch\['num_warps'\]=0 must be a positive int"):
        launch_meta(d, {"num_warps": 0})
    with pytest.raises(ValueError, match="must be a positive int"):
        launch_meta(d, {"BLOCK_M": True})
    with pytest.raises(TypeError, match="_launch must be a dict"):
        launch_meta(d, [("num_warps", 8)])
    assert d == {"BLOCK_M": 32, "num_warps": 4}


def test_launch_overrides_on_the_kernels_interpreted():
    run_interpreted_suite("fp8_kernels_bench_interpreted_cases.py")


# --- bench/_precompile.py (its compile path needs a GPU: tests/test_bench_fp8_kernels_gpu.py) ---------


def test_record_notes_each_kernel_once_skips_it_and_restores_the_hook():
    from triton import knobs

    from _precompile import Precompiler

    class Info:  # what Triton passes as fn=: the kernel's module and name
        module, name = "tlx.common.fp8_quant", "_quant_rows_kernel"

    before = knobs.runtime.jit_cache_hook
    skipped = []

    def calls():  # stands for launches that miss Triton's cache: it calls the hook before compiling
        for spec in ('{"a": 1}', '{"a": 2}', '{"a": 1}'):
            skipped.append(knobs.runtime.jit_cache_hook(key="k", repr="r", fn=Info, compile={
                "specialization_data": spec}, is_manual_warmup=False, already_compiled=False))

    pre = Precompiler(4)
    specs = pre.record(calls)
    assert specs == {'{"a": 1}': ("tlx.common.fp8_quant", "_quant_rows_kernel"),
                     '{"a": 2}': ("tlx.common.fp8_quant", "_quant_rows_kernel")}
    assert skipped == [True, True, True]  # True: Triton neither compiles nor launches it
    assert knobs.runtime.jit_cache_hook is before

    def fails():
        raise RuntimeError("a call that fails")

    with pytest.raises(RuntimeError, match="a call that fails"):
        pre.record(fails)
    assert knobs.runtime.jit_cache_hook is before  # restored on the error path too
    assert pre.compile({}) == 0 and pre._pool is None  # nothing to compile: no worker started
    pre.close()


def test_without_workers_the_calls_just_run():
    from _precompile import Precompiler

    ran = []
    pre = Precompiler(0)
    assert pre.record(lambda: ran.append(1)) == {} and ran == [1]
    assert pre.compile({'{"a": 1}': ("m", "k")}) == 0 and pre._pool is None
    with pytest.raises(ValueError, match="workers=-1 must be an int >= 0"):
        Precompiler(-1)


def test_a_kernel_the_workers_cannot_compile_is_counted():
    from _precompile import Precompiler

    pre = Precompiler(1)
    try:  # a spawned worker: the module does not exist there either
        assert pre.compile({'{"a": 1}': ("tlx.common.no_such_module", "_k")}) == 1
        (name, err), = pre.errors
        assert name == "tlx.common.no_such_module._k" and isinstance(err, ModuleNotFoundError)
    finally:
        pre.close()
    assert pre._pool is None


def _die(*args):
    import os

    os._exit(3)  # a worker that dies (as a crashing compiler would)


def test_a_dead_worker_fails_its_kernels_and_the_next_compile_starts_anew(monkeypatch):
    import _precompile

    pre = _precompile.Precompiler(1)
    try:
        monkeypatch.setattr(_precompile, "_preload", _die)  # pickled by name: the worker runs test's _die
        assert pre.compile({'{"a": 1}': ("m", "k"), '{"a": 2}': ("m", "k2")}) == 2
        assert pre._pool is None and len(pre.errors) == 2
        monkeypatch.undo()
        assert pre.compile({'{"a": 3}': ("tlx.common.no_such_module", "_k")}) == 1  # a new pool, working
        assert isinstance(pre.errors[-1][1], ModuleNotFoundError)
    finally:
        pre.close()
