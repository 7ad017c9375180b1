"""FP8 block quantization kernels (plain Triton): 1x128 activation tiles, 128x128 weight blocks.

Legend: M rows (tokens, expert-major), C columns (features), E experts, G the group (128), Cb =
cdiv(C, G) column groups, T a bound on the expert-aligned 128-row tiles (``M // G + E + 1``),
P = G * T padded token columns. ``offsets_E`` the (guarded, int32) cumulative end row per expert,
``tile_cum_E1`` the inclusive cumsum of each expert's G-row tiles (tlx/common/scheduler.py's prep
kernel with BM = G), so expert ``e``'s tiles are ``[tile_cum[e-1], tile_cum[e])``.

Every group of G values shares one fp32 scale ``s = max(amax, AMAX_FLOOR) / FP8_MAX`` (or, with
POW2, the next power of two up from it, exactly an e8m0 value) and is stored as
``fp8(clamp(x * inv, -FP8_MAX, FP8_MAX))`` with ``inv = FP8_MAX / max(amax, AMAX_FLOOR)``;
dequantized it is ``q * s``. The floor keeps an all-zero group at zeros (not 0 * inf = NaN) and
``inv`` finite. Divisions are ``div_rn`` (IEEE, as torch's), so the kernels and the references in
tlx_dist/fp8/quant.py agree bit for bit.

Kernels (each stores the FP8 bit patterns through a uint8 view):
  ``_quant_rows_kernel``   x [M, C] -> q [M, C], s [Cb, M] (M-contiguous: the [M, Cb] operand of
                           the forward / dX GEMMs, as torch._scaled_mm and DeepGEMM lay it out).
  ``_quant_cols_kernel``   x [M, C] -> q [C, P], s [T, C]: the transposed, expert-tile-aligned
                           operand of the weight gradient (K = tokens). Tile t of expert e holds its
                           rows ``lo + G*j ...`` (j = t - tile_cum[e-1]) at columns ``G*t ...``;
                           columns past the expert's last row are zeros, so a GEMM k-step over a
                           tile never reads another expert's rows. Slack tiles past
                           ``tile_cum[E-1]`` are not written. Body: ``expert_tile`` + ``store_cols``.
  ``_quant_cols_from_rows_kernel``  q [M, C] e4m3 (any row stride), s [M, Cb] (any strides) -> q [C, P],
                           s [T, C]: ``_quant_cols_kernel`` of x = q * s rounded once to DTYPE (as
                           ``_dequant_rows_kernel`` makes it), from the FP8 rows themselves -- the
                           weight gradient's operand of an FP8 dispatch's rows, with no [M, C] x.
  ``_quant_both_kernel``   x [M, C] -> both of the above in one read of x: grid (T, Cb), one
                           expert-aligned tile (padding tiles included) x one group of G columns;
                           every row gets its row quantization (padding rows too, as the rows
                           kernel's), only the experts' tiles their column quantization (as the cols
                           kernel's). ``expert_tile`` + ``store_rows_cols`` are its body, shared with
                           the SwiGLU kernels that emit both forms (tlx/common/fp8_swiglu.py).
  ``_quant_blocks_kernel`` w [E, R, C] -> q [E, R, C] and its transpose qt [E, C, R], s [E, Rb, Cb]
                           and st [E, Cb, Rb] (one pass: the forward wants K-contiguous weights,
                           dX the original layout).
  ``_dequant_rows_kernel`` q [M, C] (any row stride), s [Cb, M] -> y [M, C] = q * s: the fp32
                           product rounded once to y's dtype (an FP8 dispatch's receiver, e4m3fn;
                           compiled only: the interpreter's fp8 casts are not exact).

FMT: 0 = e4m3fn (NVIDIA, max 448), 1 = e4m3fnuz (AMD MI300, max 240). EMULATE (tests, under
TRITON_INTERPRET=1, whose fp8 casts neither round to nearest-even nor saturate nor keep
subnormals): the FP8 encoding is computed with integer arithmetic instead of the hardware cast;
the compiled kernels use the cast (``cvt.rn.satfinite``). The same flag makes ``round_to``'s
fp32 -> bf16 rounding integer arithmetic (the interpreter's cast truncates), and EMULATE_IN the
e4m3 decode (``decode_fp8``: the interpreter's turns NaN into 480; NVIDIA has no e4m3fnuz type).
"""

import triton
import triton.language as tl

from tlx import c_launch as _c_launch

from tlx.common.scheduler import _search_expert, expert_rows

AMAX_FLOOR = tl.constexpr(1e-12)
E4M3FN_MAX = tl.constexpr(448.0)
E4M3FNUZ_MAX = tl.constexpr(240.0)


@triton.jit
def fp8_max(FMT: tl.constexpr):
    if FMT == 0:
        m: tl.constexpr = E4M3FN_MAX
    else:
        m: tl.constexpr = E4M3FNUZ_MAX
    return m


@triton.jit
def scale_from_amax(amax, FMT: tl.constexpr, POW2: tl.constexpr):
    """(scale, inv) fp32 for a group's amax (any shape). POW2: scale = 2**ceil(log2(amax / max))."""
    top = tl.full(amax.shape, fp8_max(FMT), tl.float32)
    a = tl.maximum(amax, AMAX_FLOOR)
    if POW2:
        r = tl.math.div_rn(a, top)
        bits = r.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (e << 23).to(tl.float32, bitcast=True)
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.math.div_rn(a, top)
        inv = tl.math.div_rn(top, a)
    return s, inv


@triton.jit
def _encode_soft(v, FMT: tl.constexpr):
    # v: fp32 already clamped to the format's range. Round-to-nearest-even on the fp32 bits; an
    # e4m3 value has 3 mantissa bits, bias 7 (fn) or 8 (fnuz); below the smallest normal the step
    # is 2**-9 (fn) / 2**-10 (fnuz).
    if FMT == 0:
        BIAS: tl.constexpr = 7
    else:
        BIAS: tl.constexpr = 8
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag_bits = bits & 0x7FFFFFFF
    a = mag_bits.to(tl.float32, bitcast=True)
    rounded = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20
    normal = rounded - ((127 - BIAS) << 3)
    sub_unit = tl.full(v.shape, 2.0 ** (BIAS + 2), tl.float32)
    magic = tl.full(v.shape, 8388608.0, tl.float32)  # 2**23: adding and subtracting rounds to an integer (RNE)
    sub = ((a * sub_unit + magic) - magic).to(tl.int32)
    min_normal = tl.full(v.shape, 2.0 ** (1 - BIAS), tl.float32)
    mag = tl.where(a >= min_normal, normal, sub)
    if FMT == 1:
        sign = tl.where(mag == 0, 0, sign)  # fnuz has no -0 (0x80 is its NaN)
    return ((sign << 7) | mag).to(tl.uint8)


@triton.jit
def encode_fp8(v, FMT: tl.constexpr, EMULATE: tl.constexpr):
    """uint8 bit patterns of fp32 ``v`` (clamped to the format's range) as e4m3fn / e4m3fnuz."""
    if EMULATE:
        out = _encode_soft(v, FMT)
    elif FMT == 0:
        out = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        out = v.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
    return out


@triton.jit
def _decode_soft(b, FMT: tl.constexpr):
    # fp32 value of e4m3 bit patterns ``b`` (uint8) in integer arithmetic: the interpreter's decode
    # turns e4m3fn's NaN (0x7F / 0xFF) into 480, and Triton on NVIDIA has no e4m3fnuz type. Normals
    # rebuild the fp32 bits; subnormals are ``m * 2**(-BIAS - 2)``, exact; fn's NaN is S.1111.111,
    # fnuz's is 0x80 (it has no -0).
    if FMT == 0:
        BIAS: tl.constexpr = 7
    else:
        BIAS: tl.constexpr = 8
    bi = b.to(tl.int32)
    sign = (bi >> 7) & 1
    e = (bi >> 3) & 0xF
    m = bi & 7
    normal = ((e + (127 - BIAS)) << 23) | (m << 20)
    sub = (m.to(tl.float32) * tl.full(b.shape, 2.0 ** (-BIAS - 2), tl.float32)).to(tl.int32, bitcast=True)
    v = ((sign << 31) | tl.where(e == 0, sub, normal)).to(tl.float32, bitcast=True)  # the sign as a bit: -0 stays -0
    if FMT == 0:
        nan = (bi & 0x7F) == 0x7F
    else:
        nan = bi == 0x80
    return tl.where(nan, tl.full(b.shape, float("nan"), tl.float32), v)


@triton.jit
def decode_fp8(b, FMT: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 values of e4m3fn / e4m3fnuz bit patterns ``b`` (uint8), exact (NaN stays NaN)."""
    if EMULATE:
        out = _decode_soft(b, FMT)
    elif FMT == 0:
        out = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        out = b.to(tl.float8e4b8, bitcast=True).to(tl.float32)
    return out


@triton.jit
def round_bf16_soft(v):
    """(bf16 of fp32 ``v`` rounded to nearest even, its fp32 value) in integer arithmetic: the
    interpreter's fp32 -> bf16 cast truncates and mishandles subnormals. bf16 is fp32's top 16
    bits, so rounding the magnitude's bits at bit 16 is exact for normals, subnormals and overflow."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    r = ((mag + 0x7FFF + ((mag >> 16) & 1)) >> 16) | (sign << 15)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True), (r << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_to(v, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """(fp32 ``v`` rounded once to ``DTYPE`` (bf16 / fp16 / fp32), that value back in fp32). The
    interpreter's fp32 -> fp16 cast rounds to nearest even already; its bf16 cast does not."""
    if EMULATE and DTYPE == tl.bfloat16:
        vr, vf = round_bf16_soft(v)
    else:
        vr = v.to(DTYPE)
        vf = vr.to(tl.float32)
    return vr, vf


@triton.jit
def quantize_block(x, inv, FMT: tl.constexpr, EMULATE: tl.constexpr):
    top = fp8_max(FMT)
    return encode_fp8(tl.minimum(tl.maximum(x * inv, -top), top), FMT, EMULATE)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, C, stride_xm, stride_qm, stride_sk,
                       G: tl.constexpr, BLOCK_M: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                       EMULATE: tl.constexpr):
    """grid (cdiv(M, BLOCK_M), cdiv(C, G)): rows [BLOCK_M] x one group of G columns."""
    pm = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * G + tl.arange(0, G)
    ok = (rows < M)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s, inv = scale_from_amax(tl.max(tl.abs(x), axis=1), FMT, POW2)
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], quantize_block(x, inv[:, None], FMT, EMULATE), mask=ok)
    tl.store(s_ptr + kb.to(tl.int64) * stride_sk + rows, s, mask=rows < M)


@triton.jit
def expert_tile(t, tile_cum_ptr, offsets_ptr, E, M, G: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """(rows int64 [G], row mask [G], whether an expert owns it) of expert-aligned tile ``t``: the
    rows ``lo + G*j + i`` (j = t - tile_cum[e-1]) of expert ``e``, or of the padding pseudo-expert
    ``E``. A slack tile past ``tile_cum[E]`` also lands on ``E`` with ``j`` past its tiles, so its
    mask is empty: it writes nothing."""
    e = _search_expert(tile_cum_ptr, E, t, SEARCH_STEPS)
    first = tl.load(tile_cum_ptr + tl.maximum(e - 1, 0))
    first = tl.where(e > 0, first, 0)
    lo, cnt = expert_rows(offsets_ptr, e, E, M)
    r_in = (t - first) * G + tl.arange(0, G)
    return (lo + r_in).to(tl.int64), r_in < cnt, e < E


@triton.jit
def store_cols(x, cols, c_ok, t, qc_ptr, sc_ptr, stride_qc, C, G: tl.constexpr, FMT: tl.constexpr,
               POW2: tl.constexpr, EMULATE: tl.constexpr):
    """The column form of fp32 ``x`` [G, BC] (zero outside the tile's rows and ``c_ok``), tile ``t``
    x the columns ``cols``: each column's G values quantized against their amax, stored transposed
    (q [C, P] row stride ``stride_qc``, at columns ``G*t ...``; zeros past the expert's rows) with
    their scales (s [T, C]); nothing is stored for columns outside ``c_ok``."""
    sc, invc = scale_from_amax(tl.max(tl.abs(x), axis=0), FMT, POW2)
    qc = quantize_block(x, invc[None, :], FMT, EMULATE)
    dst = qc_ptr + cols.to(tl.int64)[None, :] * stride_qc + (t.to(tl.int64) * G + tl.arange(0, G))[:, None]
    tl.store(dst, qc, mask=c_ok[None, :])
    tl.store(sc_ptr + t.to(tl.int64) * C + cols, sc, mask=c_ok)


@triton.jit
def _quant_cols_kernel(x_ptr, q_ptr, s_ptr, offsets_ptr, tile_cum_ptr, E, M, C, stride_xm, stride_qc,
                       G: tl.constexpr, BLOCK_C: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                       EMULATE: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """grid (T, cdiv(C, BLOCK_C)): one expert-aligned tile of G rows x BLOCK_C columns."""
    t = tl.program_id(0)
    cb = tl.program_id(1)
    rows, r_ok, in_expert = expert_tile(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    if in_expert:  # tiles of the padding rows and the host bound's slack are not part of any expert
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cols < C
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        store_cols(x, cols, c_ok, t, q_ptr, s_ptr, stride_qc, C, G, FMT, POW2, EMULATE)


@triton.jit
def _quant_cols_from_rows_kernel(q_ptr, s_ptr, qc_ptr, sc_ptr, offsets_ptr, tile_cum_ptr, E, M, C, stride_qm,
                                 stride_sm, stride_sk, stride_qc, G: tl.constexpr, BLOCK_C: tl.constexpr,
                                 IN_FMT: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr, DTYPE: tl.constexpr,
                                 EMULATE_IN: tl.constexpr, EMULATE: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """grid (T, cdiv(C, BLOCK_C)), BLOCK_C dividing G: one expert-aligned tile of G rows x BLOCK_C
    columns of the row quantization (q [M, C] uint8 bit patterns, row stride ``stride_qm``; s
    [M, Cb] at ``s_ptr + m * stride_sm + k * stride_sk``), all in one scale group of the rows."""
    t = tl.program_id(0)
    cb = tl.program_id(1)
    rows, r_ok, in_expert = expert_tile(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    if in_expert:  # as _quant_cols_kernel: the padding rows' and the slack tiles are not written
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cols < C
        ok = r_ok[:, None] & c_ok[None, :]
        b = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=ok, other=0)
        kb = (cb * BLOCK_C) // G
        s = tl.load(s_ptr + rows * stride_sm + kb.to(tl.int64) * stride_sk, mask=r_ok, other=0.0)
        _, x = round_to(decode_fp8(b, IN_FMT, EMULATE_IN) * s[:, None], DTYPE, EMULATE)  # the dequantized x
        store_cols(tl.where(ok, x, 0.0), cols, c_ok, t, qc_ptr, sc_ptr, stride_qc, C, G, FMT, POW2, EMULATE)


@triton.jit
def store_rows_cols(x, rows, r_ok, cols, c_ok, in_expert, kb, t, q_ptr, s_ptr, stride_qm, stride_sk, qc_ptr, sc_ptr,
                    stride_qc, C, G: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """Both quantizations of fp32 ``x`` [G, G] (zero outside ``r_ok`` x ``c_ok``), the rows ``rows``
    of tile ``t`` x column group ``kb``: the row form (q [M, C] row stride ``stride_qm``, s [Cb, M]
    row stride ``stride_sk``) as ``_quant_rows_kernel`` writes it, and, when ``in_expert``, the
    column form (q [C, P] row stride ``stride_qc``, s [T, C]) as ``_quant_cols_kernel`` writes it."""
    s, inv = scale_from_amax(tl.max(tl.abs(x), axis=1), FMT, POW2)
    ok = r_ok[:, None] & c_ok[None, :]
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], quantize_block(x, inv[:, None], FMT, EMULATE), mask=ok)
    tl.store(s_ptr + kb.to(tl.int64) * stride_sk + rows, s, mask=r_ok)
    store_cols(x, cols, c_ok & in_expert, t, qc_ptr, sc_ptr, stride_qc, C, G, FMT, POW2, EMULATE)


@triton.jit
def _quant_both_kernel(x_ptr, q_ptr, s_ptr, qc_ptr, sc_ptr, offsets_ptr, tile_cum_ptr, E, M, C, stride_xm, stride_qm,
                       stride_sk, stride_qc, G: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr,
                       EMULATE: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """grid (T, cdiv(C, G)): one expert-aligned tile of G rows x one group of G columns."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    rows, r_ok, in_expert = expert_tile(t, tile_cum_ptr, offsets_ptr, E, M, G, SEARCH_STEPS)
    cols = kb * G + tl.arange(0, G)
    c_ok = cols < C
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)
    store_rows_cols(x, rows, r_ok, cols, c_ok, in_expert, kb, t, q_ptr, s_ptr, stride_qm, stride_sk, qc_ptr, sc_ptr,
                    stride_qc, C, G, FMT, POW2, EMULATE)


@triton.jit
def _quant_blocks_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, R, C, stride_we, stride_wr,
                         G: tl.constexpr, FMT: tl.constexpr, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """grid (cdiv(R, G), cdiv(C, G), E): one G x G block of expert e's [R, C] weight. Outputs are
    contiguous: q [E, R, C], qt [E, C, R], s [E, Rb, Cb], st [E, Cb, Rb]."""
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    Rb = tl.cdiv(R, G)
    Cb = tl.cdiv(C, G)
    rows = rb * G + tl.arange(0, G)
    cols = cb * G + tl.arange(0, G)
    ok = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(w_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wr + cols[None, :], mask=ok,
                other=0.0).to(tl.float32)
    s, inv = scale_from_amax(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FMT, POW2)
    q = quantize_block(x, inv, FMT, EMULATE)
    base = e * R * C
    tl.store(q_ptr + base + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=ok)
    tl.store(qt_ptr + base + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=ok)
    tl.store(s_ptr + (e * Rb + rb) * Cb + cb, s)
    tl.store(st_ptr + (e * Cb + cb) * Rb + rb, s)


@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, y_ptr, M, C, stride_qm, stride_sk, stride_ym, G: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """grid (cdiv(M, BLOCK_M), cdiv(C, G)): rows [BLOCK_M] x one group of G columns, e4m3fn."""
    pm = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * G + tl.arange(0, G)
    rm = rows < M
    m = rm[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    q = tl.load(q_ptr + r64[:, None] * stride_qm + cols[None, :], mask=m, other=0)
    sc = tl.load(s_ptr + kb * stride_sk + rows, mask=rm, other=0.0)
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]
    tl.store(y_ptr + r64[:, None] * stride_ym + cols[None, :], v.to(y_ptr.dtype.element_ty), mask=m)


# Launched every step: fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_quant_rows_kernel)
_c_launch(_quant_cols_kernel)
_c_launch(_quant_cols_from_rows_kernel)
_c_launch(_quant_both_kernel)
_c_launch(_quant_blocks_kernel)
_c_launch(_dequant_rows_kernel)
