"""FP8 grouped GEMMs on CPU: the references against float64 math on the dequantized operands, the
torch ``_scaled_mm`` path and the differentiable op against them, custom-op checks, the weight
cache, backend choice and its errors (precision='fp8' never falls back to bf16 silently).

Tolerances: the float32 reference is exact up to float32 rounding: per element
``|y32 - y64| <= (K + 2) * 2**-24 * (|A| @ |B|)`` (one rounding per dequantized operand, K in the
sum). bf16 outputs follow STYLE.md 6 (tlx_dist/testing.py) with torch's FP8 path on the same
quantized operands (``*_torch``) as "torch in the same dtype".
"""

import pytest
import torch

from tlx_dist import fp8
from tlx_dist.fp8 import api as A
from tlx_dist.fp8.reference import dequantize_b
from tlx_dist.testing import assert_close_to_ref


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


# (counts, N, D, F, why). D, F multiples of 16 where the torch path runs (torch._scaled_mm).
CASES = [
    ([40, 0, 150, 7], 200, 256, 80, "zero-token expert; an expert of 150 rows; 3 padding rows"),
    ([64], 64, 200, 96, "one expert takes all, T < 128 rows; D = 200 not a multiple of 128"),
    ([0, 0, 0], 10, 128, 128, "every expert empty: all rows padding (zeros), dW zeros"),
    ([1, 2, 3, 0, 5, 0, 7], 18, 144, 48, "prime E=7, tiny experts, a single-row expert"),
    ([130, 126], 256, 384, 48, "experts straddling the 128-row tiles; K over three groups"),
]


def _data(counts, N, D, F, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(N, D, generator=g)
    if outliers:
        x[:, 5 % D] = 1e4  # an outlier per row
        if N > 2:
            x[1, :min(D, 128)] = 0.0  # an all-zero tile
            x[2] = x[2] * 1e-20  # tiny scales
    w = torch.randn(E, D, F, generator=g) / D ** 0.5
    dy = torch.randn(N, F, generator=g)
    return x.bfloat16(), w.bfloat16(), dy.bfloat16(), _offsets(counts)


def _gamma_bound(A64, B64_t, offsets, K):
    """(K + 2) u * (|A| @ |B|) per row block of each expert (the float32 error bound)."""
    out = torch.zeros(A64.shape[0], B64_t.shape[2], dtype=torch.float64)
    ends = offsets.tolist()
    for e, hi in enumerate(ends):
        lo = ends[e - 1] if e else 0
        out[lo:hi] = A64[lo:hi].abs() @ B64_t[e].abs()
    return (K + 2) * 2.0 ** -24 * out


@pytest.mark.parametrize("counts,N,D,F,why", CASES, ids=[c[4] for c in CASES])
def test_mm_ref_float32_is_exact_up_to_rounding(counts, N, D, F, why):
    x, w, dy, off = _data(counts, N, D, F)
    a = fp8.quantize_rows(x)
    wq = fp8.quantize_weight(w)
    for b_q, b_s, aa, K in ((wq.q_EFD, wq.s_EFbDb, a, D), (wq.q_EDF, wq.s_EDbFb, fp8.quantize_rows(dy), F)):
        y32 = fp8.mm_fp8_ref(aa, b_q, b_s, off, torch.float32)
        y64 = fp8.mm_fp8_ref(aa, b_q, b_s, off, torch.float64)
        bound = _gamma_bound(fp8.dequantize_rows(aa, torch.float64), dequantize_b(b_q, b_s, torch.float64).transpose(1, 2),
                             off, K)
        assert ((y32.double() - y64).abs() <= bound).all()
        assert (y64[int(off[-1]):] == 0).all(), "padding rows must be zero"


@pytest.mark.parametrize("counts,N,D,F,why", CASES, ids=[c[4] for c in CASES])
def test_wgrad_ref_float32_is_exact_up_to_rounding(counts, N, D, F, why):
    x, w, dy, off = _data(counts, N, D, F)
    xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    dw32 = fp8.wgrad_fp8_ref(xc, dyc, torch.float32)
    dw64 = fp8.wgrad_fp8_ref(xc, dyc, torch.float64)
    xd, dyd = fp8.dequantize_cols(xc, torch.float64), fp8.dequantize_cols(dyc, torch.float64)
    ends = off.tolist()
    for e, hi in enumerate(ends):
        lo = ends[e - 1] if e else 0
        bound = (hi - lo + 2) * 2.0 ** -24 * (xd[lo:hi].abs().t() @ dyd[lo:hi].abs())
        assert ((dw32[e].double() - dw64[e]).abs() <= bound).all()
        if hi == lo:
            assert (dw64[e] == 0).all()


@pytest.mark.parametrize("counts,N,D,F,why", [c for c in CASES if c[2] % 16 == 0 and c[3] % 16 == 0],
                         ids=[c[4] for c in CASES if c[2] % 16 == 0 and c[3] % 16 == 0])
def test_torch_path_matches_ref64(counts, N, D, F, why):
    # torch._scaled_mm per expert and k-group (fp32 partials, fp32 scale application): within the
    # bf16 output rounding of the exact result.
    x, w, dy, off = _data(counts, N, D, F)
    a, wq = fp8.quantize_rows(x), fp8.quantize_weight(w)
    y = fp8.mm_fp8_torch(a, wq.q_EFD, wq.s_EFbDb, off)
    y64 = fp8.mm_fp8_ref(a, wq.q_EFD, wq.s_EFbDb, off, torch.float64)
    assert_close_to_ref(y, y64, y64.to(torch.bfloat16), name="mm_fp8_torch")
    xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    dw = fp8.wgrad_fp8_torch(xc, dyc)
    dw64 = fp8.wgrad_fp8_ref(xc, dyc, torch.float64)
    assert_close_to_ref(dw, dw64, dw64.to(torch.bfloat16), name="wgrad_fp8_torch")


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("counts,N,D,F,why", [c for c in CASES if c[2] % 16 == 0 and c[3] % 16 == 0],
                         ids=[c[4] for c in CASES if c[2] % 16 == 0 and c[3] % 16 == 0])
def test_grouped_mm_fp8_autograd(counts, N, D, F, why, backend):
    x, w, dy, off = _data(counts, N, D, F, outliers=backend == "reference")
    x.requires_grad_()
    w.requires_grad_()
    y = fp8.grouped_mm_fp8(x, w, off, backend=backend)
    y.backward(dy)
    # Oracles: float64 on the same quantized operands, torch's FP8 path in bf16 as "torch_same_dtype".
    a, wq = fp8.quantize_rows(x.detach()), fp8.quantize_weight(w.detach())
    y64 = fp8.mm_fp8_ref(a, wq.q_EFD, wq.s_EFbDb, off, torch.float64)
    assert y.dtype == x.dtype
    assert_close_to_ref(y, y64, fp8.mm_fp8_torch(a, wq.q_EFD, wq.s_EFbDb, off), name="y")
    g = fp8.quantize_rows(dy)
    dx64 = fp8.mm_fp8_ref(g, wq.q_EDF, wq.s_EDbFb, off, torch.float64)
    assert_close_to_ref(x.grad, dx64, fp8.mm_fp8_torch(g, wq.q_EDF, wq.s_EDbFb, off), name="dx")
    xc, dyc = fp8.quantize_cols(x.detach(), off), fp8.quantize_cols(dy, off)
    dw64 = fp8.wgrad_fp8_ref(xc, dyc, torch.float64)
    assert w.grad.dtype == w.dtype
    assert_close_to_ref(w.grad, dw64, fp8.wgrad_fp8_torch(xc, dyc), name="dw")
    # the FP8 result is the unquantized product within e4m3's error (a few percent), not garbage
    if backend == "torch" and off[-1] > 0:
        exact = torch.cat([x.detach()[lo:hi].double() @ w.detach()[e].double() for e, (lo, hi) in
                           enumerate(zip([0] + off.tolist()[:-1], off.tolist()))])
        rel = (y[:int(off[-1])].double() - exact).norm() / exact.norm().clamp_min(1e-30)
        assert rel < 0.06, rel


def test_wgrad_function_and_cache():
    x, w, dy, off = _data([70, 0, 58], 140, 128, 64, outliers=False)
    dw = fp8.grouped_mm_fp8_wgrad(x, dy, off)
    xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    assert_close_to_ref(dw, fp8.wgrad_fp8_ref(xc, dyc, torch.float64), fp8.wgrad_fp8_torch(xc, dyc), name="dw")
    # cache: quantizes once per weight version, again after an in-place update (an optimizer step)
    p = torch.nn.Parameter(w.clone())
    cache = fp8.Fp8WeightCache()
    q1 = cache.get(p)
    assert cache.get(p) is q1 and cache.quantizations == 1
    with torch.no_grad():
        p.mul_(2)
    q2 = cache.get(p)
    assert cache.quantizations == 2 and torch.allclose(q2.s_EDbFb, 2 * q1.s_EDbFb)
    y = fp8.grouped_mm_fp8(x, p, off, w_fp8=q2)
    assert torch.equal(y, fp8.grouped_mm_fp8(x, p, off))
    cache.invalidate()
    cache.get(p)
    assert cache.quantizations == 3


def test_custom_ops_opcheck_and_compile():
    x, w, dy, off = _data([20, 0, 12], 40, 128, 64, outliers=False)
    a, wq = fp8.quantize_rows(x), fp8.quantize_weight(w)
    xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    # test_schema compares fp8 tensors with allclose, which torch cannot do on CPU for float8 dtypes
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    ops = torch.ops.tlx_dist
    torch.library.opcheck(ops.fp8_mm, (a.q_MC, a.s_MCb.t().contiguous(), wq.q_EFD, wq.s_EFbDb, off, torch.bfloat16,
                                       "reference"), test_utils=utils)
    torch.library.opcheck(ops.fp8_wgrad, (xc.q_CP, xc.s_TC, dyc.q_CP, dyc.s_TC, xc.tile_cum_E1, xc.offsets_E, 40,
                                          torch.bfloat16, "reference"), test_utils=utils)
    torch.library.opcheck(ops.fp8_quantize_rows, (x, "reference"), test_utils=utils)
    torch.library.opcheck(ops.fp8_quantize_cols, (x, off, "reference"), test_utils=utils)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.library.opcheck(ops.grouped_mm_fp8, (xg, wg, wq.q_EFD, wq.s_EFbDb, wq.q_EDF, wq.s_EDbFb, off, "reference"),
                          test_utils=utils)
    f = torch.compile(lambda x_, w_, o, q: fp8.grouped_mm_fp8(x_, w_, o, w_fp8=q, backend="reference"),
                      fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x, w, off, wq), fp8.grouped_mm_fp8(x, w, off, w_fp8=wq, backend="reference"))


def _fake_cuda(monkeypatch, cc, name="NVIDIA A100-SXM4-80GB", arch="other", tlx_ok=True):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.version, "hip", None)
    import tlx

    return tlx.override(arch=arch, tlx=tlx_ok)


def test_backend_choice_and_errors(monkeypatch):
    cpu = torch.device("cpu")
    assert A.select_fp8_backend(cpu, 128, 64) == "reference"
    assert A.select_fp8_backend(cpu, 100, 64) == "reference"  # the reference takes any shape
    assert A.select_fp8_backend(cpu, 128, 64, "torch") == "torch"
    with pytest.raises(ValueError, match="backend='tlx' needs a CUDA device"):
        A.select_fp8_backend(cpu, 128, 64, "tlx")
    with pytest.raises(ValueError, match="must be one of"):
        A.select_fp8_backend(cpu, 128, 64, "bf16")
    gpu = torch.device("cuda", 0)
    with _fake_cuda(monkeypatch, (8, 0)):
        with pytest.raises(ValueError, match=r"precision='fp8'.*A100.*sm_80.*no FP8 tensor cores"):
            A.select_fp8_backend(gpu, 128, 64)
        with pytest.raises(ValueError, match="no FP8 tensor cores"):
            A.select_fp8_backend(gpu, 128, 64, "torch")  # pinning does not bypass the capability check
    with _fake_cuda(monkeypatch, (9, 0), "NVIDIA H200", "sm_90"):
        assert A.select_fp8_backend(gpu, 4096, 14336) == "tlx"
        assert A.select_fp8_backend(gpu, 4096, 14336, "torch") == "torch"
        with pytest.raises(ValueError, match=r"precision='fp8'.*w_EDF.*multiples of 16.*100"):
            A.select_fp8_backend(gpu, 100, 64, what="w_EDF's (D, F) = (100, 64)")
    with _fake_cuda(monkeypatch, (9, 0), "NVIDIA H200", "sm_90", tlx_ok=False):
        assert A.select_fp8_backend(gpu, 4096, 14336) == "torch"
        with pytest.raises(ValueError, match="backend='tlx' needs sm_90 with fbtriton"):
            A.select_fp8_backend(gpu, 4096, 14336, "tlx")
    with _fake_cuda(monkeypatch, (10, 0), "NVIDIA B200", "sm_100"):
        assert A.select_fp8_backend(gpu, 4096, 14336) == "torch"
    monkeypatch.setattr(torch.version, "hip", "6.3")
    with pytest.raises(ValueError, match="precision='fp8': ROCm"):
        A.select_fp8_backend(gpu, 4096, 14336)


def test_bad_arguments():
    x, w, dy, off = _data([4, 4], 8, 128, 64, outliers=False)
    with pytest.raises(ValueError, match="x_ND has D=128 columns but w_EDF expects D=64"):
        fp8.grouped_mm_fp8(x, w.transpose(1, 2), off)
    with pytest.raises(ValueError, match="offsets_E must be 1-D"):
        fp8.grouped_mm_fp8(x, w, off[:1])
    with pytest.raises(TypeError, match="offsets_E must be int32 or int64"):
        fp8.grouped_mm_fp8(x, w, off.float())
    with pytest.raises(TypeError, match="x_ND must be"):
        fp8.grouped_mm_fp8(x.double(), w, off)
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8.grouped_mm_fp8(x, w, torch.tensor([6, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="exceeds the number of rows"):
        fp8.grouped_mm_fp8(x, w, torch.tensor([6, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="E=0"):
        fp8.grouped_mm_fp8(x, w[:0], off[:0])
    wq = fp8.quantize_weight(w[:, :, :32])
    with pytest.raises(ValueError, match="stale copy"):
        fp8.grouped_mm_fp8(x, w, off, w_fp8=wq)
    with pytest.raises(TypeError, match="w_fp8 must be an Fp8Weight"):
        fp8.grouped_mm_fp8(x, w, off, w_fp8=w)
    with pytest.raises(ValueError, match="dy_NF has N=7"):
        fp8.grouped_mm_fp8_wgrad(x, dy[:7], off)
    a = fp8.quantize_rows(x)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8.mm_fp8(a, fp8.quantize_weight(w).q_EFD, fp8.quantize_weight(w).s_EFbDb, off, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        fp8.mm_fp8(a, fp8.quantize_weight(w).q_EDF, fp8.quantize_weight(w).s_EDbFb, off)
