"""The fused pipeline's config objects on CPU (tier T0): validation errors name the field, the tile
factory gives the defaults the kernels have always run (several model shapes, both generations),
the row-copy rules, and ``config=`` reaching the backends that read it -- an error, never a silent
no-op, where it cannot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tlx_dist.fused import (BlackwellFusedTileConfig, FusedConfig, FusedTileConfig, fused_experts, fused_experts_rows,
                            fused_tile_config)
from tlx_dist.fused import config as fc
from tlx_dist.grouped_gemm import GroupedGemmConfig

H, B = FusedTileConfig, BlackwellFusedTileConfig


# --- the tile configs' own checks ------------------------------------------------------------------------


@pytest.mark.parametrize("make,exc,match", [
    # LAG = STAGES - 1 would deadlock the gather pipeline (tlx/hopper/fused_moe.py's header says why)
    (lambda: H(STAGES=4, LAG=3), ValueError, r"FusedTileConfig.LAG=3 must be in \[0, STAGES - 2 = 2\]"),
    (lambda: H(BN=48), ValueError, r"FusedTileConfig.BN=48 must be a power of two"),
    (lambda: H(BM=64), ValueError, r"FusedTileConfig.BM=64 must be 128"),
    (lambda: H(REGS=230), ValueError, r"FusedTileConfig.REGS=230 must be a multiple of 8"),
    (lambda: H(REGS=120), ValueError, r"REGS=120 must be a multiple of 8 in \[152, 240\]"),  # 96 only with EPI_WG
    (lambda: H(EARLY_H=1, BN=32), ValueError, r"EARLY_H prefetches 128-byte lines: needs BN >= 64"),
    (lambda: H(EARLY_H=2), ValueError, r"FusedTileConfig.EARLY_H=2 must be 0 or 1"),
    (lambda: H(EPI_WG=1, REGS=232, EPI_REGS=160), ValueError, r"2 \* REGS \+ 1 \* EPI_REGS = 624 leaves the producer"),
    (lambda: H(EPI_WG=2, REGS=152, EPI_REGS=104), ValueError, r"2 \* REGS \+ 2 \* EPI_REGS = 512 leaves the producer"),
    (lambda: H(EPI_WG=1, REGS=152, EPI_REGS=152, EPI_COLS=8), ValueError, r"EPI_COLS=8 must be BN/2, BN/4 or BN/8"),
    (lambda: H(EPI_WG=3), ValueError, r"FusedTileConfig.EPI_WG=3 must be 0, 1 or 2"),
    (lambda: H(PINGPONG=1, EPI_WG=1, REGS=152, EPI_REGS=152), ValueError, r"PINGPONG runs the epilogue in the consumers"),
    (lambda: H(PINGPONG=2), ValueError, r"FusedTileConfig.PINGPONG=2 must be 0 or 1"),
    (lambda: H(PINGPONG=1, REGS=216), ValueError, r"PINGPONG needs BN <= 128 and REGS >= 232"),  # it would spill
    (lambda: H(PINGPONG=1, BN=256, REGS=240, STAGES=4, LAG=2), ValueError, r"PINGPONG needs BN <= 128"),
    (lambda: H(BN="128"), TypeError, r"FusedTileConfig.BN='128' must be an int"),
    (lambda: B(STAGES=4, LAG=4), ValueError, r"BlackwellFusedTileConfig.LAG=4 must be in \[0, STAGES - 1 = 3\]"),
    (lambda: B(EPI_BN=256), ValueError, r"BlackwellFusedTileConfig.EPI_BN=256 must be <= BN=128"),
    (lambda: B(LOAD_WARPS=2), ValueError, r"BlackwellFusedTileConfig.LOAD_WARPS=2 must be 1 or 4"),
    (lambda: B(LOAD_REGS=20), ValueError, r"BlackwellFusedTileConfig.LOAD_REGS=20 must be a multiple of 8"),
])
def test_tile_config_errors_name_the_field(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_tile_config_derived_sizes():
    assert H(EPI_WG=2, REGS=104, EPI_REGS=120, EPI_COLS=16).epi_cols == 16
    assert H(EPI_WG=1, REGS=152, EPI_REGS=152).epi_cols == 64  # 0: BN / 2
    assert H(PINGPONG=1, REGS=232).epi_cols == 32  # 0 with the ping-pong consumers: BN / 4
    epi = H(STAGES=4, LAG=2, REGS=136, EPI_WG=1, EPI_REGS=184, EPI_COLS=32)
    assert epi.smem_bytes("dswiglu") == 4 * 32768 + 128 * 128 * 4  # the ring + both fp32 accumulators
    assert B(BN=256).tmem_cols("swiglu") == 1024 and B(BN=256).tmem_cols("scatter") == 512


# --- FusedConfig's checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,exc,match", [
    (dict(x_rows="copied"), ValueError, r"FusedConfig.x_rows='copied' must be one of \('auto', 'gather', 'copy'\)"),
    (dict(dout_rows=None), ValueError, r"FusedConfig.dout_rows=None must be one of"),
    (dict(swiglu=H(STAGES=8, LAG=2)), ValueError, r"FusedConfig.swiglu: .* bytes of shared memory for swiglu"),
    (dict(swiglu=H(EPI_WG=1, REGS=152)), ValueError,
     r"FusedConfig.swiglu: EPI_WG is an option of the scatter and dswiglu forms, not swiglu"),
    # gathered dout rows: the ping-pong kernel reads its A operand by TMA
    (dict(dswiglu=H(PINGPONG=1, REGS=232)), ValueError,
     r"FusedConfig.dswiglu: PINGPONG is an option of the dswiglu_copy form"),
    (dict(scatter=H(EARLY_H=1)), ValueError, r"FusedConfig.scatter: EARLY_H is an option of the dswiglu forms"),
    (dict(swiglu=B(BN=256, BK=32, STAGES=2, LAG=1)), ValueError, r"FusedConfig.swiglu: .* 1024 TMEM columns"),
    (dict(wgrad_a={"BN": 256}), TypeError, r"FusedConfig.wgrad_a must be a FusedTileConfig or .* got dict"),
    (dict(wgrad_copy=H()), TypeError, r"FusedConfig.wgrad_copy must be a GroupedGemmConfig or None"),
    (dict(layout_kernel=1), TypeError, r"FusedConfig.layout_kernel=1 must be a bool"),
    (dict(precision="fp8"), ValueError, r"FusedConfig.precision='fp8' must be one of"),
])
def test_fused_config_errors_name_the_field(kw, exc, match):
    with pytest.raises(exc, match=match):
        FusedConfig(**kw)


def test_a_tile_config_for_the_other_generation_is_refused():
    cfg = FusedConfig(swiglu=H(REGS=216))
    assert cfg.tile("swiglu", 1024, "sm_90") == H(REGS=216)
    with pytest.raises(ValueError, match=r"FusedConfig.swiglu is a FusedTileConfig \(for sm_90\) but the fused kernels "
                                         r"run on sm_100: give a BlackwellFusedTileConfig"):
        cfg.check_arch("sm_100")
    FusedConfig(dswiglu=B(EPI_BN=32)).check_arch("sm_100")


# --- the defaults -----------------------------------------------------------------------------------------

# Each form's base default, field by field, as the kernels have always run it (the class defaults
# are BM 128, BN 128, BK 64, STAGES 4, LAG 2, GROUP_M 1; Hopper REGS 232, EPI_REGS 152; Blackwell
# EPI_BN 64, LOAD_WARPS 4, LOAD_REGS 128).
BASE = {
    "sm_90": {"swiglu": H(REGS=216), "scatter": H(STAGES=5, LAG=0, REGS=152, EPI_WG=1, EPI_COLS=32),
              "dswiglu": H(STAGES=6, LAG=4, EARLY_H=1),
              "dswiglu_copy": H(REGS=104, EARLY_H=1, EPI_WG=2, EPI_REGS=120, EPI_COLS=16),
              "wgrad_a": H(BN=256, STAGES=3, LAG=1, REGS=224), "wgrad_b": H(BN=256, BK=32, STAGES=6, LAG=4, REGS=224)},
    "sm_100": {"swiglu": B(), "scatter": B(STAGES=5, LAG=0, LOAD_WARPS=1, LOAD_REGS=48),
               "dswiglu": B(STAGES=6, LAG=4, EPI_BN=32), "dswiglu_copy": B(STAGES=6, LAG=4, EPI_BN=32),
               "wgrad_a": B(BN=256, BK=32, STAGES=6, LAG=4), "wgrad_b": B(BN=256, BK=32, STAGES=6, LAG=4)},
}
DEEP = H(STAGES=6, LAG=4, EARLY_H=1, EPI_COLS=32, PINGPONG=1)

SHAPES = {"olmoe": (2048, 1024), "qwen3-30b-a3b": (2048, 768), "deepseek-v2-lite": (2048, 1408),
          "mixtral": (4096, 14336), "deepseek-v3-rank": (7168, 2048)}  # (D, F)
# (shape, arch) -> the forms whose default walks 8 tile rows together (GROUP_M 8), and whether
# dswiglu_copy takes the ping-pong consumers; every other form is its BASE entry as it is.
GROUPED = {
    ("olmoe", "sm_90"): ({"scatter", "scatter_dx"}, False), ("olmoe", "sm_100"): ({"scatter", "scatter_dx"}, False),
    ("qwen3-30b-a3b", "sm_90"): ({"scatter", "scatter_dx"}, False),
    ("deepseek-v2-lite", "sm_100"): ({"scatter", "scatter_dx"}, False),
    ("mixtral", "sm_90"): ({"swiglu", "scatter", "scatter_dx", "dswiglu", "dswiglu_copy", "wgrad_a"}, True),
    ("mixtral", "sm_100"): ({"swiglu", "scatter", "scatter_dx", "dswiglu", "dswiglu_copy"}, False),
    ("deepseek-v3-rank", "sm_90"): ({"swiglu", "scatter", "scatter_dx", "dswiglu", "dswiglu_copy"}, True),
    ("deepseek-v3-rank", "sm_100"): ({"swiglu", "scatter", "scatter_dx", "dswiglu", "dswiglu_copy"}, False),
}


@pytest.mark.parametrize("shape,arch", list(GROUPED), ids=[f"{s}-{a}" for s, a in GROUPED])
def test_factory_reproduces_the_defaults(shape, arch):
    D, F = SHAPES[shape]
    grouped, deep = GROUPED[shape, arch]
    # each launch as the launchers ask: (form, output columns, reduction depth)
    launches = {"swiglu": ("swiglu", F, D), "scatter": ("scatter", D, F), "scatter_dx": ("scatter", D, 2 * F),
                "dswiglu": ("dswiglu", F, D), "dswiglu_copy": ("dswiglu_copy", F, D), "wgrad_a": ("wgrad_a", 2 * F, 0),
                "wgrad_b": ("wgrad_b", D, 0)}
    for name, (form, nn, k) in launches.items():
        want = DEEP if name == "dswiglu_copy" and deep else BASE[arch][form]
        if name in grouped:
            want = dataclasses.replace(want, GROUP_M=8)
        assert fused_tile_config(form, nn, arch, k) == want, (shape, arch, name)
        assert FusedConfig().tile(form, nn, arch, k) == want  # a config with no tile fields: the default


def test_width_and_depth_rules_at_their_thresholds():
    # the GEMM forms walk 8 tile rows together from 16 column tiles; the sm_90 dW forms from
    # WGRAD_GROUP_TILES (Mixtral's dW13: 2F = 28672 columns, 112 tiles of 256); Blackwell's dW never
    assert fused_tile_config("swiglu", 16 * 128).GROUP_M == 8 and fused_tile_config("swiglu", 15 * 128).GROUP_M == 1
    assert fused_tile_config("wgrad_a", 256 * fc.WGRAD_GROUP_TILES).GROUP_M == 8
    assert fused_tile_config("wgrad_a", 256 * fc.WGRAD_GROUP_TILES - 256).GROUP_M == 1
    assert fused_tile_config("wgrad_b", 4096).GROUP_M == 1  # Mixtral dW2: 16 tiles
    assert fused_tile_config("wgrad_a", 2 * 14336, "sm_100").GROUP_M == 1
    # dSwiGLU from the dout copy: the ping-pong consumers from a reduction depth of DSWIGLU_PINGPONG_MIN_D
    assert fused_tile_config("dswiglu_copy", 1024, "sm_90", fc.DSWIGLU_PINGPONG_MIN_D - 64).PINGPONG == 0
    assert fused_tile_config("dswiglu_copy", 1024, "sm_90", fc.DSWIGLU_PINGPONG_MIN_D).PINGPONG == 1
    assert fused_tile_config("dswiglu", 1024, "sm_90", 7168).PINGPONG == 0  # gathered rows: never
    # a pinned form runs as given: no width or depth rule on top of it
    pinned = FusedConfig(wgrad_a=BASE["sm_90"]["wgrad_a"], dswiglu_copy=BASE["sm_90"]["dswiglu_copy"])
    assert pinned.tile("wgrad_a", 2 * 14336, "sm_90").GROUP_M == 1
    assert pinned.tile("dswiglu_copy", 14336, "sm_90", 4096).PINGPONG == 0
    with pytest.raises(ValueError, match=r"form='gemm' must be one of"):
        fused_tile_config("gemm", 1024)
    with pytest.raises(ValueError, match=r"arch='gfx94x': the fused TLX kernels target"):
        fused_tile_config("swiglu", 1024, "gfx94x")


class _Prims:
    def __init__(self, config, auto):
        self.config, self.AUTO_ROW_COPY = config, auto


@pytest.mark.parametrize("which", ["dout", "x"])
def test_row_copy_modes(which):
    """The backward's dout rows / the forward's x rows read by index or from one expert-major copy;
    "auto" copies from the mode's F threshold, and only for primitives that allow it (the Hopper
    kernels, where the rule was measured)."""
    from tlx_dist.fused import backends as b

    field, min_f, rows_of = {"dout": ("dout_rows", fc.DOUT_COPY_MIN_F, b._dout_rows),
                             "x": ("x_rows", fc.X_COPY_MIN_F, b._x_rows)}[which]
    d, idx = torch.randn(5, 3), torch.tensor([4, 0, 2, 7, -9], dtype=torch.int32)  # last two: padding rows
    auto = _Prims(FusedConfig(), True)
    if min_f > 0:
        rows, i = rows_of(d, idx, min_f - 1, auto)  # auto, narrow F: by index
        assert rows is d and i is idx
    rows, i = rows_of(d, idx, min_f, auto)  # auto, wide F: the copy, padding indices clamped
    assert i is None and torch.equal(rows[:3], d[[4, 0, 2]]) and rows.shape == (5, 3)
    rows, i = rows_of(d, idx, 10 ** 6, _Prims(FusedConfig(), False))  # auto on kernels that gather
    assert rows is d and i is idx
    rows, i = rows_of(d, idx, 10 ** 6, _Prims(FusedConfig(**{field: "gather"}), True))
    assert rows is d and i is idx
    copy = _Prims(FusedConfig(**{field: "copy"}), False)  # "copy" copies for any kernels
    rows, i = rows_of(d, idx, 8, copy)
    assert i is None and torch.equal(rows[:3], d[[4, 0, 2]]) and rows.shape == (5, 3)
    rows, i = rows_of(d[:0], idx[:0], 8, copy)
    assert rows.shape == (0, 3) and i is None


# --- mappings and JSON --------------------------------------------------------------------------------------


def test_from_dict_replaces_fields_of_the_base_default():
    cfg = FusedConfig.from_dict({"dout_rows": "gather", "dswiglu": {"STAGES": 5, "LAG": 3},
                                 "wgrad_copy": {"BN": 128, "STAGES": 4}})
    assert cfg.dout_rows == "gather" and cfg.dswiglu == dataclasses.replace(BASE["sm_90"]["dswiglu"], STAGES=5, LAG=3)
    assert cfg.wgrad_copy == GroupedGemmConfig(BN=128, STAGES=4)
    bw = FusedConfig.from_dict({"dswiglu": {"BN": 32, "EPI_BN": 32}}, arch="sm_100")
    assert bw.dswiglu == dataclasses.replace(BASE["sm_100"]["dswiglu"], BN=32)
    with pytest.raises(ValueError, match=r"fused: unknown field\(s\) \['rows'\]"):
        FusedConfig.from_dict({"rows": "copy"})
    with pytest.raises(ValueError, match=r"fused.swiglu: unknown field\(s\) \['REGS'\] of BlackwellFusedTileConfig"):
        FusedConfig.from_dict({"swiglu": {"REGS": 232}}, arch="sm_100")  # a Hopper field
    with pytest.raises(ValueError, match=r"FusedConfig.swiglu: .* bytes of shared memory"):
        FusedConfig.from_dict({"swiglu": {"STAGES": 8, "LAG": 2}})


def test_json_round_trip_is_exact():
    for cfg in (FusedConfig(), FusedConfig(x_rows="copy", dswiglu_copy=DEEP, wgrad_copy=GroupedGemmConfig(GROUP_M=8)),
                FusedConfig(scatter=BASE["sm_100"]["scatter"], layout_kernel=False)):
        assert FusedConfig.from_json(cfg.to_json()) == cfg


# --- config= through the functional API -------------------------------------------------------------------


def _operands(T=12, D=16, F=8, E=3, K=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    gate = torch.rand(T, K, generator=g, dtype=torch.float64)
    return x, idx, gate, torch.randn(E, D, 2 * F, generator=g, dtype=torch.float64), \
        torch.randn(E, F, D, generator=g, dtype=torch.float64)


def test_config_reaches_only_the_backends_that_read_it():
    x, idx, gate, w13, w2 = _operands()
    want = fused_experts(x, idx, gate, w13, w2, backend="reference")
    # row modes and the layout choice: any backend (the reference computes the same values)
    got = fused_experts(x, idx, gate, w13, w2, backend="reference",
                        config=FusedConfig(dout_rows="gather", x_rows="copy", layout_kernel=False))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # tile fields are the tlx backend's: an error elsewhere, not a silent no-op
    with pytest.raises(ValueError, match=r"config pins tile configs of the TLX kernels, but the fused backend "
                                         r"'reference' runs these operands"):
        fused_experts(x, idx, gate, w13, w2, config=FusedConfig(swiglu=BASE["sm_90"]["swiglu"]))
    tok = torch.arange(x.shape[0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'reference' runs these operands"):
        fused_experts_rows(x, tok, tok, torch.ones(x.shape[0], dtype=torch.float64), w13, w2,
                           torch.tensor([4, 8, 12], dtype=torch.int32), x.shape[0],
                           config=FusedConfig(wgrad_copy=GroupedGemmConfig()))
    with pytest.raises(TypeError, match=r"config must be a FusedConfig or None, got dict"):
        fused_experts(x, idx, gate, w13, w2, config={"dout_rows": "gather"})


def test_config_travels_through_the_custom_op_as_json():
    from tlx_dist.fused.api import _bwd_op, _fwd_op

    x, idx, gate, w13, w2 = _operands()
    order = torch.sort(idx.reshape(-1), stable=True).indices
    tok = (order // idx.shape[1]).to(torch.int32)
    offs = torch.bincount(idx.reshape(-1), minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    gate_N = gate.reshape(-1)[order]
    js = FusedConfig(dout_rows="gather").to_json()
    args = (x.requires_grad_(), tok, tok, gate_N.requires_grad_(), w13.requires_grad_(), w2.requires_grad_(), offs,
            x.shape[0], "reference", None, js)
    torch.library.opcheck(_fwd_op, args)
    out, h = _fwd_op(*args)
    torch.library.opcheck(_bwd_op, (torch.randn_like(out), x.detach(), tok, tok, gate_N.detach(), w13.detach(),
                                    w2.detach(), offs, h.detach(), "reference", None, js))
    # under torch.compile the layer's config reaches the op: the traced graph runs it
    cfg = FusedConfig(dout_rows="gather")
    fn = torch.compile(lambda *a: fused_experts(*a, backend="reference", config=cfg), fullgraph=True,
                       backend="aot_eager")
    torch.testing.assert_close(fn(x.detach(), idx, gate.detach(), w13.detach(), w2.detach()),
                               fused_experts(x.detach(), idx, gate.detach(), w13.detach(), w2.detach(),
                                             backend="reference"), rtol=0, atol=0)
