"""The per-step GEMM-side kernels go through fbtriton's C launch path (tlx.c_launch); the switch
turns it off; under the interpreter and on objects without the C path it is a no-op. CPU only: the
GPU tiers (pytest -m gpu) run every one of these kernels with the path on."""

import os
import subprocess
import sys

import pytest

import tlx

PER_STEP = {
    "tlx.hopper.fused_moe": ["_fused_mm_hopper_kernel", "_fused_wgrad_hopper_kernel"],
    "tlx.hopper.grouped_gemm": ["_grouped_gemm_hopper_kernel"],
    "tlx.blackwell.fused_moe": ["_fused_mm_blackwell_kernel", "_fused_wgrad_blackwell_kernel"],
    "tlx.blackwell.grouped_gemm": ["_grouped_gemm_blackwell_kernel"],
    "tlx.common.scheduler": ["_grouped_tile_prep_kernel", "_lpt_order_kernel"],
    "tlx.common.routing": ["_expert_slots_kernel"],
    "tlx.hopper.fp8_grouped_gemm": ["_fp8_grouped_gemm_hopper_kernel"],
    "tlx.blackwell.fp8_grouped_gemm": ["_mxfp8_grouped_gemm_blackwell_kernel"],
    "tlx.common.fp8_quant": ["_quant_rows_kernel", "_quant_cols_kernel", "_quant_cols_from_rows_kernel",
                             "_quant_both_kernel", "_quant_blocks_kernel", "_dequant_rows_kernel"],
    "tlx.common.fp8_swiglu": ["_swiglu_quant_kernel", "_swiglu_bwd_quant_kernel", "_swiglu_quant_tiles_kernel",
                              "_swiglu_bwd_quant_tiles_kernel"],
    "tlx.common.combine": ["_gather_ksum_kernel", "_combine_bwd_kernel"],
}

_PROBE = ("import importlib, json; mods = json.loads({mods!r}); "
          "print(json.dumps({{m + '.' + k: getattr(getattr(importlib.import_module(m), k), 'c_cache', None) "
          "for m, ks in mods.items() for k in ks}}))")


def _probe(env: dict) -> dict:
    import json

    code = _PROBE.format(mods=json.dumps(PER_STEP))
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not tlx.tlx_available(), reason="needs fbtriton")
def test_per_step_kernels_use_the_c_launch_path_and_the_switch_turns_it_off():
    env = {"TRITON_INTERPRET": "0", "TRITON_ENABLE_C_CACHE": "0"}
    on = _probe({**env, "TLX_DIST_C_LAUNCH": "1"})
    assert on and all(v is True for v in on.values()), on
    off = _probe({**env, "TLX_DIST_C_LAUNCH": "0"})
    assert all(v is False for v in off.values()), off


def test_c_launch_is_a_no_op_without_the_c_path():
    class NotAJitFunction:  # e.g. the interpreter's InterpretedFunction: no c_cache / params
        pass

    k = NotAJitFunction()
    assert tlx.c_launch(k) is k
    assert not hasattr(k, "c_cache")


def test_marked_kernels_have_no_default_arguments():
    """The C key pads omitted trailing arguments with None (tlx.c_launch): a marked kernel with a
    Python default could reuse a kernel compiled for an explicit None."""
    import importlib
    import inspect

    for m, ks in PER_STEP.items():
        mod = importlib.import_module(m)
        for k in ks:
            fn = getattr(mod, k)
            fn = getattr(fn, "fn", fn)
            defaults = [n for n, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty]
            assert not defaults, f"{m}.{k} has defaults {defaults}"


@pytest.mark.skipif(not tlx.tlx_available(), reason="needs fbtriton")
def test_c_dispatch_sets_the_knob_for_the_marked_kernel_only(monkeypatch):
    """TLX_DIST_C_DISPATCH (on unless 0): a marked kernel's launches run with fbtriton's C-dispatcher knob on
    (so a specialisation compiled then carries a C dispatcher); before and after, and for every
    other kernel, the knob is what it was, and nothing is exported to the environment."""
    from triton import knobs

    monkeypatch.delenv("TRITON_USE_C_DISPATCHER", raising=False)
    monkeypatch.setattr(tlx, "_bind_context", lambda: None)  # (no GPU here; the next test covers it)
    seen = []

    class Kernel:  # what c_launch needs of a JITFunction: c_cache, params, run
        c_cache = False
        params = ()

        def run(self, *args, grid, warmup, **kwargs):
            seen.append((knobs.nvidia.use_triton_dispatcher, args, grid, kwargs))
            if kwargs.get("fail"):
                raise RuntimeError("launch failed")
            return "compiled"

    monkeypatch.setenv(tlx.ENV_C_DISPATCH, "1")
    k = tlx.c_launch(Kernel())
    assert k.c_cache is True and k.c_dispatch is True
    assert knobs.nvidia.use_triton_dispatcher is False
    assert k.run(1, 2, grid=(3,), warmup=False, BLOCK=4) == "compiled"
    assert seen[-1] == (True, (1, 2), (3,), {"BLOCK": 4})
    assert knobs.nvidia.use_triton_dispatcher is False and "TRITON_USE_C_DISPATCHER" not in os.environ
    with pytest.raises(RuntimeError, match="launch failed"):
        k.run(grid=(1,), warmup=False, fail=True)
    assert seen[-1][0] is True and knobs.nvidia.use_triton_dispatcher is False  # restored on error
    # A user who turned the knob on keeps it on (and it is not popped after the launch).
    knobs.nvidia.__dict__["use_triton_dispatcher"] = True
    try:
        k.run(grid=(1,), warmup=False)
        assert seen[-1][0] is True and knobs.nvidia.__dict__["use_triton_dispatcher"] is True
    finally:
        knobs.nvidia.__dict__.pop("use_triton_dispatcher", None)
    # On by default; TLX_DIST_C_DISPATCH=0: the kernel keeps Triton's own run.
    monkeypatch.delenv(tlx.ENV_C_DISPATCH)
    assert tlx.c_launch(Kernel()).c_dispatch is True
    monkeypatch.setenv(tlx.ENV_C_DISPATCH, "0")
    k2 = tlx.c_launch(Kernel())
    assert k2.c_cache is True and not hasattr(k2, "c_dispatch") and "run" not in vars(k2)


@pytest.mark.skipif(not tlx.tlx_available(), reason="needs fbtriton")
def test_c_dispatch_binds_the_device_context_once_per_thread(monkeypatch):
    """fbtriton's C dispatcher launches without making a CUDA context current (Triton's own launcher
    does): before a marked kernel's launch the current device's primary context is made current on
    the calling thread -- once per thread and device, again when the device changes -- so a thread
    whose first CUDA work is one of our kernels (autograd's device thread) does not fail with
    "invalid device context"."""
    import threading

    made = []
    dev = {"d": 0}
    monkeypatch.setattr(tlx, "_current_device", lambda: dev["d"])
    monkeypatch.setattr(tlx, "_make_current", lambda d: made.append((threading.get_ident(), d)))
    monkeypatch.setattr(tlx, "_BOUND", threading.local())
    monkeypatch.setenv(tlx.ENV_C_DISPATCH, "1")

    class Kernel:
        c_cache = False
        params = ()

        def run(self, *args, grid, warmup, **kwargs):
            return "ran"

    k = tlx.c_launch(Kernel())
    main = threading.get_ident()
    assert k.run(grid=(1,), warmup=False) == "ran" and k.run(grid=(1,), warmup=False) == "ran"
    assert made == [(main, 0)]
    other = []
    t = threading.Thread(target=lambda: other.append((k.run(grid=(1,), warmup=False), threading.get_ident())))
    t.start()
    t.join()
    assert other[0][0] == "ran" and made == [(main, 0), (other[0][1], 0)]
    dev["d"] = 1
    k.run(grid=(1,), warmup=False)
    k.run(grid=(1,), warmup=False)
    assert made[2:] == [(main, 1)]
    # TLX_DIST_C_DISPATCH=0: Triton's own run (and its own launcher's context handling), nothing bound here
    monkeypatch.setenv(tlx.ENV_C_DISPATCH, "0")
    tlx.c_launch(Kernel()).run(grid=(1,), warmup=False)
    assert len(made) == 3


@pytest.mark.gpu
def test_marked_kernel_launches_from_a_fresh_thread():
    """A thread whose first CUDA work is a marked kernel launches it (autograd's device thread is such
    a thread when a backward starts with one of ours: before _bind_context, "invalid device context
    (201)" from the C dispatcher, seen with tests/test_fused_ep_gpu.py run on its own)."""
    import threading

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tlx_dist.grouped_gemm.host import prep_offsets

    offs = torch.tensor([3, 7, 7, 12], dtype=torch.int32, device="cuda")
    ref = prep_offsets(offs, 12, 128)  # compiles, and fills the C cache, on this thread
    torch.cuda.synchronize()
    out, err = [], []

    def work():  # the caching allocator serves the outputs: the launch is this thread's first CUDA call
        try:
            out.append(prep_offsets(offs, 12, 128))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            err.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not err, err
    assert torch.equal(out[0][0], ref[0]) and torch.equal(out[0][1], ref[1])


@pytest.mark.skipif(not tlx.tlx_available(), reason="needs fbtriton")
def test_c_dispatch_knob_is_set_for_the_block_and_restored():
    """What the bench precompiler wraps a marked kernel's preload in (bench/_precompile.py): the knob
    a marked kernel's launches compile under, on inside the block and as before after it (unset, or a
    value the user set), also when the block raises."""
    from triton import knobs

    d = knobs.nvidia.__dict__
    key = tlx._KNOB
    saved = d.pop(key, tlx._UNSET)
    try:
        with tlx.c_dispatch_knob():
            assert d[key] is True
        assert key not in d
        d[key] = False
        with pytest.raises(RuntimeError):
            with tlx.c_dispatch_knob():
                assert d[key] is True
                raise RuntimeError("inside")
        assert d[key] is False
    finally:
        d.pop(key, None)
        if saved is not tlx._UNSET:
            d[key] = saved


def test_precompiler_preloads_marked_kernels_under_the_knob(monkeypatch):
    """bench/_precompile.py's worker: a kernel marked for the C dispatcher is preloaded with the knob
    on (its launches compile under it, so the cache key must match); an unmarked one without it."""
    pytest.importorskip("triton")
    import importlib
    import types
    from pathlib import Path

    from triton import knobs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import _precompile

    seen = []

    class Kernel:
        def __init__(self, marked):
            if marked:
                self.c_dispatch = True

        def preload(self, spec):
            seen.append((spec, knobs.nvidia.__dict__.get(tlx._KNOB)))

    fake = types.SimpleNamespace(marked=Kernel(True), plain=Kernel(False))
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda m: fake if m == "fake_mod" else real(m))
    d = knobs.nvidia.__dict__
    saved = d.pop(tlx._KNOB, tlx._UNSET)
    try:
        _precompile._preload("fake_mod", "marked", "s1")
        _precompile._preload("fake_mod", "plain", "s2")
        assert seen == [("s1", True), ("s2", None)]
        assert tlx._KNOB not in d
    finally:
        if saved is not tlx._UNSET:
            d[tlx._KNOB] = saved
