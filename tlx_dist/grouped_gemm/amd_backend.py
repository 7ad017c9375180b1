"""Host side of the TLX grouped GEMM for AMD (``tlx/amd/grouped_gemm.py``): MI300X (gfx942), MI350 (gfx950).

Registers the gfx94x implementation of ``Backend("tlx", priority=10)`` when ``tlx.tlx_available()``
(the sm_90 / sm_100 one is in ``tlx_backend.py``); on a gfx94x device it is chosen ahead of the
portable ``triton`` kernel. One kernel runs the three forms:

* forward ``y_NF = x_ND @ w_EDF`` (weight N-contiguous),
* dX ``dx_ND = dy_NF @ w_EDF^T`` via ``mm(dy, w.transpose(1, 2))`` (weight K-contiguous),
* weight gradient ``dw_EDF[e] = x[rows e]^T @ dy[rows e]``, longest expert first with atomic tile
  claims (a config's ``dw_order="static"``: the plain round-robin walk).

Shared with ``tlx_backend.py`` through ``host.py`` (one implementation of each): the operand checks
(bf16/fp16, D and F multiples of 8, 16-byte aligned bases and row strides -- the kernel's 16-byte
vector loads assume them), the dW order, the device tile-count prep and search depth; through
``config.py`` the tile-config dataclass, its default and the autotuner's candidates (here with
AMD's LDS budget).
Operands those checks refuse fall back to the portable kernel, as on NVIDIA. Nothing reads device
values on the host.

Per target: gfx942 has 64 KiB of LDS per workgroup and 4-byte direct-to-LDS loads (the kernel
stages through registers); gfx950 has 160 KiB and 16-byte direct-to-LDS loads. Both have 8 XCDs
and run two wave groups of 4 waves (8 warps of 64 lanes), so each wave may hold 256 VGPRs+AGPRs.

Status: compiled for gfx942 and gfx950 in CI (tests/test_tlx_compile.py) and run under the Triton
interpreter with the LDS ring emulated in global memory (tests/test_grouped_gemm_amd_cpu.py); it has
never run on AMD hardware.
"""

from __future__ import annotations

from typing import Optional

import torch

import tlx

from .config import GroupedGemmConfig, check_config, fastest, grouped_mm_config, tile_spec
from .host import lpt_order, max_m_tiles, num_sms, operand_reason, prep_tile_cum, search_steps, tma_2d_reason
from .registry import Backend, register_backend

__all__ = ["kernel_signature"]

NUM_XCDS = 8  # MI300X and MI350 alike
NUM_WARPS = 8  # two wave groups of four waves: the warp pipeline's producer/consumer pair


def _target(device: torch.device) -> str:
    """gfx942 (CDNA3: MI300X/A, gfx940/941 too) or gfx950 (CDNA4) for a device of ``gpu_arch() == gfx94x``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    return "gfx950" if name.startswith("gfx95") else "gfx942"


def _supports(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> Optional[str]:
    if not tlx.tlx_available():
        return "TLX (fbtriton) is not importable"
    if tlx.gpu_arch() != "gfx94x":
        return f"gpu_arch()={tlx.gpu_arch()} (the AMD TLX kernel targets gfx942 and gfx950)"
    return operand_reason(x_ND, w_EDF)


def _launch(target, cfg, wgrad, b_kmajor, a, b, c, offsets, tile_cum, order, n_rows, E, M_DIM, K_DIM, NN,
            strides, bound, emulate=False, programs=None):
    from tlx.amd.grouped_gemm import _grouped_gemm_amd_kernel

    if programs is None:
        dev = a.device
        programs = num_sms(dev.index if dev.index is not None else torch.cuda.current_device())
    P = max(1, min(programs, bound))
    dynamic = order is not None
    # dW's tile counter, zeroed here (a memset node under CUDA-graph capture); unused otherwise.
    sched = torch.zeros(1, dtype=torch.int32, device=a.device) if dynamic else tile_cum
    scratch = a
    if emulate:  # the LDS ring in global memory (tests under the interpreter)
        scratch = torch.empty(P * cfg.STAGES * (cfg.BM * cfg.BK + cfg.BK * cfg.BN), dtype=a.dtype, device=a.device)
    extra = {} if emulate else {"matrix_instr_nonkdim": 16}
    _grouped_gemm_amd_kernel[(P,)](
        a, b, c, offsets, tile_cum, order if dynamic else tile_cum, sched, scratch,
        n_rows, E, M_DIM, K_DIM, NN, *strides,
        WGRAD=wgrad, B_KMAJOR=b_kmajor, DYNAMIC=dynamic, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NB=cfg.STAGES,
        NUM_PROGRAMS=P, NUM_XCDS=NUM_XCDS, SEARCH_STEPS=search_steps(E), GROUP_M=cfg.GROUP_M,
        DIRECT_LDS=target == "gfx950" and not emulate, EMULATE=emulate, num_warps=NUM_WARPS, num_stages=1, **extra,
    )


def _mm_with(cfg, target, x_ND, w_EDF, offsets, y_NF, emulate=False, programs=None):
    N, K = x_ND.shape
    E, _, NN = w_EDF.shape
    b_kmajor = w_EDF.stride(2) != 1
    stride_b = w_EDF.stride(2) if b_kmajor else w_EDF.stride(1)
    tile_cum = prep_tile_cum(offsets, N, cfg.BM)
    bound = max_m_tiles(N, E, cfg.BM) * -(-NN // cfg.BN)
    strides = (x_ND.stride(0), w_EDF.stride(0), stride_b, 0, y_NF.stride(0))
    _launch(target, cfg, False, b_kmajor, x_ND, w_EDF, y_NF, offsets, tile_cum, None, N, E, N, K, NN, strides,
            bound, emulate, programs)


def _config(config: Optional[GroupedGemmConfig], target: str, form: str, N: int, E: int, K: int, NN: int,
            dtype: torch.dtype) -> GroupedGemmConfig:
    """The pinned ``config`` (checked against the target's LDS once), else the default."""
    return check_config(config, target) if config is not None else grouped_mm_config(form, N, E, K, NN, target, dtype)


def _mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
        config: Optional[GroupedGemmConfig] = None) -> torch.Tensor:
    if x_ND.data_ptr() % 16 or w_EDF.data_ptr() % 16:
        # Only reachable when backend choice ran under torch.compile (no base-address check there).
        from .triton_backend import _mm as portable_mm

        return portable_mm(x_ND, w_EDF, offsets_E)
    N = x_ND.shape[0]
    E, K, NN = w_EDF.shape
    y_NF = torch.empty(N, NN, dtype=x_ND.dtype, device=x_ND.device)
    if N == 0:
        return y_NF
    target = _target(x_ND.device)
    offsets = offsets_E.to(torch.int32).contiguous()
    cfg = _config(config, target, "dX" if w_EDF.stride(2) != 1 else "fwd", N, E, K, NN, x_ND.dtype)
    _mm_with(cfg, target, x_ND, w_EDF, offsets, y_NF)
    return y_NF


def _wgrad_with(cfg, target, x_ND, dy_NF, offsets, dw_EDF, emulate=False, programs=None):
    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets.shape[0]
    bound = E * -(-D // cfg.BM) * -(-F // cfg.BN)
    order = lpt_order(offsets) if cfg.dw_order == "lpt" else None
    strides = (x_ND.stride(0), 0, dy_NF.stride(0), dw_EDF.stride(0), dw_EDF.stride(1))
    # K_DIM is unused by dW (its K range is each expert's rows); tile_cum is not needed either.
    _launch(target, cfg, True, False, x_ND, dy_NF, dw_EDF, offsets, offsets, order, N, E, D, 0, F, strides, bound,
            emulate, programs)


def _wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor,
           config: Optional[GroupedGemmConfig] = None) -> torch.Tensor:
    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets_E.shape[0]
    if N == 0 or tma_2d_reason("dy_NF", dy_NF) is not None or x_ND.data_ptr() % 16:
        # dy is not seen by supports() (nor x's base address under torch.compile); the portable
        # kernel takes any layout (and N == 0 -> zeros).
        from .triton_backend import _wgrad as portable_wgrad

        return portable_wgrad(x_ND, dy_NF, offsets_E)
    dw_EDF = torch.empty(E, D, F, dtype=x_ND.dtype, device=x_ND.device)
    target = _target(x_ND.device)
    offsets = offsets_E.to(torch.int32).contiguous()
    cfg = _config(config, target, "dW", N, E, D, F, x_ND.dtype)
    _wgrad_with(cfg, target, x_ND, dy_NF, offsets, dw_EDF)
    return dw_EDF


def _tune(form: str, a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> GroupedGemmConfig:
    """The fastest of this target's candidates for one call (operands as in tlx_backend._tune)."""
    target = _target(a.device)
    offsets = offsets_E.to(torch.int32).contiguous()
    if form == "dW":
        dw = a.new_empty(offsets_E.shape[0], a.shape[1], b.shape[1])
        return fastest(tile_spec(target), lambda c: _wgrad_with(c, target, a, b, offsets, dw))
    y = a.new_empty(a.shape[0], b.shape[2])
    return fastest(tile_spec(target), lambda c: _mm_with(c, target, a, b, offsets, y))


def kernel_signature(target: str, wgrad: bool, b_kmajor: bool, cfg: Optional[GroupedGemmConfig] = None,
                     E: int = 64, dtype: str = "bf16", dynamic: Optional[bool] = None, programs: int = 304):
    """(kernel, signature, constexprs, options) for ``triton.compile`` without a GPU (tests). The
    pointer arguments are marked 16-byte aligned, as the host checks make them."""
    from tlx.amd.grouped_gemm import _grouped_gemm_amd_kernel

    cfg = cfg or tile_spec(target).candidates[0]
    sig = {n: f"*{dtype}" for n in ("a_ptr", "b_ptr", "c_ptr")}
    sig.update({n: "*i32" for n in ("offsets_ptr", "tile_cum_ptr", "order_ptr", "sched_ptr")})
    sig["scratch_ptr"] = f"*{dtype}"
    for n in ("N_ROWS", "E", "M_DIM", "K_DIM", "NN", "stride_a", "stride_be", "stride_b", "stride_ce", "stride_c"):
        sig[n] = "i32"
    constexprs = dict(WGRAD=wgrad, B_KMAJOR=b_kmajor, DYNAMIC=wgrad if dynamic is None else dynamic, BM=cfg.BM,
                      BN=cfg.BN, BK=cfg.BK, NB=cfg.STAGES, NUM_PROGRAMS=programs, NUM_XCDS=NUM_XCDS,
                      SEARCH_STEPS=search_steps(E), GROUP_M=cfg.GROUP_M,
                      DIRECT_LDS=target == "gfx950", EMULATE=False)
    for k in constexprs:
        sig[k] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    return (_grouped_gemm_amd_kernel, sig, constexprs, attrs,
            {"num_warps": NUM_WARPS, "num_stages": 1, "matrix_instr_nonkdim": 16})


if tlx.tlx_available():  # the architecture is checked per call (supports), so overrides reach it
    register_backend(Backend("tlx", _mm, _wgrad, _supports, priority=10, archs=("gfx94x",), tiled=True,
                             tune=_tune))
