"""FP8 grouped GEMMs and quantization on the GPU (tier T3; the TLX kernels need an sm_90 GPU).

Quantization kernels (hardware ``cvt.rn.satfinite`` to e4m3) must equal the torch references bit
for bit. GEMMs (forward, dX, dW) follow STYLE.md 6 with torch's own FP8 path as the same-dtype
computation: ``max|ours - ref64| <= 2 * max|torch_fp8 - ref64| + atol``, where ``ref64`` is the
float64 product of the dequantized operands (exact but for the final sum's rounding),
``torch_fp8`` runs ``torch._scaled_mm`` on the same quantized operands per expert and 128-wide
k-group with the block scales applied in fp32 (tlx_dist/fp8/reference.py ``*_torch``: the
kernels' algorithm with cuBLAS doing the FP8 products), and ``atol = max|ref64| * 2**-8`` (half a
bf16 ulp at the largest magnitude: two correct fp32-promoting kernels can round one element to
neighbouring bf16 values where torch happened to land exactly). Outputs are poisoned with NaN
first, so an element no tile wrote shows up; rows past the last offset must be exactly zero.
"""

import pytest
import torch

import tlx
from tlx_dist import fp8
from tlx_dist.fp8 import quant as Q
from tlx_dist.fp8.tlx_gemm import CANDIDATES, mm_fp8_tlx, wgrad_fp8_tlx

# Collected everywhere (so a CPU run proves the module imports and parametrizes), run only on a GPU.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
needs_tlx = pytest.mark.skipif(not (tlx.tlx_available() and tlx.gpu_arch() == "sm_90"),
                               reason="the TLX FP8 kernels need sm_90 with fbtriton")


def _poison(nbytes: int):
    t = torch.empty(nbytes // 4 + 4096, dtype=torch.float32, device=DEV).fill_(float("nan"))
    del t


def _close(ours, torch_fp8, ref64, what):
    assert ours.shape == ref64.shape, what
    assert not torch.isnan(ours).any(), f"{what}: NaN (unwritten or poisoned elements)"
    err = (ours.double() - ref64).abs().max().item() if ours.numel() else 0.0
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    bound = 2 * (torch_fp8.double() - ref64).abs().max().item() + scale * 2 ** -8 + 1e-6
    assert err <= bound, f"{what}: max error {err:.4g} > bound {bound:.4g}"


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64, device=DEV).cumsum(0).to(torch.int32)


def _zipf(total, E, s=1.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    p = p[torch.randperm(E, generator=g)]
    c = torch.floor(p / p.sum() * total).long()
    c[0] += total - int(c.sum())
    return c.tolist()


def _data(counts, N, D, F, seed=0, adversarial=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    E = len(counts)
    x = torch.randn(N, D, device=DEV, generator=g)
    dy = torch.randn(N, F, device=DEV, generator=g)
    if adversarial:
        x[:, 7 % D] = 1e4  # an outlier per row
        x[: min(N, 3), : min(D, 128)] = 0.0  # all-zero tiles
        dy[N // 2:N // 2 + 2] *= 1e-20  # tiny scales
    w = torch.randn(E, D, F, device=DEV, generator=g) / D ** 0.5
    if adversarial and D >= 128 and F >= 128:
        w[0, :128, :128] = 0.0  # an all-zero weight block
    return x.bfloat16(), w.bfloat16(), dy.bfloat16(), _offsets(counts)


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else t


# --- quantization -------------------------------------------------------------------------------


@pytest.mark.parametrize("pow2", [False, True])
def test_quant_kernels_match_references(pow2):
    x, w, dy, off = _data([300, 0, 129, 1, 70], 512, 400, 272, adversarial=True)
    x[5, 3::2] = -0.0
    x[6] *= 2.0 ** -14  # values landing in e4m3's subnormal range after scaling
    a, b = Q.quantize_rows(x, pow2=pow2), Q.quantize_rows_ref(x, pow2=pow2)
    assert torch.equal(_bits(a.q_MC), _bits(b.q_MC)) and torch.equal(a.s_MCb, b.s_MCb)
    a, b = Q.quantize_cols(dy, off, pow2=pow2), Q.quantize_cols_ref(dy, off, pow2=pow2)
    T = int(b.tile_cum_E1[-2])
    assert torch.equal(a.tile_cum_E1, b.tile_cum_E1)
    assert torch.equal(_bits(a.q_CP[:, :128 * T]), _bits(b.q_CP[:, :128 * T])) and torch.equal(a.s_TC[:T], b.s_TC[:T])
    a, b = Q.quantize_weight(w, pow2=pow2), Q.quantize_weight_ref(w, pow2=pow2)
    for f in ("q_EFD", "s_EFbDb", "q_EDF", "s_EDbFb"):
        assert torch.equal(_bits(getattr(a, f)), _bits(getattr(b, f))), f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequant_kernel_matches_reference_on_packed_rows(dtype):
    # the FP8 dispatch's receiver: q a strided view of packed rows, scales in [Cb, N]
    from tlx_dist.fp8.dispatch import pack_rows, unpack_rows

    x, _, _, _ = _data([300, 0, 129, 1, 70], 500, 400, 272, adversarial=True)
    rows = unpack_rows(pack_rows(Q.quantize_rows(x), torch.bfloat16), 400)
    assert rows.q_MC.stride(0) != 400  # strided
    got = Q.dequantize_rows_rounded(rows, dtype)
    want = Q.dequantize_rows(rows, torch.float32).to(dtype)
    assert torch.equal(got, want)


# --- GEMMs --------------------------------------------------------------------------------------

# (counts, N, D, F, adversarial, why)
def _zipf_with_empty(total, E):
    c = _zipf(total, E)
    c[3], c[5], c[9] = c[3] + c[5] + c[9], 0, 0  # two zero-token experts
    return c


CASES = [
    ([512] * 8, 4096, 1024, 768, False, "balanced E=8, several tiles per expert"),
    (_zipf_with_empty(3000, 16), 3000, 512, 1408, True, "Zipf-imbalanced E=16 (zero-token experts), adversarial values"),
    ([37, 0, 300, 1, 0, 150], 500, 400, 272, True, "K = 400 not a multiple of 128; NN tails; 12 padding rows"),
    ([96], 96, 256, 128, True, "one expert takes all, T < 128 rows"),
    ([0, 0, 0], 64, 128, 256, False, "every expert empty: all rows padding"),
    ([2000, 48], 2048, 4096, 256, True, "K = 4096: the promotion keeps the error flat in K"),
]


def _mm_check(a, b_q, b_s, off, cfg, what):
    N, NN = a.q_MC.shape[0], b_q.shape[1]
    _poison(N * NN * 2)
    y = mm_fp8_tlx(a.q_MC, a.s_MCb, b_q, b_s, off, cfg=cfg)
    ref64 = fp8.mm_fp8_ref(a, b_q, b_s, off, torch.float64)
    _close(y, fp8.mm_fp8_torch(a, b_q, b_s, off), ref64, what)
    assert (y[int(off[-1]):] == 0).all(), f"{what}: padding rows must be zero"


def _cfg_id(c):
    return "default" if c is None else f"BN{c.BN}_SUBN{c.SUBN}"


@needs_tlx
@pytest.mark.parametrize("cfg", [None] + list(CANDIDATES[1:]), ids=_cfg_id)
@pytest.mark.parametrize("counts,N,D,F,adv,why", CASES, ids=[c[5] for c in CASES])
def test_mm_forward_and_dgrad(counts, N, D, F, adv, why, cfg):
    x, w, dy, off = _data(counts, N, D, F, adversarial=adv)
    wq = fp8.quantize_weight(w)
    _mm_check(fp8.quantize_rows(x), wq.q_EFD, wq.s_EFbDb, off, cfg, f"forward ({why})")
    _mm_check(fp8.quantize_rows(dy), wq.q_EDF, wq.s_EDbFb, off, cfg, f"dX ({why})")


@needs_tlx
# (CANDIDATES[1] spills in this form, so it is slow there, but a pinned config runs every form)
@pytest.mark.parametrize("cfg", [None] + list(CANDIDATES[1:]), ids=_cfg_id)
@pytest.mark.parametrize("counts,N,D,F,adv,why", CASES, ids=[c[5] for c in CASES])
def test_wgrad(counts, N, D, F, adv, why, cfg):
    x, w, dy, off = _data(counts, N, D, F, adversarial=adv)
    xc, dyc = fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    _poison(len(counts) * D * F * 2)
    dw = wgrad_fp8_tlx(xc, dyc, cfg=cfg)
    _close(dw, fp8.wgrad_fp8_torch(xc, dyc), fp8.wgrad_fp8_ref(xc, dyc, torch.float64), f"dW ({why})")
    for e, n in enumerate(counts):
        if n == 0:
            assert (dw[e] == 0).all(), "an expert without rows gets zeros"


@needs_tlx
def test_autograd_tlx_matches_torch_path():
    counts = _zipf(2048, 8)
    x, w, dy, off = _data(counts, 2048, 512, 768)
    outs = {}
    for backend in ("tlx", "torch"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8.grouped_mm_fp8(xg, wg, off, backend=backend)
        y.backward(dy)
        outs[backend] = (y, xg.grad, wg.grad)
    a, wq = fp8.quantize_rows(x), fp8.quantize_weight(w)
    g, xc, dyc = fp8.quantize_rows(dy), fp8.quantize_cols(x, off), fp8.quantize_cols(dy, off)
    refs = (fp8.mm_fp8_ref(a, wq.q_EFD, wq.s_EFbDb, off, torch.float64),
            fp8.mm_fp8_ref(g, wq.q_EDF, wq.s_EDbFb, off, torch.float64),
            fp8.wgrad_fp8_ref(xc, dyc, torch.float64))
    for i, what in enumerate(("y", "dx", "dw")):
        _close(outs["tlx"][i], outs["torch"][i], refs[i], f"autograd {what}")


@needs_tlx
def test_cuda_graph_capture_no_host_sync():
    # The forward (quantize x + GEMM, weight quantized before) never reads device values on the host.
    x, w, dy, off = _data(_zipf(1024, 8), 1024, 256, 512)
    wq = fp8.Fp8WeightCache().get(w)
    f = lambda: fp8.grouped_mm_fp8(x, w, off, w_fp8=wq, backend="tlx")  # noqa: E731
    expect = f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expect)


@needs_tlx
def test_bad_offsets_are_clamped_and_flagged():
    from tlx_dist.grouped_gemm import check_offsets, offsets_flag

    x, w, dy, off = _data([64, 64], 128, 128, 128)
    offsets_flag(DEV).zero_()
    bad = torch.tensor([100, 400], dtype=torch.int32, device=DEV)  # past N: clamped to [0, N]
    y = fp8.grouped_mm_fp8(x, w, bad, backend="tlx")
    wq = fp8.quantize_weight(w)
    safe = torch.tensor([100, 128], dtype=torch.int32, device=DEV)
    a = fp8.quantize_rows(x)
    _close(y, fp8.mm_fp8_torch(a, wq.q_EFD, wq.s_EFbDb, safe), fp8.mm_fp8_ref(a, wq.q_EFD, wq.s_EFbDb, safe,
                                                                               torch.float64), "clamped offsets")
    with pytest.raises(ValueError, match="out-of-range offsets_E"):
        check_offsets()


def test_errors_on_this_gpu():
    # Shapes the GPU paths cannot take are an error naming the argument, never a bf16 fallback.
    x = torch.randn(64, 100, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 100, 64, device=DEV, dtype=torch.bfloat16)
    off = _offsets([32, 32])
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="no FP8 tensor cores"):
            fp8.grouped_mm_fp8(x, w, off)
    else:
        with pytest.raises(ValueError, match=r"precision='fp8'.*w_EDF.*multiples of 16"):
            fp8.grouped_mm_fp8(x, w, off)
        with pytest.raises(TypeError, match="bfloat16 or float16"):
            fp8.grouped_mm_fp8(x.float()[:, :96], w.float()[:, :96], off)
