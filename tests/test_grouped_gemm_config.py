"""The grouped GEMM's tile-config objects on CPU (tier T0): validation errors name the field, the
factory gives the defaults the kernels have always run, a pinned config is checked against the
target's budget, and ``config=`` reaches only a backend that has tiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tlx_dist.grouped_gemm import GroupedGemmConfig, grouped_mm, grouped_mm_config, grouped_mm_wgrad
from tlx_dist.grouped_gemm.config import CANDIDATES, TARGETS, check_config, lds_bytes, tile_spec


@pytest.mark.parametrize("kw,exc,match", [
    (dict(BM=64), ValueError, r"GroupedGemmConfig.BM=64 must be 128 or 256"),
    (dict(BN=48), ValueError, r"GroupedGemmConfig.BN=48 must be a power of two"),
    (dict(BK=8), ValueError, r"GroupedGemmConfig.BK=8 must be a power of two >= 16"),
    (dict(STAGES=9), ValueError, r"GroupedGemmConfig.STAGES=9 must be in \[2, 8\]"),
    (dict(GROUP_M=3), ValueError, r"GroupedGemmConfig.GROUP_M=3 must be one of"),
    (dict(dw_order="random"), ValueError, r"GroupedGemmConfig.dw_order='random' must be one of \('lpt', 'static'\)"),
    (dict(precision="fp8"), ValueError, r"GroupedGemmConfig.precision='fp8' must be one of"),
    (dict(BN="256"), TypeError, r"GroupedGemmConfig.BN='256' must be an int"),
    (dict(STAGES=True), TypeError, r"GroupedGemmConfig.STAGES=True must be an int"),  # a bool is no stage count
])
def test_bad_fields_are_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        GroupedGemmConfig(**kw)


# The defaults of the five benchmark shapes (bench/grouped_gemm.py's SHAPES, T=16384) for every form
# of both GEMMs of a layer, as the kernels ran them before the configs became objects: (target,
# form, K, NN) -> (BM, BN, BK, STAGES, GROUP_M). Hopper takes GROUP_M 8 from 16 column tiles of 256,
# Blackwell never; AMD starts from its first candidate and takes GROUP_M 8 from 16 tiles of its BN.
DEFAULTS = [
    # OLMoE (D 2048, F 1024): gate/up fwd NN = 2F, down fwd NN = D, its dX NN = F
    ("sm_90", "fwd", 2048, 2048, (128, 256, 64, 3, 1)), ("sm_90", "dX", 2048, 1024, (128, 256, 64, 3, 1)),
    ("gfx942", "fwd", 2048, 2048, (256, 128, 32, 2, 8)), ("gfx942", "dX", 2048, 1024, (256, 128, 32, 2, 1)),
    ("gfx950", "dW", 2048, 2048, (256, 128, 64, 2, 8)),
    # Qwen3-30B-A3B (F 768): the down GEMM's dX is 768 columns (no 256 multiple, but >= 1024 rule: 256)
    ("sm_90", "dX", 2048, 768, (128, 256, 64, 3, 1)), ("sm_100", "fwd", 2048, 1536, (128, 256, 64, 3, 1)),
    # Mixtral (D 4096, F 14336): the wide outputs walk 8 tile rows together on Hopper, not on Blackwell
    ("sm_90", "fwd", 4096, 28672, (128, 256, 64, 3, 8)), ("sm_90", "dW", 14336, 4096, (128, 256, 64, 3, 8)),
    ("sm_100", "fwd", 4096, 28672, (128, 256, 64, 3, 1)), ("gfx950", "dX", 28672, 4096, (256, 128, 64, 2, 8)),
    # DeepSeek-V3 per rank (D 7168, F 2048): dX of the down GEMM is 2048 wide (8 tiles: no raster)
    ("sm_90", "dX", 7168, 2048, (128, 256, 64, 3, 1)), ("sm_90", "fwd", 2048, 7168, (128, 256, 64, 3, 8)),
    # narrow outputs: the 128x128 tile (AMD: one more ring slot)
    ("sm_90", "fwd", 64, 128, (128, 128, 64, 4, 1)), ("sm_90", "fwd", 64, 384, (128, 128, 64, 4, 1)),
    ("sm_90", "fwd", 64, 136, (128, 256, 64, 3, 1)), ("sm_90", "fwd", 64, 1152, (128, 256, 64, 3, 1)),
    ("gfx942", "fwd", 64, 8, (128, 128, 32, 3, 1)), ("gfx950", "fwd", 64, 128, (128, 128, 64, 3, 1)),
]


@pytest.mark.parametrize("target,form,K,NN,want", DEFAULTS)
def test_factory_reproduces_the_defaults(target, form, K, NN, want):
    cfg = grouped_mm_config(form, 16384 * 8, 64, K, NN, target)
    assert (cfg.BM, cfg.BN, cfg.BK, cfg.STAGES, cfg.GROUP_M) == want
    assert cfg.dw_order == "lpt" and cfg.precision == "bf16"
    assert check_config(cfg, target) == cfg  # every default fits its target
    assert grouped_mm_config(form, 16384 * 8, 64, K, NN, target) is cfg  # cached on the scalar key


def test_factory_rejects_unknown_form_and_target():
    with pytest.raises(ValueError, match=r"form='bwd' must be 'fwd', 'dX' or 'dW'"):
        grouped_mm_config("bwd", 64, 2, 64, 64, "sm_90")
    with pytest.raises(ValueError, match=r"target='sm_80' must be one of"):
        grouped_mm_config("fwd", 64, 2, 64, 64, "sm_80")


def test_candidates_fit_and_budgets_are_enforced():
    for target in TARGETS:
        spec = tile_spec(target)
        assert spec.candidates == CANDIDATES[target]
        assert all(spec.smem_bytes(c) <= spec.smem_limit for c in spec.candidates), target
    # 128x256x64 with 4 stages: a 4 x 48 KiB ring + a 64 KiB epilogue tile > 227 KiB on Hopper
    with pytest.raises(ValueError, match=r"needs 262144 bytes of shared memory \(limit 232448 on sm_90\)"):
        check_config(GroupedGemmConfig(128, 256, 64, 4), "sm_90")
    # gfx942's 64 KiB of LDS: 3 slots of 256x128x32 tiles need 72 KiB
    big = GroupedGemmConfig(256, 128, 32, 3)
    assert lds_bytes(big, "gfx942") > 64 * 1024
    with pytest.raises(ValueError, match=r"limit 65536 on gfx942"):
        check_config(big, "gfx942")
    with pytest.raises(TypeError, match=r"config must be a GroupedGemmConfig, got dict"):
        check_config({"BM": 128}, "sm_90")


def test_json_round_trip_is_exact():
    cfg = GroupedGemmConfig(256, 128, 32, 6, 8, dw_order="static")
    assert GroupedGemmConfig.from_json(cfg.to_json()) == cfg
    assert dataclasses.replace(cfg, STAGES=3) != cfg  # frozen: a changed copy, never an edit
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.BM = 128


def test_config_reaches_only_a_tiled_backend():
    x, w, off = torch.randn(6, 8), torch.randn(2, 8, 8), torch.tensor([2, 6], dtype=torch.int32)
    cfg = GroupedGemmConfig()
    # on CPU the automatic choice is torch._grouped_mm, which has no tiles: an error, not a silent no-op
    with pytest.raises(ValueError, match=r"config= pins the TLX kernels' tile config, but backend 'torch' .*"
                                         r"chosen automatically"):
        grouped_mm(x, w, off, config=cfg)
    with pytest.raises(ValueError, match=r"backend 'reference' runs these operands and has no tiles"):
        grouped_mm_wgrad(x, torch.randn(6, 8), off, backend="reference", config=cfg)
    with pytest.raises(TypeError, match=r"config must be a GroupedGemmConfig or None, got str"):
        grouped_mm(x, w, off, config="BM=128,BN=256")
    torch.testing.assert_close(grouped_mm(x, w, off, config=None), grouped_mm(x, w, off, backend="reference"))
