"""Typed training configuration, loaded from a TOML recipe and validated on load.

A recipe has the tables ``[model]``, ``[model.moe]``, ``[parallel]``, ``[data]``, ``[train]``,
``[checkpoint]`` and ``[metrics]``; every field is a dataclass field below. Errors name the field,
e.g. ``model.moe.num_experts=12 is not divisible by parallel.ep=8``. Overrides use dotted keys:
``--override train.steps=20 --override model.moe.top_k=1`` (values parsed as TOML, bare words
as strings).

Errors in what the user asked for (recipe, override, file, resume) are :class:`UsageError`
(a ``ValueError``); ``python -m train.pretrain`` prints their one-line message and exits 2.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from tlx_dist import MoEConfig
from tlx_dist.comm import ExchangeConfig

__all__ = ["UsageError", "ModelConfig", "ParallelConfig", "DataConfig", "TrainConfig", "CheckpointConfig",
           "MetricsConfig", "Config", "load_config", "config_from_dict", "apply_overrides"]


class UsageError(ValueError):
    """A bad recipe, override, path or resume request: the message is the whole story (the CLI
    prints it on one line and exits with status 2, no traceback)."""


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only MoE transformer. The MoE FFN's ``dim`` is taken from ``dim``.

    dim: hidden size D; n_layers: blocks; n_heads: attention heads (head_dim = D / n_heads);
    n_dense_layers: the first blocks use a dense SwiGLU MLP of ``dense_inter_dim`` instead of MoE;
    vocab_size: at least the tokenizer's (259 for bytes + BOS/EOS/PAD).
    """

    dim: int
    n_layers: int
    n_heads: int
    moe: MoEConfig
    vocab_size: int = 259
    n_dense_layers: int = 0
    dense_inter_dim: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class ParallelConfig:
    """ep: expert-parallel degree (one DeviceMesh dimension); dp: data-parallel degree, 0 = world / ep.
    The mesh is (dp, ep); experts are sharded over ep and FSDP-sharded over dp, everything else
    is FSDP-sharded over all dp*ep ranks.

    dispatcher: the token exchange of the MoE layers: ``"auto"`` (the deduplicated symmetric-memory
    exchange on CUDA when ep > 1 -- inside one node, and across nodes where NVSHMEM runs, there the
    hierarchical exchange (``exchange.topology``); all-to-all elsewhere (CPU / gloo, across nodes
    without NVSHMEM); one rank: no exchange), ``"all_to_all"``
    (NCCL/gloo ``all_to_all_single``) or ``"symm"`` (CUDA only). capacity_factor (symm): expanded
    expert rows per rank as a factor of tokens*top_k; 0 = exact (one host read per layer per step),
    > 0 = static (no host sync; overflow raises at the next log step, naming this key).
    moe_pipeline: the MoE layers' ``pipeline`` (``tlx_dist.MoELayer``): ``"auto"`` (the fused TLX
    pipeline where it runs -- one EP rank, or ep > 1 over the symmetric exchange -- separate ops
    otherwise), ``"fused"`` (also under expert parallelism, over the symmetric exchange's row form:
    needs dispatcher symm, or auto resolving to it) or ``"separate"``.
    ep_row_regions: each MoE layer that runs the fused EP pipeline over the symmetric exchange (ep >
    1, dispatcher symm or auto resolving to it, moe_pipeline fused or auto) gets its own symmetric
    receive region, where its dispatched rows land and its fused GEMMs read them (no receive-side
    copy); costs ``W*T*D`` elements of symmetric memory per MoE layer (T = batch_size*seq_len),
    about what the copies it replaces hold at the end of the forward (with
    ``activation_checkpoint = "moe"`` those copies are freed and recomputed, the regions are not).
    Elsewhere (one rank, all-to-all, separate pipeline) it does nothing, so a recipe that sets it
    still runs with those overrides. Not for schedules that run a layer's forward twice before its
    backward.
    sharding: how FSDP2 spreads the parameters over their data-parallel ranks (``train.mesh``):
    ``"full"`` (default) shards each over all of them; ``"hybrid"`` (HSDP) shards inside a node and
    replicates across nodes -- dense parameters on a (node, rank-in-node) mesh, each expert over
    the ranks of its expert-data-parallel group in one node (none when ep fills the node) and
    replicated over the nodes -- so all-gathers and reduce-scatters stay on the node's links and
    of the parameter traffic only one all-reduce of the gradient shards crosses the NICs per
    optimizer step. One node: the same as "full".
    ranks_per_node: ranks of one node; 0 (default) = torchrun's ``LOCAL_WORLD_SIZE`` (no torchrun:
    one node). Set it to emulate nodes (e.g. 4 processes as 2 nodes x 2); ranks ``n * ranks_per_node
    + [0, ranks_per_node)`` form node n, torchrun's placement. The meshes and the symmetric exchange
    both take their nodes from it (the exchange: which peers it reaches by NVSHMEM, and the nodes of
    its hierarchical form).
    exchange: the symmetric exchange's settings, the table ``[parallel.exchange]`` (the fields of
    :class:`tlx_dist.comm.ExchangeConfig`, e.g. ``copy_engine = "off"``; a kernel's launch shape
    as ``[parallel.exchange.send]``). ``overlap = true`` (the arrival-driven overlap of the fused
    layers) needs ``capacity_factor > 0``, and over the flat exchange (an EP group inside one node)
    ``ep_row_regions = true``; across nodes the hierarchical exchange overlaps the inter-node leg
    with the GEMMs on the node's rows without regions (checked);
    ``timeout_s`` defaults to ``train.comm_timeout_s``.
    reduce_dtype: the dtype gradients cross the links in: ``"float32"`` (default) or ``"bfloat16"``
    (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)`` for the reduce-scatters and the cross-node
    all-reduces, and the all-reduce of the router / shared-expert gradients over ep). Only the
    communication is bf16: master weights, gradients, optimizer state and the accumulation over
    ``train.grad_accum`` micro-batches stay fp32 (``train.parallelize``). Halves the gradient bytes
    on the NICs; each reduction rounds to bf16 (about 2^-8 of the summed magnitudes per add)."""

    ep: int = 1
    dp: int = 0
    dispatcher: str = "auto"
    capacity_factor: float = 0.0
    moe_pipeline: str = "auto"
    ep_row_regions: bool = False
    sharding: str = "full"
    ranks_per_node: int = 0
    reduce_dtype: str = "float32"
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)


@dataclass(frozen=True)
class DataConfig:
    """source: ``"pydoc"`` (Python's bundled documentation text), ``"stdlib"`` (the running Python's
    standard-library sources: a corpus too large to memorize in a short run), ``"file"`` (``path``,
    UTF-8 text) or ``"synthetic"`` (uniform random bytes, for benchmarks). batch_size is per rank."""

    seq_len: int = 128
    batch_size: int = 8
    source: str = "pydoc"
    path: str = ""
    seed: int = 1234


@dataclass(frozen=True)
class TrainConfig:
    """compile: ``torch.compile`` the dense part of every block (norms, attention, residual; the
    dense MLP layers) and the loss (final norm, head, cross-entropy); the MoE layers stay eager.
    activation_checkpoint: ``"none"``; ``"moe"`` recomputes each MoE FFN (router, dispatch,
    expert GEMMs, combine) in the backward instead of keeping its activations -- most of the
    activation memory of an MoE model, for ~1/3 more expert GEMM time; ``"full"`` recomputes
    whole blocks. Recomputation never changes the losses.
    grad_accum: micro-batches of ``data.batch_size`` sequences per rank accumulated into one
    optimizer step (the loss of each scaled by 1 / grad_accum); gradients are reduced once per step
    where the sharding allows it (``train.parallelize.set_gradient_sync``). A step consumes
    ``data.batch_size * world * grad_accum`` sequences; tokens/s and MFU count all of them."""

    steps: int = 100
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"          # auto = bf16 on GPU, fp32 on CPU
    log_every: int = 10
    gemm_backend: str = ""       # "" = automatic (tlx -> torch -> triton -> reference)
    compile: bool = False        # torch.compile the dense block parts and the loss (GPU recipes: on)
    activation_checkpoint: str = "none"   # "none" | "moe" | "full"
    crash_at_step: int = 0       # testing only: os._exit after this step (simulates a killed job)
    comm_timeout_s: float = 600.0  # a collective waiting longer than this fails (a rank died or hangs)
    optimizer: str = "adamw"     # "adamw" | "adamw_bf16_grads" (one rank, bf16: bf16 gradients, the
                                 # compute copies written by the update; train/optim.py) | "auto"
                                 # (adamw_bf16_grads on one bf16 rank, else adamw)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""                # "" = no checkpoints
    every: int = 0
    resume: bool = True          # continue from the latest checkpoint in ``dir`` if there is one
    keep: int = 0                # keep only the newest ``keep`` complete checkpoints (0 = keep all);
                                 # an EP=2 OLMoE-8-layer checkpoint with Adam states is ~40 GB


@dataclass(frozen=True)
class MetricsConfig:
    out_dir: str = ""            # "" = no JSONL / TensorBoard output
    tensorboard: bool = True
    progress: bool = True


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- loading -------------------------------------------------------------------------------------

def _check_type(prefix: str, name: str, value: Any, hint: Any) -> Any:
    if get_origin(hint) is Union:  # Optional[int]
        if value is None:
            return value
        hint = [a for a in get_args(hint) if a is not type(None)][0]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ValueError(f"{prefix}.{name}={value!r} must be of type {hint.__name__}")
    return value


# keys of earlier recipes, and what took their place
_MOVED = {"parallel.exchange_copy_engine": "parallel.exchange.copy_engine",
          "parallel.ep_overlap": "parallel.exchange.overlap",
          "parallel.exchange_bulk": None}  # (the bulk-copy send was removed: it moved rows no faster)


def _build(cls, d: Any, prefix: str):
    if not isinstance(d, dict):
        raise ValueError(f"{prefix} must be a table, got {d!r}")
    if cls is ExchangeConfig:  # (its own field types, tiles and checks, errors named after prefix)
        return ExchangeConfig.from_dict(d, prefix=prefix)
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in sorted(set(d) - names):
        if f"{prefix}.{k}" in _MOVED:
            new = _MOVED[f"{prefix}.{k}"]
            raise ValueError(f"{prefix}.{k} was replaced by {new}" if new else
                             f"{prefix}.{k} was removed (the option lost; drop the key)")
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{prefix}: unknown field(s) {unknown}; known: {sorted(names)}")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{prefix}.{f.name} is missing")
            continue
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            kw[f.name] = _build(hint, d[f.name], f"{prefix}.{f.name}")
        else:
            kw[f.name] = _check_type(prefix, f.name, d[f.name], hint)
    return cls(**kw)


def _positive(prefix: str, obj, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        if v < 0 or (v == 0 and not allow_zero):
            raise ValueError(f"{prefix}.{n}={v!r} must be {'non-negative' if allow_zero else 'positive'}")


ACTIVATION_CHECKPOINT = ("none", "moe", "full")
SHARDING = ("full", "hybrid")
REDUCE_DTYPES = ("float32", "bfloat16")


def _validate(cfg: Config) -> None:
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    _positive("model", m, "dim", "n_layers", "n_heads", "vocab_size", "rope_theta", "norm_eps")
    _positive("model", m, "n_dense_layers", "dense_inter_dim", allow_zero=True)
    if m.dim % m.n_heads:
        raise ValueError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    if m.head_dim % 2:
        raise ValueError(f"model.dim / model.n_heads = {m.head_dim} must be even (RoPE rotates pairs)")
    if m.vocab_size < 259:
        raise ValueError(f"model.vocab_size={m.vocab_size} must be >= 259 (256 bytes + BOS/EOS/PAD)")
    if m.n_dense_layers > m.n_layers:
        raise ValueError(f"model.n_dense_layers={m.n_dense_layers} exceeds model.n_layers={m.n_layers}")
    if m.n_dense_layers and not m.dense_inter_dim:
        raise ValueError(f"model.dense_inter_dim=0 must be positive when model.n_dense_layers={m.n_dense_layers}")
    if m.moe.dim != m.dim:
        raise ValueError(f"model.moe.dim={m.moe.dim} must equal model.dim={m.dim} (leave it out)")
    _positive("parallel", p, "ep")
    _positive("parallel", p, "dp", allow_zero=True)
    if m.moe.num_experts % p.ep:
        raise ValueError(f"model.moe.num_experts={m.moe.num_experts} is not divisible by parallel.ep={p.ep}")
    if p.dispatcher not in ("auto", "all_to_all", "symm"):
        raise ValueError(f"parallel.dispatcher={p.dispatcher!r} must be 'auto', 'all_to_all' or 'symm'")
    if p.dispatcher == "all_to_all" and p.ep == 1:
        raise ValueError("parallel.dispatcher='all_to_all' needs parallel.ep > 1 (one rank exchanges nothing)")
    if p.moe_pipeline not in ("auto", "fused", "separate"):
        raise ValueError(f"parallel.moe_pipeline={p.moe_pipeline!r} must be 'auto', 'fused' or 'separate'")
    if p.moe_pipeline == "fused" and p.ep > 1 and p.dispatcher == "all_to_all":
        raise ValueError("parallel.moe_pipeline='fused' with parallel.ep > 1 exchanges tokens through the symmetric "
                         "exchange: set parallel.dispatcher to 'symm' or 'auto', not 'all_to_all'")
    if not (0 <= p.capacity_factor < math.inf):
        raise ValueError(f"parallel.capacity_factor={p.capacity_factor!r} must be 0 (exact) or a positive factor")
    if p.exchange.overlap and not p.ep_row_regions and p.exchange.topology == "flat":
        # (the hierarchical exchange's overlap needs no regions; whether "auto" takes it depends on
        # the ranks' nodes, checked when the exchange is built: train.parallelize)
        raise ValueError("parallel.exchange.overlap=true over the flat exchange overlaps the dispatch with GEMMs that "
                         "read the rows where they land: set parallel.ep_row_regions = true too")
    if p.exchange.overlap and p.capacity_factor == 0:
        raise ValueError("parallel.exchange.overlap=true needs a static capacity (the rows leave before the counts "
                         "are known): set parallel.capacity_factor > 0")
    if p.sharding not in SHARDING:
        raise ValueError(f"parallel.sharding={p.sharding!r} must be one of {', '.join(map(repr, SHARDING))}")
    _positive("parallel", p, "ranks_per_node", allow_zero=True)
    if p.reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"parallel.reduce_dtype={p.reduce_dtype!r} must be one of {', '.join(map(repr, REDUCE_DTYPES))}")
    _positive("data", d, "seq_len", "batch_size")
    if d.source not in ("pydoc", "stdlib", "file", "synthetic"):
        raise ValueError(f"data.source={d.source!r} must be 'pydoc', 'stdlib', 'file' or 'synthetic'")
    if d.source == "file" and not d.path:
        raise ValueError("data.path='' must name a UTF-8 text file when data.source='file'")
    _positive("train", t, "steps", "grad_accum", "lr", "log_every", "comm_timeout_s")
    _positive("train", t, "warmup_steps", "weight_decay", "grad_clip", "crash_at_step", allow_zero=True)
    if not 0 <= t.min_lr_ratio <= 1:
        raise ValueError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    for b in ("beta1", "beta2"):
        if not 0 <= getattr(t, b) < 1:
            raise ValueError(f"train.{b}={getattr(t, b)} must be in [0, 1)")
    if t.dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"train.dtype={t.dtype!r} must be 'auto', 'bf16' or 'fp32'")
    from .optim import OPTIMIZERS

    if t.optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer={t.optimizer!r} must be one of {', '.join(map(repr, OPTIMIZERS))}")
    if t.activation_checkpoint not in ACTIVATION_CHECKPOINT:
        raise ValueError(f"train.activation_checkpoint={t.activation_checkpoint!r} must be one of "
                         f"{', '.join(repr(a) for a in ACTIVATION_CHECKPOINT)}")
    _positive("checkpoint", cfg.checkpoint, "every", "keep", allow_zero=True)
    if cfg.checkpoint.every and not cfg.checkpoint.dir:
        raise ValueError(f"checkpoint.every={cfg.checkpoint.every} needs checkpoint.dir")


def config_from_dict(d: dict) -> Config:
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ValueError(f"unknown table(s) {unknown}")
    if "model" not in d:
        raise ValueError("model is missing")
    model = dict(d["model"])
    moe = dict(model.get("moe", {}))
    if "dim" not in model:
        raise ValueError("model.dim is missing")
    dim_from_model = "dim" not in moe
    moe.setdefault("dim", model.get("dim"))
    try:
        model["moe"] = MoEConfig.from_dict(moe, prefix="model.moe")
    except ValueError as e:  # MoEConfig's own checks say "moe.<field>"; name the full path
        msg = str(e)
        msg = "model." + msg if msg.startswith("moe.") else msg
        if dim_from_model and msg.startswith("model.moe.dim="):  # the user wrote model.dim, not moe.dim
            msg = "model.dim=" + msg[len("model.moe.dim="):]
        raise ValueError(msg) from None
    hints = get_type_hints(ModelConfig)
    mkw = {}
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(model) - names)
    if unknown:
        raise ValueError(f"model: unknown field(s) {unknown}; known: {sorted(names)}")
    for f in dataclasses.fields(ModelConfig):
        if f.name in model:
            mkw[f.name] = model[f.name] if f.name == "moe" else _check_type("model", f.name, model[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING:
            raise ValueError(f"model.{f.name} is missing")
    kw = {"model": ModelConfig(**mkw)}
    for f in dataclasses.fields(Config):
        if f.name != "model" and f.name in d:
            kw[f.name] = _build(get_type_hints(Config)[f.name], d[f.name], f.name)
    cfg = Config(**kw)
    _validate(cfg)
    return cfg


def _parse_value(s: str) -> Any:
    try:
        return tomllib.loads(f"v = {s}")["v"]
    except tomllib.TOMLDecodeError:
        return s  # bare word: a string


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """``["train.steps=20", "model.moe.top_k=1"]`` applied to the raw recipe dict (in place)."""
    for o in overrides or []:
        if "=" not in o:
            raise ValueError(f"--override {o!r} must look like key.path=value")
        key, val = o.split("=", 1)
        *path, leaf = key.strip().split(".")
        if not leaf or not all(path):
            raise ValueError(f"--override {o!r}: empty key in {key.strip()!r}")
        node = d
        for p in path:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--override {o!r}: {p} is not a table")
        node[leaf] = _parse_value(val.strip())
    return d


def read_toml(path: Union[str, Path]) -> dict:
    """The recipe at ``path`` as a dict; a missing/unreadable file or a TOML syntax error is a
    :class:`UsageError` that names the file."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: invalid TOML: {e}") from None


def load_config(path: Union[str, Path], overrides: Optional[list[str]] = None) -> Config:
    """Reads, overrides and validates a recipe. Every problem with the file, the overrides or the
    values is a :class:`UsageError` whose message names the file or the field."""
    d = read_toml(path)
    try:
        return config_from_dict(apply_overrides(d, overrides or []))
    except UsageError:
        raise
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
