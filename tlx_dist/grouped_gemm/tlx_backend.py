"""Host side of the TLX grouped GEMM (``tlx/hopper/grouped_gemm.py``, ``tlx/blackwell/grouped_gemm.py``).

Registers the sm_90 / sm_100 implementation of ``Backend("tlx", priority=10)`` when ``tlx.tlx_available()``
(``amd_backend.py`` registers the gfx94x one). One kernel per architecture runs the three forms:

* forward ``y_NF = x_ND @ w_EDF`` (weight N-contiguous),
* dX ``dx_ND = dy_NF @ w_EDF^T`` via ``mm(dy, w.transpose(1, 2))`` (weight K-contiguous),
* weight gradient ``dw_EDF[e] = x[rows e]^T @ dy[rows e]``.

Operands the TMA path cannot take (misaligned rows/strides, fp32, other layouts) make ``supports()``
return a reason (the automatic choice falls back to the ``triton`` backend), or, for the weight
gradient, whose ``dy`` the selector does not see, delegate to the portable kernel.

Tile configs: ``config.py`` (a frozen :class:`GroupedGemmConfig`; ``config=None`` takes
:func:`grouped_mm_config`'s default for the call, cached per scalar key). ``_tune`` times the
target's candidates on real operands (``tune_grouped_mm``). Nothing reads device values on the host.

Hopper dW walks its tiles longest expert first and claims them from an atomic counter (see
tlx/common/scheduler.py) unless the config's ``dw_order`` is ``"static"`` (the round-robin walk);
Blackwell's dW has the static walk only.
"""

from __future__ import annotations

from typing import Optional

import torch

import tlx

from .config import GroupedGemmConfig, check_config, fastest, grouped_mm_config, tile_spec
from .host import lpt_order, num_sms, operand_reason, tma_2d_reason
from .registry import Backend, register_backend, register_unavailable

__all__ = ["kernel_signature"]

_ARCH_CC = {"sm_90": 90, "sm_100": 100}


# --- checks -----------------------------------------------------------------------------------------


def _arch_cc() -> Optional[int]:
    return _ARCH_CC.get(tlx.gpu_arch())


def _supports(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> Optional[str]:
    if not tlx.tlx_available():
        return "TLX (fbtriton) is not importable"
    if tlx.gpu_arch() not in _ARCH_CC:
        return f"gpu_arch()={tlx.gpu_arch()} (the TLX kernels target sm_90 and sm_100)"
    return operand_reason(x_ND, w_EDF)


# --- launch -----------------------------------------------------------------------------------------


def _kernel(cc: int):
    if cc == 90:
        from tlx.hopper.grouped_gemm import _grouped_gemm_hopper_kernel as k
    else:
        from tlx.blackwell.grouped_gemm import _grouped_gemm_blackwell_kernel as k
    return k


def _a_rows(cc: int, cfg: GroupedGemmConfig) -> int:
    # Hopper splits the M tile between two consumer warp groups; Blackwell's MMA takes all of it.
    return cfg.BM // 2 if cc == 90 else cfg.BM


def _c_cols(cc: int, cfg: GroupedGemmConfig) -> int:
    # Blackwell's epilogue stores the TMEM accumulator in column slices of at most 128.
    return cfg.BN if cc == 90 else min(cfg.BN, 128)


def _launch(cc, cfg, wgrad, b_kmajor, a_desc, b_desc, c_desc, offsets, tile_cum, n_rows, E, M_DIM, K_DIM, NN,
            n_tiles_bound, device, order=None):
    from .host import search_steps

    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    grid = (max(1, min(sms, n_tiles_bound)),)
    common = dict(WGRAD=wgrad, B_KMAJOR=b_kmajor, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, NUM_STAGES=cfg.STAGES,
                  NUM_SMS=grid[0], SEARCH_STEPS=search_steps(E), num_warps=4, num_stages=1)
    if cc == 90:
        common["GROUP_M"] = cfg.GROUP_M
        # order is None: static round-robin tile walk; else longest-expert-first + atomic tile claims
        # from a counter zeroed here (a memset node under CUDA-graph capture).
        dynamic = order is not None
        sched = torch.zeros(1, dtype=torch.int32, device=device) if dynamic else tile_cum
        _kernel(cc)[grid](a_desc, b_desc, c_desc, offsets, tile_cum, order if dynamic else tile_cum, sched,
                          n_rows, E, M_DIM, K_DIM, NN, DYNAMIC=dynamic, **common)
    else:
        _kernel(cc)[grid](a_desc, b_desc, c_desc, offsets, tile_cum, n_rows, E, M_DIM, K_DIM, NN, **common)


def _config(config: Optional[GroupedGemmConfig], cc: int, form: str, N: int, E: int, K: int, NN: int,
            dtype: torch.dtype) -> GroupedGemmConfig:
    """The pinned ``config`` (checked against the target's budget once), else the default."""
    target = f"sm_{cc}"
    if config is not None:
        return check_config(config, target)
    return grouped_mm_config(form, N, E, K, NN, target, dtype)


def _mm_with(cfg: GroupedGemmConfig, cc: int, x_ND, w_EDF, offsets, y_NF):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .host import max_m_tiles, prep_offsets, ragged_descriptor

    N, K = x_ND.shape
    E, _, NN = w_EDF.shape
    b_kmajor = w_EDF.stride(2) != 1
    a_desc = TensorDescriptor(x_ND, [N, K], [x_ND.stride(0), 1], [_a_rows(cc, cfg), cfg.BK])
    if b_kmajor:
        b_desc = TensorDescriptor(w_EDF, [E, NN, K], [w_EDF.stride(0), w_EDF.stride(2), 1], [1, cfg.BN, cfg.BK])
    else:
        b_desc = TensorDescriptor(w_EDF, [E, K, NN], [w_EDF.stride(0), w_EDF.stride(1), 1], [1, cfg.BK, cfg.BN])
    c_desc = ragged_descriptor(y_NF, _a_rows(cc, cfg), _c_cols(cc, cfg))
    offsets, tile_cum = prep_offsets(offsets, N, cfg.BM)  # clamped on the device (guard.py)
    bound = max_m_tiles(N, E, cfg.BM) * -(-NN // cfg.BN)
    _launch(cc, cfg, False, b_kmajor, a_desc, b_desc, c_desc, offsets, tile_cum, N, E, N, K, NN, bound, x_ND.device)


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
    cc = _arch_cc()
    cfg = _config(config, cc, "dX" if w_EDF.stride(2) != 1 else "fwd", N, E, K, NN, x_ND.dtype)
    _mm_with(cfg, cc, x_ND, w_EDF, offsets_E, y_NF)
    return y_NF


def _wgrad_with(cfg: GroupedGemmConfig, cc: int, x_ND, dy_NF, offsets, dw_EDF, order=None):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .host import ragged_descriptor

    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets.shape[0]
    a_desc = ragged_descriptor(x_ND, cfg.BK, _a_rows(cc, cfg))
    b_desc = ragged_descriptor(dy_NF, cfg.BK, cfg.BN)
    c_desc = TensorDescriptor(dw_EDF, [E, D, F], [D * F, F, 1], [1, _a_rows(cc, cfg), _c_cols(cc, cfg)])
    bound = E * -(-D // cfg.BM) * -(-F // cfg.BN)
    if cc != 90 or cfg.dw_order != "lpt":
        order = None  # the static walk (Blackwell's kernel has no order argument)
    elif order is None:
        order = lpt_order(offsets)
    _launch(cc, cfg, True, False, a_desc, b_desc, c_desc, offsets, offsets, N, E, D, N, F, bound, x_ND.device,
            order=order)


def _wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offsets_E: torch.Tensor,
           config: Optional[GroupedGemmConfig] = None, order: Optional[torch.Tensor] = None,
           trusted: bool = False) -> torch.Tensor:
    """``dW[e] = x[rows of e]^T @ dy[rows of e]``. The fused pipeline's callers (its row copies) pass
    ``trusted=True`` for int32 offsets their own routing kernel made (valid: the clamp launch is
    skipped) and ``order``, the longest-first expert order the routing kernel already wrote (the
    order launch is skipped): two launches fewer per call, the same kernel and tiles."""
    N, D = x_ND.shape
    F = dy_NF.shape[1]
    E = offsets_E.shape[0]
    if N == 0 or tma_2d_reason("dy_NF", dy_NF) is not None or x_ND.data_ptr() % 16:
        # dy is not seen by supports() (nor x's base address under torch.compile); the portable
        # kernel takes any layout (and N == 0 -> zeros).
        from .triton_backend import _wgrad as portable_wgrad

        return portable_wgrad(x_ND, dy_NF, offsets_E)
    from .host import prep_offsets

    dw_EDF = torch.empty(E, D, F, dtype=x_ND.dtype, device=x_ND.device)
    cc = _arch_cc()
    if trusted and offsets_E.dtype == torch.int32 and offsets_E.is_contiguous():
        offsets = offsets_E
    else:
        offsets = prep_offsets(offsets_E, N)[0]  # clamped into [0, N] on the device (guard.py)
    cfg = _config(config, cc, "dW", N, E, D, F, x_ND.dtype)
    _wgrad_with(cfg, cc, x_ND, dy_NF, offsets, dw_EDF, order)
    return dw_EDF


def _tune(form: str, a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> GroupedGemmConfig:
    """The fastest of this GPU's candidates for one call (``form`` "fwd" / "dX": ``a = x_ND``,
    ``b = w_EDF``; "dW": ``a = x_ND``, ``b = dy_NF``), timed on these operands (outputs scratch)."""
    from .host import prep_offsets

    cc = _arch_cc()
    spec = tile_spec(f"sm_{cc}")
    if form == "dW":
        offsets = prep_offsets(offsets_E, a.shape[0])[0]
        dw = a.new_empty(offsets_E.shape[0], a.shape[1], b.shape[1])
        return fastest(spec, lambda c: _wgrad_with(c, cc, a, b, offsets, dw))
    y = a.new_empty(a.shape[0], b.shape[2])
    return fastest(spec, lambda c: _mm_with(c, cc, a, b, offsets_E, y))


def kernel_signature(cc: int, wgrad: bool, b_kmajor: bool, cfg: Optional[GroupedGemmConfig] = None,
                     E: int = 64, dtype: str = "bf16", dynamic: Optional[bool] = None):
    """(kernel, signature, constexprs, options) for ``triton.compile`` without a GPU (tests)."""
    from .host import search_steps

    cfg = cfg or tile_spec(f"sm_{cc}").candidates[0]
    ar, cc_cols = _a_rows(cc, cfg), _c_cols(cc, cfg)
    if wgrad:
        a = f"tensordesc<{dtype}[1,1,{cfg.BK},{ar}]>"
        b = f"tensordesc<{dtype}[1,1,{cfg.BK},{cfg.BN}]>"
        c = f"tensordesc<{dtype}[1,{ar},{cc_cols}]>"
    else:
        a = f"tensordesc<{dtype}[{ar},{cfg.BK}]>"
        b = f"tensordesc<{dtype}[1,{cfg.BN},{cfg.BK}]>" if b_kmajor else f"tensordesc<{dtype}[1,{cfg.BK},{cfg.BN}]>"
        c = f"tensordesc<{dtype}[1,1,{ar},{cc_cols}]>"
    sig = {"a_desc": a, "b_desc": b, "c_desc": c, "offsets_ptr": "*i32", "tile_cum_ptr": "*i32"}
    constexprs = {"WGRAD": wgrad, "B_KMAJOR": b_kmajor}
    if cc == 90:  # the Hopper kernel's dW walks tiles longest-expert-first with atomic claims
        sig.update({"order_ptr": "*i32", "sched_ptr": "*i32"})
        constexprs["DYNAMIC"] = wgrad if dynamic is None else dynamic
        constexprs["GROUP_M"] = cfg.GROUP_M
    sig.update({"N_ROWS": "i32", "E": "i32", "M_DIM": "i32", "K_DIM": "i32", "NN": "i32"})
    constexprs.update({"BM": cfg.BM, "BN": cfg.BN, "BK": cfg.BK, "NUM_STAGES": cfg.STAGES, "NUM_SMS": 132,
                       "SEARCH_STEPS": search_steps(E), **constexprs})
    for k in constexprs:
        sig[k] = "constexpr"
    return _kernel(cc), sig, constexprs, {"num_warps": 4, "num_stages": 1}


if tlx.tlx_available():  # the architecture is checked per call (supports), so overrides reach it
    register_backend(Backend("tlx", _mm, _wgrad, _supports, priority=10, archs=tuple(_ARCH_CC), tiled=True,
                             tune=_tune))
else:
    register_unavailable("tlx", "TLX (fbtriton) is not importable (pip install -e '.[tlx]')")
