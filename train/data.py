"""Byte-level text data that needs no download, with deterministic data-parallel sharding.

Corpus: ``pydoc`` is the English reference documentation shipped inside every CPython
(``pydoc_data.topics``, ~466 KB: a large model memorizes it within a few hundred steps);
``stdlib`` is the running Python's standard-library sources, each non-empty ``.py`` file one
document in sorted path order (``site-packages`` / ``dist-packages`` excluded; 10-30 MB depending
on how the install was trimmed, so the same install gives the same corpus); ``file`` reads a UTF-8
text file; ``synthetic`` draws uniform random bytes (for throughput runs: the tokens never touch
the disk or the host tokenizer).

Tokenizer: UTF-8 bytes 0..255, plus BOS=256, EOS=257, PAD=258 (vocab 259). Documents are joined
as ``BOS doc EOS BOS doc EOS ...``.

Sampling: the token stream is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len``.
Global sample ``g`` (g = 0, 1, 2, ...) is window ``perm_epoch[g % n_windows]`` with
``epoch = g // n_windows`` and a permutation drawn from ``(seed, epoch)``. Step ``s`` consumes
global samples ``[s * G, (s + 1) * G)`` with ``G = batch_size * world``, rank ``r`` takes the
``r``-th block of ``batch_size``. So the data seen by the job depends only on the step and the
global batch, not on how the ranks are arranged, and the position (``samples_seen``) is one integer
saved in the checkpoint. With ``train.grad_accum = k`` an optimizer step is k such steps of the
loader (micro-batches): it consumes ``k * G`` samples, which is the global batch a resume checks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import DataConfig

__all__ = ["BOS", "EOS", "PAD", "VOCAB", "encode", "decode", "load_corpus", "ByteLoader"]

BOS, EOS, PAD = 256, 257, 258
VOCAB = 259


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as ``[n]`` int64 token ids."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids) -> str:
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the running Python's standard library, in sorted path order, third-party
    packages excluded (the ``stdlib`` corpus)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    return sorted(f for f in root.rglob("*.py") if not skip.intersection(f.relative_to(root).parts))


def _docs(cfg: DataConfig) -> list[str]:
    if cfg.source == "pydoc":
        from pydoc_data.topics import topics
        return [topics[k] for k in sorted(topics)]
    if cfg.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError("data.source='stdlib': this Python has no standard-library sources (.py files)")
        texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
        return [t for t in texts if t]  # empty files (many __init__.py) are no documents
    if cfg.source == "file":
        return Path(cfg.path).read_text(encoding="utf-8").split("\n\n\n")
    raise ValueError(f"data.source={cfg.source!r} has no corpus")


def load_corpus(cfg: DataConfig) -> torch.Tensor:
    """``[n]`` int64 token stream ``BOS doc EOS ...``."""
    parts = []
    for d in _docs(cfg):
        parts += [torch.tensor([BOS]), encode(d), torch.tensor([EOS])]
    return torch.cat(parts)


class ByteLoader:
    """Batches ``(inputs_BS, targets_BS)`` int64 for one rank. ``samples_seen`` is the global
    position (see the module docstring); ``state_dict`` / ``load_state_dict`` carry it."""

    def __init__(self, cfg: DataConfig, rank: int, world: int, device=None, grad_accum: int = 1):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.grad_accum = grad_accum
        self.samples_seen = 0
        self._perm_epoch = -1
        if cfg.source == "synthetic":
            self.tokens = None
            self.n_windows = 1 << 30
        else:
            self.tokens = load_corpus(cfg)
            self.n_windows = (self.tokens.numel() - 1) // cfg.seq_len
            if self.n_windows < 1:
                raise ValueError(f"data.seq_len={cfg.seq_len} is longer than the corpus ({self.tokens.numel()} tokens)")

    def _window(self, g: int) -> torch.Tensor:
        S = self.cfg.seq_len
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + g)
            return torch.randint(0, 256, (S + 1,), generator=gen)
        epoch, i = divmod(g, self.n_windows)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n_windows, generator=gen)
            self._perm_epoch = epoch
        start = int(self._perm[i]) * S
        return self.tokens[start:start + S + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.cfg.batch_size
        first = self.samples_seen + self.rank * b
        rows = torch.stack([self._window(first + j) for j in range(b)])
        self.samples_seen += b * self.world
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        """``global_batch``: sequences per optimizer step (all ranks, all micro-batches)."""
        return {"samples_seen": self.samples_seen, "global_batch": self.cfg.batch_size * self.world * self.grad_accum}

    def load_state_dict(self, sd: dict) -> None:
        gb = self.cfg.batch_size * self.world * self.grad_accum
        if sd["global_batch"] != gb:
            raise ValueError(f"checkpoint global batch {sd['global_batch']} differs from "
                             f"data.batch_size * world * train.grad_accum = {self.cfg.batch_size} * {self.world} * "
                             f"{self.grad_accum} = {gb}; choose those so the product is the saved one")
        self.samples_seen = int(sd["samples_seen"])
