"""Tier T0 for the training loop: recipe loading and validation, FLOP/MFU accounting against a
hand count, parameter counts against the built model, and deterministic data sharding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.config import load_config
from train.data import BOS, EOS, ByteLoader, decode, encode, load_corpus
from train.metrics import PEAK_BF16_TFLOPS, flops_per_token, param_counts, peak_flops

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))
DEBUG = [c for c in CONFIGS if c.name == "debug_cpu.toml"][0]


def test_recipe_set():
    assert {c.stem for c in CONFIGS} >= {"debug_cpu", "h200_1gpu", "h200_1gpu_fp8", "h200_2gpu_ep2", "h200_8gpu_ep8",
                                         "h200_8x8", "b200_16x8", "mi300x_16x8"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipes_load_and_validate(path):
    """Every recipe loads and validates on CPU; its launch line (torchrun in the header comment)
    gives a world the mesh accepts; GPU recipes compile the dense parts, the CPU one does not."""
    import re
    cfg = load_config(path)
    assert cfg.model.moe.dim == cfg.model.dim
    assert cfg.model.moe.num_experts % cfg.parallel.ep == 0
    text = path.read_text()
    nproc = re.search(r"--nproc-per-node=(\d+)", text)
    nnodes = re.search(r"--nnodes=(\d+)", text)
    world = (int(nproc.group(1)) if nproc else 1) * (int(nnodes.group(1)) if nnodes else 1)
    assert world % cfg.parallel.ep == 0, f"{path.name}: launched on {world} ranks, parallel.ep={cfg.parallel.ep}"
    dp = cfg.parallel.dp or world // cfg.parallel.ep
    assert dp * cfg.parallel.ep == world
    if nnodes:   # the multi-node recipes: shard inside a node, replicate across, with room to amortize
        from train.mesh import _expert_shards
        # the step's one cross-node all-reduce amortized over >= 32k tokens per GPU: several
        # micro-batches, or one large one (b200_16x8: its backward is what hides the all-reduce)
        tokens = cfg.train.grad_accum * cfg.data.batch_size * cfg.data.seq_len
        assert cfg.parallel.sharding == "hybrid" and tokens >= 32768, (path.name, tokens)
        assert _expert_shards(cfg, int(nproc.group(1)), cfg.parallel.ep) >= 1   # raises if the layout cannot be built
        assert f"--config configs/{path.name}" in text
    assert cfg.train.compile == (path.stem != "debug_cpu")
    assert param_counts(cfg.model).active < param_counts(cfg.model).total


def test_ep2_recipe_is_the_one_gpu_model_at_ep2():
    one = load_config([c for c in CONFIGS if c.stem == "h200_1gpu"][0])
    two = load_config([c for c in CONFIGS if c.stem == "h200_2gpu_ep2"][0])
    assert two.model == one.model and two.parallel.ep == 2
    assert (two.data.batch_size, two.data.seq_len) == (8, 4096) == (one.data.batch_size, one.data.seq_len)


def test_fp8_recipe_is_the_one_gpu_recipe_in_fp8():
    """configs/h200_1gpu_fp8.toml differs from h200_1gpu only in the experts' precision and where it
    writes, so the two runs' loss curves compare step for step."""
    import dataclasses
    one = load_config([c for c in CONFIGS if c.stem == "h200_1gpu"][0])
    fp8 = load_config([c for c in CONFIGS if c.stem == "h200_1gpu_fp8"][0])
    assert (one.model.moe.precision, fp8.model.moe.precision) == ("bf16", "fp8")
    assert dataclasses.replace(fp8.model, moe=dataclasses.replace(fp8.model.moe, precision="bf16")) == one.model
    assert (fp8.parallel, fp8.data, fp8.train) == (one.parallel, one.data, one.train)
    assert fp8.metrics.out_dir != one.metrics.out_dir and fp8.checkpoint.dir != one.checkpoint.dir


@pytest.mark.parametrize("override, message", [
    (["model.moe.num_experts=12", "parallel.ep=8"], "model.moe.num_experts=12 is not divisible by parallel.ep=8"),
    (["model.n_heads=5"], "model.dim=96 is not divisible by model.n_heads=5"),
    # model.dim seeds model.moe.dim: a bad value is still named as the user wrote it
    (["model.dim=abc"], "model.dim='abc' must be a positive integer"),
    (["model.dim=-3"], "model.dim=-3 must be a positive integer"),
    (["model.moe.dim=abc"], "model.moe.dim='abc' must be a positive integer"),
    (["model.moe.top_k=9"], "model.moe.top_k=9 exceeds num_experts=8"),
    (["train.lr=-1.0"], "train.lr=-1.0 must be positive"),
    (["train.steps='ten'"], "train.steps='ten' must be of type int"),
    (["data.source=web"], "data.source='web' must be 'pydoc', 'stdlib', 'file' or 'synthetic'"),
    (["train.dtype=fp8"], "train.dtype='fp8' must be 'auto', 'bf16' or 'fp32'"),
    (["train.bogus=1"], "train: unknown field(s) ['bogus']"),
    (["model.moe.bogus=1"], "model.moe: unknown field(s) ['bogus']"),
    (["checkpoint.every=5"], "checkpoint.every=5 needs checkpoint.dir"),
    (["model.n_dense_layers=4"], "model.n_dense_layers=4 exceeds model.n_layers=3"),
    (["parallel.dispatcher=nccl"], "parallel.dispatcher='nccl' must be 'auto', 'all_to_all' or 'symm'"),
    (["parallel.dispatcher=all_to_all"], "parallel.dispatcher='all_to_all' needs parallel.ep > 1"),
    (["parallel.capacity_factor=-1.0"], "parallel.capacity_factor=-1.0 must be 0 (exact) or a positive factor"),
    (["parallel.capacity_factor=inf"], "parallel.capacity_factor=inf must be 0 (exact) or a positive factor"),
])
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ValueError) as e:
        load_config(DEBUG, override)
    assert message in str(e.value)


def test_dispatcher_choice_per_device():
    """parallel.dispatcher="auto": the symmetric exchange on CUDA when ep > 1, the layer default
    (local / all-to-all) on CPU; "symm" on CPU is a usage error naming the key."""
    from types import SimpleNamespace

    from train.config import UsageError
    from train.parallelize import make_train_dispatcher

    cfg = load_config(DEBUG, ["parallel.ep=2"])
    pd = SimpleNamespace(ep=2, ep_group=None)
    assert make_train_dispatcher(cfg, pd, torch.device("cpu")) == "auto"
    with pytest.raises(UsageError, match="parallel.dispatcher='symm' needs CUDA GPUs"):
        make_train_dispatcher(load_config(DEBUG, ["parallel.ep=2", "parallel.dispatcher=symm"]), pd, torch.device("cpu"))


def test_overrides_are_typed():
    cfg = load_config(DEBUG, ["train.steps=7", "train.lr=1e-3", "model.moe.score_func=softmax",
                              "train.lr=2", "checkpoint.resume=false"])
    assert cfg.train.steps == 7 and cfg.train.lr == 2.0 and isinstance(cfg.train.lr, float)
    assert cfg.model.moe.score_func == "softmax" and cfg.checkpoint.resume is False


def test_mfu_formula_matches_hand_count_h200():
    """OLMoE-shaped h200_1gpu: D=2048, F=1024, E=64, K=8, L=8, H=16, Dh=128, S=4096, V=259."""
    cfg = load_config([c for c in CONFIGS if c.name == "h200_1gpu.toml"][0])
    D, F, E, K, L, V, S = 2048, 1024, 64, 8, 8, 259, 4096
    per_layer_dense = 4 * D * D + 2 * D + E * D          # wqkv + wo + 2 norms + router
    experts = L * E * 3 * D * F
    embedding, head, final_norm = V * D, V * D, D
    total = embedding + L * per_layer_dense + experts + head + final_norm
    assert param_counts(cfg.model).total == total == 3_357_587_456
    active_no_embed = L * per_layer_dense + L * K * 3 * D * F + head + final_norm
    attn = 12 * L * 16 * 128 * S
    fpt = 6 * active_no_embed + attn
    assert flops_per_token(cfg.model, S) == fpt
    # MFU at 10k tokens/s on an H200: 10_000 * fpt / 989e12
    assert abs(10_000 * fpt / (PEAK_BF16_TFLOPS["H200"] * 1e12) - 0.04081) < 1e-4
    assert peak_flops(torch.device("cpu"), bf16=True) is None  # CPU: MFU n/a, never guessed


def test_param_counts_match_built_model():
    from train.model import Transformer
    cfg = load_config(DEBUG, ["model.moe.num_shared_experts=2", "model.n_dense_layers=2", "model.n_layers=4"])
    m = Transformer(cfg.model)
    pc = param_counts(cfg.model)
    assert pc.total == sum(p.numel() for p in m.parameters())
    assert pc.experts == sum(p.numel() for n, p in m.named_parameters() if n.endswith(("ffn.w13", "ffn.w2"))
                             and p.dim() == 3)
    x = torch.randint(0, 259, (2, 16))
    assert m(x).shape == (2, 16, cfg.model.vocab_size)


def test_byte_tokenizer_roundtrip():
    s = "def f(x): return x ** 2  # é"
    assert decode(encode(s)) == s
    toks = load_corpus(load_config(DEBUG).data)
    assert toks[0] == BOS and toks[-1] == EOS and int(toks.max()) <= EOS and len(toks) > 400_000


def test_stdlib_corpus(monkeypatch, tmp_path):
    """data.source='stdlib': every non-empty standard-library .py file once, as one document each,
    in sorted path order, third-party packages left out; a Python without sources is a clear error."""
    import sysconfig

    from train import data as D

    root = tmp_path / "lib"
    files = {"b.py": "B", "a/x.py": "AX", "a/__init__.py": "", "site-packages/pkg/m.py": "NO",
             "a/dist-packages/q.py": "NO", "notes.txt": "NO"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "stdlib": str(root)})
    cfg = load_config(DEBUG, ["data.source=stdlib"]).data
    assert [f.relative_to(root).as_posix() for f in D.stdlib_files()] == ["a/__init__.py", "a/x.py", "b.py"]
    assert decode(load_corpus(cfg)) == "AXB" and load_corpus(cfg).tolist().count(BOS) == 2
    for f in root.rglob("*.py"):
        f.unlink()
    with pytest.raises(ValueError, match=r"data\.source='stdlib'"):
        load_corpus(cfg)


def test_stdlib_corpus_of_this_python_is_large():
    """The real corpus: larger than pydoc by well over an order of magnitude (what makes it a
    corpus a short run of a large model does not memorize)."""
    from train.data import stdlib_files

    files = stdlib_files()
    assert len(files) > 100 and sum(f.stat().st_size for f in files) > 5_000_000


@pytest.mark.parametrize("source", ["pydoc", "synthetic"])
def test_sharding_is_layout_independent_and_resumable(source):
    """2 ranks x b rows = 1 rank x 2b rows, step by step; a loader restored from state_dict
    continues with the same batches."""
    cfg = load_config(DEBUG, ["data.batch_size=3", f"data.source={source}"]).data
    cfg2 = load_config(DEBUG, ["data.batch_size=6", f"data.source={source}"]).data
    r0, r1, one = ByteLoader(cfg, 0, 2), ByteLoader(cfg, 1, 2), ByteLoader(cfg2, 0, 1)
    for _ in range(3):
        (x0, y0), (x1, y1), (x, y) = r0.next_batch(), r1.next_batch(), one.next_batch()
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        assert not torch.equal(x0, x1)
    fresh = ByteLoader(cfg, 1, 2)
    fresh.load_state_dict(r1.state_dict())
    assert torch.equal(fresh.next_batch()[0], r1.next_batch()[0])
    with pytest.raises(ValueError, match="global batch"):
        ByteLoader(cfg2, 0, 2).load_state_dict(r1.state_dict())


def test_prune_checkpoints_keeps_newest_complete(tmp_path):
    """checkpoint.keep: the newest ``keep`` complete checkpoints stay; a newer step that never got
    ``latest`` (a save killed midway) is neither counted nor deleted; keep=0 deletes nothing."""
    from train.checkpoint import prune_checkpoints
    for s in (10, 20, 30, 40):
        (tmp_path / f"step_{s}").mkdir()
        (tmp_path / f"step_{s}" / "x").write_text("x")
    (tmp_path / "latest").write_text("30")
    assert prune_checkpoints(str(tmp_path), 0) == []
    gone = prune_checkpoints(str(tmp_path), 2)
    assert sorted(gone) == [str(tmp_path / "step_10")]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_20", "step_30", "step_40"]
    prune_checkpoints(str(tmp_path), 1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_30", "step_40"]
    assert prune_checkpoints(str(tmp_path / "nothing_here"), 1) == []


def test_checkpoint_keep_must_be_non_negative():
    from train.config import load_config
    with pytest.raises(ValueError, match="checkpoint.keep"):
        load_config("configs/debug_cpu.toml", ["checkpoint.keep=-1"])


def test_moe_pipeline_setting_reaches_the_layers():
    """parallel.moe_pipeline is validated with its key and handed to every MoE layer."""
    from train.config import load_config
    from train.model import Transformer
    with pytest.raises(ValueError, match="parallel.moe_pipeline='fast'"):
        load_config("configs/debug_cpu.toml", ["parallel.moe_pipeline=fast"])
    with pytest.raises(ValueError, match="parallel.moe_pipeline='fused' with parallel.ep > 1"):
        load_config("configs/debug_cpu.toml", ["parallel.moe_pipeline=fused", "parallel.ep=2",
                                               "parallel.dispatcher=all_to_all"])
    cfg = load_config("configs/debug_cpu.toml", ["parallel.moe_pipeline=fused"])
    model = Transformer(cfg.model, pipeline=cfg.parallel.moe_pipeline)
    moes = [b.moe for b in model.layers if b.moe is not None]
    assert moes and all(m.pipeline == "fused" for m in moes)
