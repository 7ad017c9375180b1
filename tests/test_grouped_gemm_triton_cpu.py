"""Portable Triton grouped GEMM under TRITON_INTERPRET=1 (CPU, CI tier T0/T2).

Compares the kernel with an fp64 reference; tolerance per STYLE.md 6:
max|ours - ref64| <= 2 * max|torch_same_dtype - ref64| + atol, where torch_same_dtype is the reference loop
run in the operands' dtype (the error PyTorch itself makes), and atol covers the final rounding to
the output dtype (one ulp-scale term: 1e-5 for fp32, 2e-2 for bf16 at these magnitudes).
Note: under the interpreter the kernel's tl.dot is replaced by a broadcast-sum (NO_DOT) because
fbtriton 3.7.4's interpreter cannot run tl.dot; the GPU tests cover tl.dot itself.
"""

import os
import subprocess
import sys

import pytest
import torch

# Triton decides interpret-or-compile when a kernel is decorated, for the whole process, so the
# interpreted checks run in a child process with TRITON_INTERPRET=1 (keeping this process -- and the
# compile tests beside it -- on the real compiler).
_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _check(ours, same, ref64, dtype, what):
    assert ours.dtype == same.dtype
    # Max-abs errors, as flash-attn's tests compare them.
    assert not torch.isnan(ours).any(), f"{what}: NaN in output"
    err = (ours.double() - ref64).abs().max().item()
    bound = 2 * (same.double() - ref64).abs().max().item() + ATOL[dtype]
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g}"


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


# (counts per expert, N, D, F, why)
CASES = [
    ([10, 0, 35, 35, 10], 100, 48, 40, "zero-row expert, tails in every dim, 10 padding rows"),
    ([70], 70, 32, 24, "E=1, one expert with every row, rows not a multiple of the tile"),
    ([0, 0, 0], 5, 16, 8, "every expert empty: the whole output is padding"),
    ([1, 2, 3, 0, 5, 0, 7], 18, 40, 36, "prime E=7, tiny experts, a single-row expert"),
]


def _one_case(dtype, counts, N, D, F, why):
    from tlx_dist.grouped_gemm import backends
    from tlx_dist.grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref

    torch.manual_seed(0)
    b = backends.get_backend("triton")
    assert b.supports(torch.empty(1, D), torch.empty(1, D, F)) is None
    E = len(counts)
    off = _offsets(counts)
    x = torch.randn(N, D).to(dtype)
    w = torch.randn(E, D, F).to(dtype)
    dy = torch.randn(N, F).to(dtype)
    # Forward; padding rows must come back zero.
    y = b.mm(x, w, off)
    _check(y, grouped_mm_ref(x, w, off), grouped_mm_ref(x.double(), w.double(), off), dtype, f"fwd ({why})")
    assert (y[int(off[-1]):] == 0).all()
    # dX through the transposed (K-contiguous) weight view.
    wt = w.transpose(1, 2)
    dx = b.mm(dy, wt, off)
    _check(dx, grouped_mm_ref(dy, wt, off), grouped_mm_ref(dy.double(), wt.double(), off), dtype, f"dX ({why})")
    # Weight gradient; empty experts must be exactly zero.
    dw = b.wgrad(x, dy, off)
    _check(dw, grouped_mm_wgrad_ref(x, dy, off), grouped_mm_wgrad_ref(x.double(), dy.double(), off), dtype,
           f"dW ({why})")
    for e, c in enumerate(counts):
        if c == 0:
            assert (dw[e] == 0).all()


def _child_main() -> None:
    from tlx_dist.grouped_gemm import backends

    b = backends.get_backend("triton")
    assert "dtype" in b.supports(torch.empty(2, 2, dtype=torch.int32), torch.empty(1, 2, 2, dtype=torch.int32))
    for dtype in (torch.float32, torch.bfloat16):
        for case in CASES:
            _one_case(dtype, *case)
            print("ok", dtype, case[-1], flush=True)


def _run_child(mode: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), mode], env=env, capture_output=True, text=True,
                       timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_triton_interpret_all_forms():
    assert _run_child("forms").count("ok ") == 2 * len(CASES)


# --- bad offsets: memory safety and the device flag (tlx/common/scheduler.py "Memory safety") -----
# Operands are views into buffers whose rows outside the view are NaN (reads) or a sentinel
# (writes): a kernel that touched a row outside its operand would bring NaN into the result or
# change a sentinel. (N rows, offsets, why)
N_BAD = 40
BAD_OFFSETS = [
    ([10, 5, 40], "decreasing: expert 1 would own rows [10, 5), a negative count"),
    ([-7, 20, 40], "negative first offset: expert 0 would start 7 rows before x"),
    ([10, 60, 70], "past the end: experts 1 and 2 would run 30 rows past x; last offset != N"),
    ([40, 0, 40, 41], "decreasing, then one row past the end (off by one)"),
    ([-5, -1, 3], "all negative but the last: the padding would start before x"),
    ([2**31 + 5, 2**31 + 9], "int64 offsets past 2**31: flagged, not wrapped to 5 and 9 by an int32 cast"),
    ([0, 0, 0], "valid, every expert empty (control: the flag must stay clear)"),
    ([10, 10, 33], "valid with 7 padding rows (control: the flag must stay clear)"),
]
SENTINEL = 12345.0
PAD = 8  # rows of NaN / sentinel on either side of each view


def _padded(rows, cols, fill, dtype, data=None):
    buf = torch.full((rows + 2 * PAD, cols), fill, dtype=dtype)
    view = buf[PAD:PAD + rows]
    view.copy_(data if data is not None else torch.randn(rows, cols).to(dtype))
    return buf, view


def _bad_case(counts_or_offsets, why, dtype=torch.float32, D=16, F=24):
    from tlx_dist.grouped_gemm import backends, check_offsets, offsets_flag
    from tlx_dist.grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref, safe_offsets_ref
    from tlx_dist.grouped_gemm.host import prep_offsets

    torch.manual_seed(3)
    off = torch.tensor(counts_or_offsets, dtype=torch.int64)
    E = off.shape[0]
    safe_ref, bits_ref = safe_offsets_ref(off, N_BAD)
    flag = offsets_flag("cpu")
    flag.zero_()
    # The prep kernel: safe offsets as the torch reference makes them, tile counts over them.
    safe, tile_cum = prep_offsets(off, N_BAD, 32)
    assert torch.equal(safe, safe_ref), f"{why}: safe {safe.tolist()} != {safe_ref.tolist()}"
    rows = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int32), safe, torch.tensor([N_BAD], dtype=torch.int32)]))
    assert torch.equal(tile_cum, torch.cumsum((rows + 31) // 32, 0).to(torch.int32)), f"{why}: tile_cum"
    assert int(flag) == int(bits_ref), f"{why}: flag {int(flag)} != expected {int(bits_ref)}"
    flag.zero_()

    b = backends.get_backend("triton")
    _, x = _padded(N_BAD, D, float("nan"), dtype)
    _, dy = _padded(N_BAD, F, float("nan"), dtype)
    w = torch.randn(E, D, F).to(dtype)
    for what, got, ref_fn, args in (
        ("fwd", b.mm(x, w, off), grouped_mm_ref, (x, w)),
        ("dX", b.mm(dy, w.transpose(1, 2), off), grouped_mm_ref, (dy, w.transpose(1, 2))),
        ("dW", b.wgrad(x, dy, off), grouped_mm_wgrad_ref, (x, dy)),
    ):
        # The defined result: the reference on the safe offsets.
        same = ref_fn(*args, safe_ref)
        ref64 = ref_fn(*(a.double() for a in args), safe_ref)
        _check(got, same, ref64, dtype, f"{what} bad offsets ({why})")
    assert int(flag) == int(bits_ref), f"{why}: flag after the GEMMs {int(flag)} != {int(bits_ref)}"
    if int(bits_ref):
        with pytest.raises(ValueError, match="out-of-range offsets_E"):
            check_offsets("cpu")
        assert int(flag) == 0, "check_offsets must reset the flag"
    else:
        check_offsets("cpu")


def _raw_offsets_kernel_case(offsets, why, D=16, F=24):
    """Layer 2: the kernel handed a caller's raw offsets (no prep): expert_rows' clamp alone must
    keep every load and store inside x and y."""
    from tlx.portable.grouped_gemm import _grouped_mm_kernel, _grouped_wgrad_kernel
    from tlx_dist.grouped_gemm.host import max_m_tiles, prep_offsets, search_steps

    torch.manual_seed(4)
    off = torch.tensor(offsets, dtype=torch.int64)
    if off.abs().max() >= 2**31:
        return  # an int32 kernel argument cannot hold it; covered by the prep kernel above
    off32 = off.to(torch.int32)
    E, BM, BN, BK = off.shape[0], 32, 32, 32
    _, x = _padded(N_BAD, D, float("nan"), torch.float32)
    w = torch.randn(E, D, F)
    ybuf, y = _padded(N_BAD, F, SENTINEL, torch.float32, data=torch.full((N_BAD, F), SENTINEL))
    # tile counts from the raw offsets' own (clamped, possibly overlapping) ranges: the worst case
    tile_cum = prep_offsets(off32, N_BAD, BM)[1]
    grid = (max_m_tiles(N_BAD, E, BM) * -(-F // BN),)
    _grouped_mm_kernel[grid](x, w, y, off32, tile_cum, N_BAD, E, D, F, x.stride(0), x.stride(1), w.stride(0),
                             w.stride(1), w.stride(2), y.stride(0), y.stride(1), BM=BM, BN=BN, BK=BK,
                             SEARCH_STEPS=search_steps(E), IEEE=True, NO_DOT=True)
    assert (ybuf[:PAD] == SENTINEL).all() and (ybuf[PAD + N_BAD:] == SENTINEL).all(), f"{why}: store outside y"
    assert not torch.isnan(y).any(), f"{why}: a load outside x reached y"
    _, dy = _padded(N_BAD, F, float("nan"), torch.float32)
    dw = torch.full((E, D, F), SENTINEL)
    _grouped_wgrad_kernel[(E * -(-D // BM) * -(-F // BN),)](
        x, dy, dw, off32, N_BAD, E, D, F, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2), BM=BM, BN=BN, BK=BK, IEEE=True, NO_DOT=True)
    assert not torch.isnan(dw).any() and not (dw == SENTINEL).any(), f"{why}: dW read outside x/dy or left holes"


def _bad_offsets_main() -> None:
    from tlx_dist.grouped_gemm import offsets_flag

    for offsets, why in BAD_OFFSETS:
        for dtype in (torch.float32, torch.bfloat16):
            _bad_case(offsets, why, dtype)
        _raw_offsets_kernel_case(offsets, why)
        print("ok", why, flush=True)
    offsets_flag("cpu").zero_()


def test_triton_interpret_bad_offsets_stay_in_bounds_and_flag():
    out = _run_child("bad")
    assert out.count("ok ") == len(BAD_OFFSETS), out


def test_triton_refuses_cpu_without_interpreter():
    from tlx_dist.grouped_gemm import backends

    if _CHILD:
        pytest.skip("running inside the interpreter child")
    why = backends.get_backend("triton").supports(torch.empty(2, 2), torch.empty(1, 2, 2))
    assert why is not None and "TRITON_INTERPRET" in why


def _opcheck_main() -> None:
    # torch.library.opcheck on the custom ops with the portable kernel (interpreted): fake impl,
    # autograd registration and AOT dispatch of forward + backward (test_grouped_gemm_opcheck.py).
    from test_grouped_gemm_opcheck import CASES as OP_CASES, opcheck_case

    for counts, N, D, F, why in OP_CASES:
        opcheck_case(counts, N, D, F, "triton")
        print("ok", why, flush=True)


def test_triton_interpret_opcheck():
    from test_grouped_gemm_opcheck import CASES as OP_CASES

    assert _run_child("opcheck").count("ok ") == len(OP_CASES)


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("off_ty,tiles", [("*i32", True), ("*i64", True), ("*i64", False)])
def test_offsets_prep_kernel_compiles_for_gpu(arch, off_ty, tiles):
    # The guard runs before every GPU launch: it must build for the GPUs we target (running it is
    # covered interpreted above and by tests/test_grouped_gemm_gpu.py).
    if _CHILD:
        pytest.skip("running inside the interpreter child")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tlx.common.scheduler import _grouped_tile_prep_kernel

    sig = {"offsets_ptr": off_ty, "safe_ptr": "*i32", "tile_cum_ptr": "*i32", "flag_ptr": "*i32", "E": "i32",
           "N_ROWS": "i32", "BM": "constexpr", "E1_P2": "constexpr", "TILES": "constexpr", "PHASE": "constexpr",
           "VIRT": "constexpr"}
    src = ASTSource(_grouped_tile_prep_kernel, sig,
                    constexprs={"BM": 128, "E1_P2": 256, "TILES": tiles, "PHASE": -1, "VIRT": 3})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 128), options={"num_warps": 4})
    assert len(k.asm["cubin"]) > 0 and "atom.global" in k.asm["ptx"]


if __name__ == "__main__":
    {"forms": _child_main, "bad": _bad_offsets_main, "opcheck": _opcheck_main}[sys.argv[1]]()
