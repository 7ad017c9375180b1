"""MoELayer: router -> dispatch -> grouped SwiGLU experts -> combine (+ shared experts).

Legend: B batch, S sequence, T = B*S tokens on this rank, D hidden, F expert intermediate,
E global experts, W expert-parallel ranks, e = E/W local experts, K top-k, N received rows.

    idx_TK, gate_TK  = router(x_TD)
    recv_ND, handle  = dispatcher.dispatch(x_TD, idx_TK, gate_TK)
    h_N2F            = grouped_mm(recv_ND, w13_eDF2, handle.offsets_e)    # [gate | up]
    a_NF             = silu(h[:, :F]) * h[:, F:]
    y_ND             = grouped_mm(a_NF, w2_eFD, handle.offsets_e)
    out_TD           = dispatcher.combine_weighted(y_ND, handle, gate_TK)   # sum_k gate * y
                       (+ shared_experts(x_TD))

``precision="fp8"``: the token rows leave quantized (1 x 128 tiles along D, about half the bytes;
:func:`tlx_dist.fp8.dispatch.dispatch_fp8`) and the gate/up GEMM reads them as they arrive; the two
grouped GEMMs (and their dgrad and wgrad) run in e4m3 with fp32 block scales
(:func:`tlx_dist.fp8.swiglu_experts_fp8`), the SwiGLU output quantized along F where it enters the
down GEMM, the weights in 128 x 128 blocks once per optimizer step
(:class:`~tlx_dist.fp8.Fp8WeightCache`); combine stays in the layer dtype with an fp32 k-sum.

Parameters: ``router.weight [E, D]`` (replicated), ``w13 [e, D, 2F]`` and ``w2 [e, F, D]`` (this
rank's experts ``[rank*e, (rank+1)*e)``), shared experts ``shared_w13 [D, 2*Fs]``, ``shared_w2
[Fs, D]`` (replicated). Init: normal(0, init_std) for every weight; each expert is drawn from its
own generator seeded by (layer seed, global expert id), so expert e has the same weights whatever
the expert-parallel degree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .comm import AllToAllDispatcher, Dispatcher, LocalDispatcher, SymmDispatcher
from .config import PRECISIONS, MoEConfig
from .fp8 import Fp8WeightCache, select_fp8_backend, swiglu_experts_fp8
from .fp8.api import runs_reference
from .fp8.dispatch import dispatch_fp8
from .fp8.tlx_gemm import Fp8GemmConfig
from .fused import FusedConfig, fused_experts, fused_experts_rows, fused_tlx_supports
from .grouped_gemm import GroupedGemmConfig, grouped_mm
from .router import Router, RoutingStats

__all__ = ["MoELayer", "make_dispatcher"]

_OUTSIDE_GRAPH: dict = {}


def _outside_graph(fn):
    """``torch.compiler.disable(fn)``, made once on first use: the decorator imports torch._dynamo
    (and with it triton), which ``import tlx_dist`` must not. Layers that need it call this in
    ``__init__`` (always eager), so a compiled forward only reads the cached wrapper."""
    if fn not in _OUTSIDE_GRAPH:
        _OUTSIDE_GRAPH[fn] = torch.compiler.disable(fn)
    return _OUTSIDE_GRAPH[fn]


def _narrow_experts(cfg) -> bool:
    """``pipeline="auto"``'s shape rule for the fused form: F <= 2 D. Wide experts (Mixtral's
    F = 3.5 D) run faster as the separate ops: their GEMMs are long enough that the fused form's
    gathers and atomic epilogues cost more than the copies they save."""
    return cfg.moe_inter_dim <= 2 * cfg.dim


def make_dispatcher(kind: Union[str, Dispatcher], num_experts: int,
                    group: Optional[dist.ProcessGroup] = None, validate: bool = True,
                    capacity: Optional[Union[str, float, int]] = None) -> Dispatcher:
    """``"auto"`` (local for one rank, all-to-all otherwise), ``"local"``, ``"all_to_all"``, ``"symm"``
    (the deduplicated symmetric-memory exchange; its buffers come from :func:`tlx_dist.comm.ep_buffers`,
    shared by every layer of the group, sized on the first dispatch). ``capacity`` (symm only):
    expanded rows per rank, ``"exact"`` (default) | ``"worst"`` | float factor | int rows."""
    if isinstance(kind, Dispatcher):
        return kind
    world = dist.get_world_size(group) if group is not None else 1
    if kind == "auto":
        kind = "local" if world == 1 else "all_to_all"
    if capacity is not None and kind != "symm":
        raise ValueError(f"capacity={capacity!r} applies to dispatcher='symm' only (got dispatcher={kind!r})")
    if kind == "local":
        if world != 1:
            raise ValueError(f"dispatcher='local' needs an EP group of one rank, got {world}")
        return LocalDispatcher(num_experts, validate=validate)
    if kind == "all_to_all":
        if group is None:
            raise ValueError("dispatcher='all_to_all' needs ep_group")
        return AllToAllDispatcher(num_experts, group, validate=validate)
    if kind == "symm":
        return SymmDispatcher(num_experts, group, validate=validate,
                              capacity="exact" if capacity is None else capacity)
    raise ValueError(f"dispatcher={kind!r} is not one of 'auto', 'local', 'all_to_all', 'symm' or a Dispatcher")


def swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    gate, up = h_N2F.chunk(2, dim=-1)
    return F.silu(gate) * up


class MoELayer(nn.Module):
    """Mixture-of-Experts feed-forward block. See the module docstring for the data flow.

    Args:
        cfg: the layer's :class:`MoEConfig`.
        ep_group: expert-parallel process group; ``None`` = one rank holding every expert.
        dispatcher: ``"auto" | "local" | "all_to_all" | "symm"`` or a :class:`Dispatcher` instance.
        capacity: with ``dispatcher="symm"``: expanded rows per rank, ``"exact"`` (default, one host
            sync per dispatch) | ``"worst"`` | float factor of ``T_max*K`` | int (static, graph-capturable).
        gemm_backend: pin the grouped-GEMM backend (``"tlx" | "triton" | "torch" | "reference"``;
            with ``precision="fp8"``: ``"tlx" | "torch" | "reference"``, tlx_dist/fp8/api.py).
        gemm_config: pin the TLX grouped GEMM's tile config (a
            :class:`~tlx_dist.grouped_gemm.GroupedGemmConfig`; with ``precision="fp8"`` an
            :class:`~tlx_dist.fp8.tlx_gemm.Fp8GemmConfig`) in the separate pipeline; with
            ``pipeline="auto"`` it keeps the layer on the separate pipeline, as ``gemm_backend`` does.
        fused_config: the fused pipeline's launch choices (a :class:`~tlx_dist.fused.FusedConfig`:
            row copies, tile configs, the layout kernel); default: every default.
        device: where parameters are created.
        pipeline: ``"fused"``: gather-on-load GEMMs with SwiGLU and gate-scatter epilogues
            (:mod:`tlx_dist.fused`) -- on one rank with the local dispatcher
            (:func:`~tlx_dist.fused.fused_experts`), and under expert parallelism with the symmetric
            exchange (``dispatcher="symm"``): the first GEMM reads the receive rows by index, the
            second adds each row's gate-weighted output into a per-receive-row partial, and one
            partial row per (token, rank) goes home (:meth:`SymmDispatcher.dispatch_rows` /
            ``combine_rows``); ``"separate"`` (dispatch -> grouped GEMMs -> combine) or ``"auto"``:
            fused where its TLX kernels run (sm_90, no pinned GEMM backend or config, supported
            shapes; one EP rank with the local dispatcher, or EP > 1 over the symmetric exchange)
            and the experts are not wide (F <= 2 D: wider experts run faster as the separate ops),
            separate elsewhere. Under EP the fused form runs about as fast as the separate pipeline
            over the same exchange and needs markedly less memory: no [N, D] expert-major copies,
            no [N, D] GEMM outputs kept. Pass a ``SymmDispatcher(..., row_regions=n_layers)`` to
            have each layer's rows read where they land, and ``overlap=True`` (with a static
            ``capacity``) for the arrival-driven overlap: this rank's own rows computed while the
            peers' land, the peers' partial rows sent home while its own are computed
            (:class:`~tlx_dist.comm.symm.RowsOverlap`; not faster than without it over NVLink).
            Across nodes (the hierarchical exchange) ``overlap=True`` needs no region: this node's
            rows are computed while the other nodes' cross the NICs
            (:class:`~tlx_dist.comm.symm.HierRowsOverlap`).
            Measurements behind these rules: ``docs/decisions.md``.
        precision: ``"bf16"`` or ``"fp8"`` for the routed experts' GEMMs; default ``cfg.precision``
            (the argument replaces it). ``"fp8"`` runs the separate pipeline on every dispatcher
            (dispatch -> FP8 grouped GEMMs with SwiGLU between -> combine; the fused FP8 pipeline is
            not built: ``pipeline="fused"`` is a ValueError). Where it runs: sm_90 with fbtriton
            (the TLX kernels), other CUDA GPUs with FP8 tensor cores (sm_89+: torch's
            ``_scaled_mm``, which syncs the host), and CPU, where it is the *reference* path
            (dequantized operands, fp32 matmuls: the same quantization, for tests and debugging).
            A GPU without FP8 tensor cores or ROCm is a ValueError naming ``precision``, as are
            GPU shapes the kernels cannot take (D or F not a multiple of 16), and fp32 activations
            on a GPU a TypeError naming it (fp32 masters with bf16 compute copies are fine); never a
            bf16 fallback.
        fp8_refresh: when the FP8 weight copies are remade (``precision="fp8"``): ``"version"``
            (default) when a weight's version counter or storage changes (every in-place update:
            an optimizer step of torch's foreach / for-loop optimizers, ``copy_``,
            ``load_state_dict``); ``"step"`` only after :meth:`invalidate_fp8_weights` (or a
            ``load_state_dict`` / ``reset_parameters``): for training loops whose optimizer writes
            without bumping versions (torch's fused AdamW) or whose weights are re-gathered per
            micro-batch (FSDP2); they call it once per optimizer step (``train/`` registers it as
            an optimizer step hook).

    ``forward(x)`` takes ``[B, S, D]`` or ``[T, D]`` and returns the same shape. After each forward,
    ``last_stats`` holds the :class:`RoutingStats` (tokens per expert, aux loss, z loss); add
    ``layer.aux_loss`` (aux + z, in the graph) to the training loss. ``layer.router.kernel = False``
    routes with the torch ops instead of the one-launch router kernel (:class:`~tlx_dist.router.Router`).
    """

    def __init__(self, cfg: MoEConfig, ep_group: Optional[dist.ProcessGroup] = None,
                 dispatcher: Union[str, Dispatcher] = "auto", gemm_backend: Optional[str] = None,
                 device: Optional[Union[str, torch.device]] = None, pipeline: str = "auto",
                 capacity: Optional[Union[str, float, int]] = None, *,
                 gemm_config: Optional[Union[GroupedGemmConfig, Fp8GemmConfig]] = None,
                 fused_config: Optional[FusedConfig] = None, precision: Optional[str] = None,
                 fp8_refresh: str = "version"):
        super().__init__()
        if pipeline not in ("auto", "fused", "separate"):
            raise ValueError(f"pipeline={pipeline!r} must be 'auto', 'fused' or 'separate'")
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        if precision is not None:
            if precision not in PRECISIONS:
                raise ValueError(f"precision={precision!r} must be one of {PRECISIONS} or None (cfg.precision)")
            if precision != cfg.precision:
                cfg = dataclasses.replace(cfg, precision=precision)  # validated again (dtype rules)
        precision = cfg.precision
        if fp8_refresh not in ("version", "step"):
            raise ValueError(f"fp8_refresh={fp8_refresh!r} must be 'version' or 'step'")
        if precision == "fp8":
            _check_fp8_args(cfg, pipeline, gemm_backend, gemm_config, fused_config, device)
        elif gemm_config is not None and not isinstance(gemm_config, GroupedGemmConfig):
            raise TypeError(f"gemm_config must be a GroupedGemmConfig or None, got {type(gemm_config).__name__} "
                            "(precision='bf16' runs the bf16 kernels; an Fp8GemmConfig needs precision='fp8')")
        if fused_config is not None and not isinstance(fused_config, FusedConfig):
            raise TypeError(f"fused_config must be a FusedConfig or None, got {type(fused_config).__name__}")
        if fused_config is not None and pipeline == "separate":
            raise ValueError("fused_config applies to the fused pipeline; pipeline='separate' runs none")
        world = dist.get_world_size(ep_group) if ep_group is not None else 1
        rank = dist.get_rank(ep_group) if ep_group is not None else 0
        cfg.validate(expert_parallel=world)
        self.cfg = cfg
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = world, rank
        self.num_local_experts = cfg.num_experts // world
        self.gemm_backend = gemm_backend
        self.gemm_config = gemm_config
        self.fused_config = fused_config
        self.precision = precision
        if precision == "fp8":
            _outside_graph(MoELayer._fp8_weights_eager)
        self.fp8_refresh = fp8_refresh
        # FP8 weight copies (precision="fp8"): made on the first forward after a change, see fp8_refresh.
        self._w13_fp8 = Fp8WeightCache()
        self._w2_fp8 = Fp8WeightCache()
        self._fp8_generation = 0
        if pipeline == "fused":
            ok = ("auto", "local", "symm") if world == 1 else ("symm",)
            if gemm_config is not None:
                raise ValueError("pipeline='fused' runs its own gather/scatter GEMMs: it takes no gemm_config "
                                 "(its tile configs are fused_config's)")
            if gemm_backend is not None or not (dispatcher in ok or isinstance(dispatcher, SymmDispatcher)):
                raise ValueError(
                    f"pipeline='fused' runs its own gather/scatter GEMMs: it takes no gemm_backend ({gemm_backend!r}) "
                    f"and exchanges tokens with dispatcher {' or '.join(map(repr, ok))} or a SymmDispatcher "
                    f"(EP group of {world}), got dispatcher={dispatcher!r}; use pipeline='separate'")
        self.pipeline = pipeline
        # Router ids are in range by construction: skip the (host-syncing) id validation.
        self.dispatcher = make_dispatcher(dispatcher, cfg.num_experts, ep_group, validate=False, capacity=capacity)
        self.dispatcher.validate = False  # also for a Dispatcher instance passed in
        if self.dispatcher.world_size != world or self.dispatcher.num_experts != cfg.num_experts:
            raise ValueError(
                f"dispatcher has E={self.dispatcher.num_experts}, W={self.dispatcher.world_size}; "
                f"layer has E={cfg.num_experts}, W={world}")
        # The fused EP form's own receive region, if the symmetric dispatcher reserved them
        # (SymmDispatcher(row_regions=...)): its rows are read where they land, no receive copy.
        fused_possible = precision == "bf16" and (pipeline == "fused" or (pipeline == "auto" and _narrow_experts(cfg)))
        self._rows_region = (self.dispatcher.claim_rows_region()
                             if isinstance(self.dispatcher, SymmDispatcher) and world > 1 and fused_possible else None)

        dt, D, Fe, e = cfg.torch_dtype, cfg.dim, cfg.moe_inter_dim, self.num_local_experts
        self.router = Router(cfg, device=device)
        self.w13 = nn.Parameter(torch.empty(e, D, 2 * Fe, dtype=dt, device=device))
        self.w2 = nn.Parameter(torch.empty(e, Fe, D, dtype=dt, device=device))
        if cfg.shared_dim:
            self.shared_w13 = nn.Parameter(torch.empty(D, 2 * cfg.shared_dim, dtype=dt, device=device))
            self.shared_w2 = nn.Parameter(torch.empty(cfg.shared_dim, D, dtype=dt, device=device))
        else:
            self.register_parameter("shared_w13", None)
            self.register_parameter("shared_w2", None)
        self.last_stats: Optional[RoutingStats] = None
        self.reset_parameters()
        # A checkpoint load replaces the weights: their FP8 copies are stale in either refresh mode.
        self.register_load_state_dict_post_hook(lambda module, _keys: module.invalidate_fp8_weights())

    @property
    def expert_range(self) -> tuple[int, int]:
        """Global ids ``[lo, hi)`` of this rank's experts."""
        return self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts

    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """Normal(0, init_std) init. ``seed`` defaults to a draw from the global RNG, which all
        ranks share when seeded alike, so EP=1 and EP=W layers built after the same
        ``torch.manual_seed`` hold identical experts."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # init only; not on any hot path
        std = self.cfg.init_std
        self.router.reset_parameters()
        lo, _ = self.expert_range
        for j in range(self.num_local_experts):
            g = torch.Generator().manual_seed(seed + 1_000_003 * (lo + j + 1))
            for w in (self.w13, self.w2):
                w[j].copy_(torch.randn(w.shape[1:], generator=g, dtype=torch.float32) * std)
        if self.shared_w13 is not None:
            nn.init.normal_(self.shared_w13, std=std)
            nn.init.normal_(self.shared_w2, std=std)
        self.invalidate_fp8_weights()

    def invalidate_fp8_weights(self) -> None:
        """Marks the FP8 copies of ``w13`` / ``w2`` stale: the next forward requantizes them. Call
        after each optimizer step with ``fp8_refresh="step"``; harmless otherwise."""
        self._fp8_generation += 1
        self._w13_fp8.invalidate()
        self._w2_fp8.invalidate()

    @property
    def fp8_quantizations(self) -> int:
        """How many times the expert weights were quantized to FP8 (both weights; tests, logging)."""
        return self._w13_fp8.quantizations + self._w2_fp8.quantizations

    @property
    def aux_loss(self) -> torch.Tensor:
        """aux + z loss of the last forward (coefficients applied), in the autograd graph."""
        if self.last_stats is None:
            raise RuntimeError("aux_loss is available after a forward pass")
        return self.last_stats.loss

    @torch.no_grad()
    def update_bias(self, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
        """Aux-loss-free balancing step (see :meth:`Router.update_bias`); call after the optimizer
        step. ``group`` should span every rank that routes tokens (data x expert parallel)."""
        if not self.cfg.load_balance_bias:
            raise RuntimeError("update_bias needs cfg.load_balance_bias=True")
        return self.router.update_bias(group)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"x must be [T, {self.cfg.dim}] or [B, S, {self.cfg.dim}], got shape {tuple(x.shape)}")
        if x.dtype != self.w13.dtype:
            raise TypeError(f"x.dtype={x.dtype} differs from the layer's dtype {self.w13.dtype} (cfg.dtype)")
        if x.device != self.w13.device:
            raise ValueError(f"x is on {x.device} but the layer's parameters are on {self.w13.device}")
        if self.cfg.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or inf (cfg.check_finite=True)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x_TD = x.reshape(-1, self.cfg.dim)
        # The last forward's stats hold its autograd graph (logits, losses), and with it the router
        # weight's AccumulateGrad node, which autograd reuses while it lives and which keeps the
        # stream it was made on. Dropped before routing: a step that ran on the default stream then
        # does not leak that stream into a later CUDA-graph capture on a side stream
        # (cudaErrorStreamCaptureImplicit at the capture's backward).
        self.last_stats = None
        route = self.router(x_TD)
        self.last_stats = route.stats
        if self._fused(x_TD):
            if isinstance(getattr(self.dispatcher, "_inner", self.dispatcher), LocalDispatcher):
                out_TD = fused_experts(x_TD, route.idx_TK, route.gate_TK, self.w13, self.w2, config=self.fused_config)
            else:
                out_TD = self._fused_ep(x_TD, route)
        else:
            out_TD = self._separate(x_TD, route)
        if self.shared_w13 is not None:
            out_TD = out_TD + swiglu(x_TD @ self.shared_w13) @ self.shared_w2
        return out_TD.view(x.shape)

    def _separate(self, x_TD: torch.Tensor, route) -> torch.Tensor:
        """dispatch -> grouped GEMMs with SwiGLU -> gate-weighted combine."""
        if self.precision == "fp8":
            # The token rows leave quantized; the gate/up GEMM reads them as they arrive, and on the
            # kernel backends dW13's tiles are made from them too, so the dequantized rows are not
            # written (recv_ND only carries their gradient). The reference backend keeps them: its
            # tiles are quantize_cols of the dequantized rows, the oracle of the kernels'. (The
            # experts select and check the backend themselves.)
            reference = runs_reference(x_TD.device, self.gemm_backend)
            recv_ND, rows_N, handle = dispatch_fp8(self.dispatcher, x_TD, route.idx_TK, route.gate_TK,
                                                   backend="reference" if self.gemm_backend == "reference" else None,
                                                   dequantize=reference)
            w13_fp8, w2_fp8 = self._fp8_weights()
            y_ND = swiglu_experts_fp8(recv_ND, self.w13, self.w2, handle.offsets_e, w13_fp8=w13_fp8, w2_fp8=w2_fp8,
                                      backend=self.gemm_backend, config=self.gemm_config, x_fp8=rows_N)
        else:
            recv_ND, handle = self.dispatcher.dispatch(x_TD, route.idx_TK, route.gate_TK)
            h = grouped_mm(recv_ND, self.w13, handle.offsets_e, backend=self.gemm_backend, config=self.gemm_config)
            y_ND = grouped_mm(swiglu(h), self.w2, handle.offsets_e, backend=self.gemm_backend, config=self.gemm_config)
        # sum_k gate * y: products in the activation dtype, k-sum in fp32, one rounding.
        return self.dispatcher.combine_weighted(y_ND, handle, route.gate_TK).to(x_TD.dtype)

    def _fused_ep(self, x_TD: torch.Tensor, route) -> torch.Tensor:
        """The fused pipeline over the symmetric exchange: receive rows -> gather-on-load GEMMs ->
        per-receive-row partial sums -> one row home per (token, rank)."""
        disp = self.dispatcher
        recv_RD, src_N, gate_N, handle = disp.dispatch_rows(x_TD, route.idx_TK, route.gate_TK,
                                                            region=self._rows_region)
        part_RD = fused_experts_rows(recv_RD, src_N, src_N, gate_N, self.w13, self.w2, handle.offsets_e,
                                     recv_RD.shape[0], overlap=handle.overlap, config=self.fused_config)
        return disp.combine_rows(part_RD, handle).to(x_TD.dtype)

    def _fp8_weights(self):
        # Outside any compiled graph: the cache reads version counters and keeps Python state.
        return _outside_graph(MoELayer._fp8_weights_eager)(self)

    def _fp8_weights_eager(self):
        gen = self._fp8_generation if self.fp8_refresh == "step" else None
        return self._w13_fp8.get(self.w13, gen), self._w2_fp8.get(self.w2, gen)

    def _fused(self, x_TD: torch.Tensor) -> bool:
        if self.precision == "fp8":
            return False
        if self.pipeline != "auto":
            return self.pipeline == "fused"
        # ``_inner``: the dispatcher under a profiling wrapper (train/profiling.py), which must not
        # change the pipeline being measured.
        dispatcher = getattr(self.dispatcher, "_inner", self.dispatcher)
        exchange = (isinstance(dispatcher, LocalDispatcher) if self.ep_size == 1
                    else isinstance(dispatcher, SymmDispatcher))
        return (exchange and self.gemm_backend is None and self.gemm_config is None and _narrow_experts(self.cfg)
                and fused_tlx_supports(x_TD, self.w13, self.w2))

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"D={c.dim}, F={c.moe_inter_dim}, E={c.num_experts} (local {self.num_local_experts}), "
                f"K={c.top_k}, score={c.score_func}, shared={c.num_shared_experts}, EP={self.ep_size}, "
                f"dispatcher={self.dispatcher.name}, precision={self.precision}")


def _check_fp8_args(cfg: MoEConfig, pipeline: str, gemm_backend, gemm_config, fused_config, device) -> None:
    """precision='fp8''s argument rules (MoELayer docstring); errors name ``precision``."""
    if pipeline == "fused":
        raise ValueError("precision='fp8' runs the separate pipeline (dispatch -> FP8 grouped GEMMs -> combine): "
                         "the fused FP8 pipeline is not built; use pipeline='separate' or 'auto', or precision='bf16'")
    if fused_config is not None:
        raise ValueError("fused_config applies to the fused pipeline, which precision='fp8' does not run")
    if gemm_backend is not None and gemm_backend not in ("tlx", "torch", "reference"):
        raise ValueError(f"precision='fp8' takes gemm_backend 'tlx', 'torch', 'reference' or None (the FP8 grouped "
                         f"GEMMs, tlx_dist/fp8/api.py), got {gemm_backend!r}")
    if gemm_config is not None and not isinstance(gemm_config, Fp8GemmConfig):
        raise TypeError(f"precision='fp8' takes gemm_config as an Fp8GemmConfig (tlx_dist.fp8.tlx_gemm) or None, got "
                        f"{type(gemm_config).__name__}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu":
        # (the dtype is checked at the GEMM: fp32 masters are fine where bf16 compute copies run the
        # forward, as in train/'s mixed precision; fp32 activations on a GPU are a TypeError there)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        D, Fe = cfg.dim, cfg.moe_inter_dim
        # Every GEMM of the layer: (K, NN) = (D, 2F), (F, D) and the backward's transposes.
        select_fp8_backend(dev, D, 2 * Fe, gemm_backend, f"w13's (D, 2F) = ({D}, {2 * Fe})")
        select_fp8_backend(dev, Fe, D, gemm_backend, f"w2's (F, D) = ({Fe}, {D})")
