"""Grouped GEMM on the GPU (tier T3): every backend, all three forms, vs an fp64 reference.

Tolerance (STYLE.md 6): max|ours - ref64| <= 2 * max|torch_same_dtype - ref64| + atol, where
torch_same_dtype is the per-expert torch.mm loop in the operands' dtype (cuBLAS, fp32 accumulate,
one rounding) and atol = max|ref64| * 2**-8 (half a bf16 ulp at the largest magnitude): two correct
fp32-accumulating kernels that sum in different orders can round one element to neighbouring bf16
values even where torch happened to land exactly.
Outputs are poisoned: before each call the caching allocator hands out memory we filled with NaN,
so an element the kernel forgot to write shows up as NaN (and padding rows must be exactly zero).
"""

import dataclasses
import math

import pytest
import torch

import tlx

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU CI, skipped there
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tlx_dist.grouped_gemm import grouped_mm, grouped_mm_wgrad  # noqa: E402
from tlx_dist.grouped_gemm.backends import available_backends, get_backend  # noqa: E402
from tlx_dist.grouped_gemm.config import GroupedGemmConfig, grouped_mm_config  # noqa: E402
from tlx_dist.grouped_gemm.reference import grouped_mm_ref, grouped_mm_wgrad_ref  # noqa: E402

DEV = "cuda"
BACKENDS = [b for b in ("tlx", "triton", "torch") if b in available_backends()]


def _poison(nbytes: int):
    # Fill and free a block at least as large as the output: the allocator reuses it next.
    t = torch.empty(nbytes // 2 + 4096, dtype=torch.bfloat16, device=DEV).fill_(float("nan"))
    del t


def _close(ours, same, ref64, what):
    assert not torch.isnan(ours).any(), f"{what}: NaN (unwritten or poisoned elements)"
    err = (ours.double() - ref64).abs().max().item()
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    bound = 2 * (same.double() - ref64).abs().max().item() + scale * 2**-8 + 1e-6
    assert err <= bound, f"{what}: max error {err:.4g} > bound {bound:.4g}"


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64, device=DEV).cumsum(0).to(torch.int32)


def _zipf_counts(total, E, s=1.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    p = p[torch.randperm(E, generator=g)]
    c = torch.floor(p / p.sum() * total).long()
    c[0] += total - int(c.sum())
    return c.tolist()


def _all_forms(backend, counts, N, D, F, dtype=torch.bfloat16, seed=0, config=None):
    torch.manual_seed(seed)
    E = len(counts)
    off = _offsets(counts)
    x = torch.randn(N, D, device=DEV, dtype=dtype)
    w = torch.randn(E, D, F, device=DEV, dtype=dtype) / math.sqrt(D)
    dy = torch.randn(N, F, device=DEV, dtype=dtype)
    b = get_backend(backend)
    kw = {} if config is None else {"config": config}
    end = int(sum(counts))

    _poison(N * F * 2)
    y = b.mm(x, w, off, **kw)
    _close(y, grouped_mm_ref(x, w, off), grouped_mm_ref(x.double(), w.double(), off), f"{backend} fwd")
    assert (y[end:] == 0).all(), f"{backend} fwd: padding rows not zero"

    wt = w.transpose(1, 2)  # K-contiguous view, as dX uses it
    _poison(N * D * 2)
    dx = b.mm(dy, wt, off, **kw)
    _close(dx, grouped_mm_ref(dy, wt, off), grouped_mm_ref(dy.double(), wt.double(), off), f"{backend} dX")
    assert (dx[end:] == 0).all(), f"{backend} dX: padding rows not zero"

    _poison(E * D * F * 2)
    dw = b.wgrad(x, dy, off, **kw)
    _close(dw, grouped_mm_wgrad_ref(x, dy, off), grouped_mm_wgrad_ref(x.double(), dy.double(), off),
           f"{backend} dW")
    for e, c in enumerate(counts):
        if c == 0:
            assert (dw[e] == 0).all(), f"{backend} dW: expert {e} has no rows but non-zero gradient"


# (counts, N, D, F, why)
CASES = [
    ([300, 0, 517, 129, 1, 600], 1547, 256, 384, "random-ish counts with a zero-row expert; rows not a multiple of any tile"),
    ([0, 0, 2000, 0], 2000, 128, 256, "one expert owns every row, the others none"),
    ([1000], 1000, 192, 320, "E=1; D, F not multiples of 128/256"),
    ([64] * 256, 256 * 64, 128, 128, "E=256: deep binary search, many small experts"),
    (_zipf_counts(8192, 64), 8192, 256, 256, "Zipf-imbalanced routing (s=1.2) over 64 experts"),
    ([100, 200, 0, 300], 1000, 128, 136, "400 padding rows past offsets[-1] must be zero; F=136 odd tail"),
    ([5, 3, 0, 9], 17, 64, 8, "tiny: fewer rows than a tile; F=8 smaller than any TMA box"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts,N,D,F,why", CASES, ids=[c[-1][:40] for c in CASES])
def test_all_forms(backend, counts, N, D, F, why):
    if backend == "torch" and (D % 8 or F % 8):
        pytest.skip("torch._grouped_mm needs 16-byte aligned rows")
    _all_forms(backend, counts, N, D, F)


def test_misaligned_dims_fall_back_or_error():
    # D=36 is not a multiple of 8: TMA rows would be misaligned. Pinning tlx is a clear error; the
    # automatic choice falls back to a backend that runs it, and the result is still right.
    x = torch.randn(50, 36, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, 36, 24, device=DEV, dtype=torch.bfloat16)
    off = _offsets([10, 0, 30])
    if "tlx" in BACKENDS:
        assert "multiples of 8" in get_backend("tlx").supports(x, w)
        with pytest.raises(ValueError, match="cannot run these operands"):
            grouped_mm(x, w, off, backend="tlx")
    y = grouped_mm(x, w, off)
    _close(y, grouped_mm_ref(x, w, off), grouped_mm_ref(x.double(), w.double(), off), "auto fallback fwd")
    assert (y[40:] == 0).all()


def _ref_differentiable(x, w, counts):
    # reference.py writes with out= (not differentiable); this loop is the same math, autograd-able.
    parts, lo = [], 0
    for e, c in enumerate(counts):
        parts.append(x[lo:lo + c] @ w[e])
        lo += c
    parts.append(x.new_zeros(x.shape[0] - lo, w.shape[2]))
    return torch.cat(parts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd(backend):
    # dX and dW through grouped_mm's registered autograd use the same backend family.
    torch.manual_seed(1)
    counts = [70, 0, 130, 56]
    off = _offsets(counts)
    x = torch.randn(300, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)  # 44 padding rows
    w = (torch.randn(4, 128, 192, device=DEV, dtype=torch.bfloat16) / 12).requires_grad_()
    dy = torch.randn(300, 192, device=DEV, dtype=torch.bfloat16)
    grouped_mm(x, w, off, backend=backend).backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _ref_differentiable(x64, w64, counts).backward(dy.double())
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _ref_differentiable(xs, ws, counts).backward(dy)
    _close(x.grad, xs.grad, x64.grad, f"{backend} autograd dx")
    _close(w.grad, ws.grad, w64.grad, f"{backend} autograd dw")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_cuda_graph_capture(backend):
    # No host sync anywhere: capture fwd + dX + dW once, then replay with new routing written
    # into the same offsets tensor; the replay must match the reference for the new routing.
    torch.manual_seed(2)
    N, D, F, E = 1024, 128, 256, 8
    x = torch.randn(N, D, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(E, D, F, device=DEV, dtype=torch.bfloat16) / 11
    dy = torch.randn(N, F, device=DEV, dtype=torch.bfloat16)
    off = _offsets([128] * E)
    b = get_backend(backend)
    for _ in range(2):  # warm up: compile and pick configs outside the capture
        b.mm(x, w, off), b.mm(dy, w.transpose(1, 2), off), b.wgrad(x, dy, off)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = b.mm(x, w, off)
        dx = b.mm(dy, w.transpose(1, 2), off)
        dw = b.wgrad(x, dy, off)
    off.copy_(_offsets([0, 500, 1, 0, 200, 33, 0, 100]))  # 834 rows, 190 padding rows
    g.replay()
    torch.cuda.synchronize()
    _close(y, grouped_mm_ref(x, w, off), grouped_mm_ref(x.double(), w.double(), off), f"{backend} graph fwd")
    assert (y[834:] == 0).all()
    wt = w.transpose(1, 2)
    _close(dx, grouped_mm_ref(dy, wt, off), grouped_mm_ref(dy.double(), wt.double(), off), f"{backend} graph dX")
    _close(dw, grouped_mm_wgrad_ref(x, dy, off), grouped_mm_wgrad_ref(x.double(), dy.double(), off),
           f"{backend} graph dW")


# --- TLX Hopper scheduling paths: longest-expert-first dW with atomic tile claims, GROUP_M raster ---

needs_tlx = pytest.mark.skipif("tlx" not in BACKENDS, reason="the TLX backend is not available here")


def _wgrad_check(counts, N, D, F, what, seed=0):
    torch.manual_seed(seed)
    off = _offsets(counts)
    x = torch.randn(N, D, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(N, F, device=DEV, dtype=torch.bfloat16)
    _poison(len(counts) * D * F * 2)
    dw = get_backend("tlx").wgrad(x, dy, off)
    _close(dw, grouped_mm_wgrad_ref(x, dy, off), grouped_mm_wgrad_ref(x.double(), dy.double(), off), what)
    for e, c in enumerate(counts):
        if c == 0:
            assert (dw[e] == 0).all(), f"{what}: expert {e} has no rows but non-zero gradient"
    return x, dy, off, dw


# (counts, N, D, F, why); each has more dW tiles than the H200's 132 SMs, so CTAs claim tiles
# from the atomic counter more than once.
LPT_CASES = [
    (_zipf_counts(16384, 64, seed=3), 16384, 256, 512, "Zipf s=1.2 over 64 experts: heavy experts claimed first"),
    ([0] * 20 + [8192] + [0] * 43, 8192, 256, 512, "one expert owns every row; 63 zero-row experts must store zeros"),
    ([700, 0, 0, 1, 3000, 0, 64, 129] * 8, 31153, 128, 768, "zero-row and 1-row experts among heavy ones; 1 padding row"),
    (_zipf_counts(8192, 8, seed=1), 8192, 512, 4096, "Mixtral-like: 8 experts, wide F (GROUP_M=8 raster)"),
]


@needs_tlx
@pytest.mark.parametrize("counts,N,D,F,why", LPT_CASES, ids=[c[-1][:40] for c in LPT_CASES])
def test_tlx_dw_lpt_matches_static_and_ref(counts, N, D, F, why):
    x, dy, off, dw = _wgrad_check(counts, N, D, F, f"tlx dW lpt ({why})")
    # Same tiles, same K order, only the walk differs: the static walk must agree bit for bit.
    cfg = grouped_mm_config("dW", N, len(counts), D, F, tlx.gpu_arch())
    dw_static = get_backend("tlx").wgrad(x, dy, off, config=dataclasses.replace(cfg, dw_order="static"))
    assert torch.equal(dw, dw_static), "lpt and static dW walks differ (they must be bitwise equal)"
    # Deterministic across runs despite the atomic claims.
    assert cfg.dw_order == "lpt"  # the default walk
    assert torch.equal(dw, get_backend("tlx").wgrad(x, dy, off, config=cfg)), "dW not deterministic"
    # The fused pipeline's call (its routing's int32 offsets and longest-first order handed in, the
    # clamp and order launches skipped): the same result bit for bit.
    from tlx_dist.grouped_gemm.host import lpt_order as _lpt_order

    off32 = off.to(torch.int32).contiguous()
    dw_t = get_backend("tlx").wgrad(x, dy, off32, order=_lpt_order(off32), trusted=True)
    assert torch.equal(dw, dw_t), "dW with the handed-in order / trusted offsets differs"


@needs_tlx
@pytest.mark.parametrize("cfg", [None, (128, 256, 64, 3, 8), (128, 128, 64, 5, 8), (256, 128, 64, 3, 8),
                                 (128, 256, 32, 6, 8)], ids=str)
def test_tlx_wide_forms_group_raster(cfg):
    # Wide outputs take the GROUP_M raster by default (fwd: F=4096, dX: D=4096, dW: F=4096); the
    # m-tile count (27 + padding) is no multiple of GROUP_M, so the last group is partial. Also the
    # autotune candidates, pinned one by one (config=).
    counts = [1000, 0, 1, 1500, 37, 500]
    for D, F in ((256, 4096), (4096, 256)):
        _all_forms("tlx", counts, 3100, D, F, config=None if cfg is None else GroupedGemmConfig(*cfg))


@needs_tlx
def test_tuned_and_pinned_config_through_grouped_mm():
    # tune_grouped_mm picks one of this GPU's candidates; grouped_mm(config=) runs it in the forward
    # and in both backward forms, with the same results as the default tiles (up to fp32 order).
    from tlx_dist.grouped_gemm import tune_grouped_mm
    from tlx_dist.grouped_gemm.config import tile_spec

    torch.manual_seed(5)
    counts = [700, 0, 1, 1300, 37, 562]
    N, D, F = 2600, 256, 512
    off = _offsets(counts)
    x = torch.randn(N, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(counts), D, F, device=DEV, dtype=torch.bfloat16) / 16).requires_grad_()
    cfg = tune_grouped_mm(x.detach(), w.detach(), off)
    assert cfg in tile_spec(tlx.gpu_arch()).candidates
    dy = torch.randn(N, F, device=DEV, dtype=torch.bfloat16)
    grads = {}
    for name, c in (("default", None), ("tuned", cfg), ("narrow", GroupedGemmConfig(128, 128, 64, 4))):
        x.grad = w.grad = None
        y = grouped_mm(x, w, off, backend="tlx", config=c)
        y.backward(dy)
        grads[name] = (y.detach(), x.grad, w.grad)
    x64, w64 = x.detach().double(), w.detach().double()
    want = (grouped_mm_ref(x64, w64, off), grouped_mm_ref(dy.double(), w64.transpose(1, 2), off),
            grouped_mm_wgrad_ref(x64, dy.double(), off))
    same = (grouped_mm_ref(x.detach(), w.detach(), off), grouped_mm_ref(dy, w.detach().transpose(1, 2), off),
            grouped_mm_wgrad_ref(x.detach(), dy, off))
    for name, got in grads.items():
        for what, g, s_, r in zip(("y", "dx", "dw"), got, same, want):
            _close(g, s_, r, f"{name} config: {what}")


@needs_tlx
def test_tlx_cuda_graph_replays_rezero_the_tile_counter():
    # The dW tile counter is zeroed inside the graph (a memset node): two replays with different
    # routings must both be right. 256 dW tiles > 132 SMs, F=4096 -> GROUP_M=8 in fwd and dW.
    torch.manual_seed(4)
    N, D, F, E = 1024, 256, 4096, 8
    x = torch.randn(N, D, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(E, D, F, device=DEV, dtype=torch.bfloat16) / 16
    dy = torch.randn(N, F, device=DEV, dtype=torch.bfloat16)
    off = _offsets([128] * E)
    b = get_backend("tlx")
    for _ in range(2):
        b.mm(x, w, off), b.mm(dy, w.transpose(1, 2), off), b.wgrad(x, dy, off)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = b.mm(x, w, off)
        dx = b.mm(dy, w.transpose(1, 2), off)
        dw = b.wgrad(x, dy, off)
    wt = w.transpose(1, 2)
    for counts in ([0, 900, 1, 0, 100, 0, 0, 23], [1024, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]):
        off.copy_(_offsets(counts))
        g.replay()
        torch.cuda.synchronize()
        end = sum(counts)
        _close(y, grouped_mm_ref(x, w, off), grouped_mm_ref(x.double(), w.double(), off), f"graph fwd {counts}")
        assert (y[end:] == 0).all()
        _close(dx, grouped_mm_ref(dy, wt, off), grouped_mm_ref(dy.double(), wt.double(), off), f"graph dX {counts}")
        _close(dw, grouped_mm_wgrad_ref(x, dy, off), grouped_mm_wgrad_ref(x.double(), dy.double(), off),
               f"graph dW {counts}")
        for e, c in enumerate(counts):
            if c == 0:
                assert (dw[e] == 0).all(), f"graph dW {counts}: expert {e} not zero"


# --- bad offsets: no access outside the operands, a defined result, the device flag --------------
# x and dy are views into buffers whose rows outside the view are NaN: a kernel reading a row
# outside its operand brings NaN into the result. The defined result is the reference on the safe
# offsets (clamped into [0, N], made non-decreasing). compute-sanitizer (scripts/memcheck_grouped_gemm.py)
# checks the stores. (offsets, why)
BAD_OFFSETS = [
    ([300, 100, 1000], "decreasing: expert 1 would own rows [300, 100)"),
    ([-64, 500, 1000], "negative first offset: expert 0 would start 64 rows before x"),
    ([200, 1500, 1700], "past the end: experts 1, 2 would run 700 rows past x (and the ragged TMA with them)"),
    ([1000, 0, 1000, 1001], "decreasing, then one row past the end"),
    ([2**31 + 5, 2**31 + 9], "int64 offsets past 2**31: flagged, not wrapped by an int32 cast"),
    ([128, 128, 900], "valid with 100 padding rows (control: the flag stays clear)"),
]


def _nan_padded(rows, cols, pad=64):
    buf = torch.full((rows + 2 * pad, cols), float("nan"), device=DEV, dtype=torch.bfloat16)
    view = buf[pad:pad + rows]
    view.copy_(torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16))
    return view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offsets,why", BAD_OFFSETS, ids=[c[-1][:40] for c in BAD_OFFSETS])
def test_bad_offsets_stay_in_bounds_and_flag(backend, offsets, why, monkeypatch):
    from tlx_dist.grouped_gemm import check_offsets, offsets_flag
    from tlx_dist.grouped_gemm.reference import safe_offsets_ref

    monkeypatch.delenv("TLX_DIST_CHECK_OFFSETS", raising=False)  # the device guard, not the host check
    torch.manual_seed(5)
    N, D, F = 1000, 128, 256
    off = torch.tensor(offsets, dtype=torch.int64, device=DEV)
    E = off.shape[0]
    safe, bits = safe_offsets_ref(off.cpu(), N)
    safe = safe.to(DEV)
    x, dy = _nan_padded(N, D), _nan_padded(N, F)
    w = torch.randn(E, D, F, device=DEV, dtype=torch.bfloat16) / math.sqrt(D)
    flag = offsets_flag(DEV)
    flag.zero_()
    b = get_backend(backend)
    y = b.mm(x, w, off)
    dx = b.mm(dy, w.transpose(1, 2), off)
    dw = b.wgrad(x, dy, off)
    torch.cuda.synchronize()
    xs, dys, wt = x.clone(), dy.clone(), w.transpose(1, 2)
    _close(y, grouped_mm_ref(xs, w, safe), grouped_mm_ref(xs.double(), w.double(), safe), f"{backend} fwd ({why})")
    _close(dx, grouped_mm_ref(dys, wt, safe), grouped_mm_ref(dys.double(), wt.double(), safe), f"{backend} dX ({why})")
    _close(dw, grouped_mm_wgrad_ref(xs, dys, safe), grouped_mm_wgrad_ref(xs.double(), dys.double(), safe),
           f"{backend} dW ({why})")
    assert int(flag) == int(bits), f"{backend} ({why}): flag {int(flag)} != expected {int(bits)}"
    # Through the public API (autograd and all) the same: no host check on the GPU by default.
    xg = x.detach().requires_grad_()
    grouped_mm(xg, w, off, backend=backend).float().sum().backward()
    if int(bits):
        with pytest.raises(ValueError, match="out-of-range offsets_E"):
            check_offsets(DEV)
    else:
        check_offsets(DEV)
    assert int(flag) == 0
    assert torch.isfinite(xg.grad).all()


def test_check_offsets_env_raises_before_launch(monkeypatch):
    # TLX_DIST_CHECK_OFFSETS=1: the opt-in host check (a sync) raises at the call instead.
    monkeypatch.setenv("TLX_DIST_CHECK_OFFSETS", "1")
    x = torch.randn(100, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 64, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(x, w, _offsets([50, -10]))
    with pytest.raises(ValueError, match="exceeds the number of rows"):
        grouped_mm(x, w, torch.tensor([50, 101], dtype=torch.int32, device=DEV))
