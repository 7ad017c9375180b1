"""Benchmark results as data, shared by every bench script.

A run writes two files under ``--results-dir`` (default ``bench/results``), named by topic, machine
and UTC date, ``<topic>_<machine>_<yyyymmdd>``:

  ``.md``     a header (GPU, commit, torch / triton versions, the command) and what the bench printed:
              its markdown tables as tables, every other line in a text block, in the order printed;
  ``.jsonl``  one JSON object per measurement: ``op``, ``provider``, ``shape``, ``median``, ``p20``,
              ``p80`` (``null`` where the bench keeps no spread), ``unit`` (the bench's own: ``ms``,
              ``us``, ``TFLOP/s``, ``GB/s``), then ``gpu``, ``machine``, ``world``, ``date``, ``run``
              (UTC time of the run), ``commit``, ``torch``, ``triton``, ``topic``, ``bench`` (the
              script) and ``extra`` (the bench's other fields for that measurement).

Topics group what a reader compares: ``exchange`` (bench/dispatch.py and bench/exchange_tiles.py),
``p2p_link`` (bench/p2p_copy.py), otherwise the script's name.

A second run on the same day appends to both files (the ``.md`` gets one section per run; the
``.jsonl`` rows carry their ``run``). ``machine`` is the GPU's short name (``h200``, ``b200``,
``mi300x``; ``cpu`` without a GPU) with ``x<world>`` when several ranks ran (``h200x2``).

Use (rank 0 writes; other ranks pass ``enabled=False`` or call nothing)::

    ap = argparse.ArgumentParser(); ...; _results.add_args(ap); args = ap.parse_args()
    rec = _results.Recorder("grouped_gemm", args)      # from here on, stdout is also recorded
    ...
    rec.row("fwd", "tlx", {"shape": "olmoe", "N": N}, median=tflops, unit="TFLOP/s")
    rec.write()                                        # prints where it wrote
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "results"
ROW_FIELDS = ("op", "provider", "shape", "median", "p20", "p80", "unit")

_VENDOR_WORDS = {"nvidia", "amd", "geforce", "tesla", "instinct", "radeon", "quadro"}


def add_args(ap: argparse.ArgumentParser) -> None:
    """Adds ``--results-dir DIR`` and ``--no-results`` to a bench's command line."""
    ap.add_argument("--results-dir", default=str(DEFAULT_DIR),
                    help="write <topic>_<machine>_<yyyymmdd>.md (the printed tables) and .jsonl (raw rows) "
                         "here (default: bench/results)")
    ap.add_argument("--no-results", action="store_true", help="write no results files")


def machine_name(gpu: str, world: int = 1) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"AMD Instinct MI300X"`` -> ``"mi300x"``,
    ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"``, ``"cpu"`` -> ``"cpu"``; ``world > 1`` appends
    ``x<world>``. The first word holding a digit, with any words before it that are not vendor
    names (``"NVIDIA GeForce RTX 4090"`` -> ``"rtx4090"``)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be a positive int")
    words = [w for w in re.split(r"[\s\-_/]+", gpu.lower()) if w]
    words = [w for w in words if w not in _VENDOR_WORDS]
    picked = []
    for w in words:
        picked.append(w)
        if any(c.isdigit() for c in w):
            break
    name = re.sub(r"[^a-z0-9]", "", "".join(picked)) or "unknown"
    return name if world == 1 else f"{name}x{world}"


def gpu_name() -> str:
    """This process's GPU (``torch.cuda.get_device_name()``), or ``"cpu"`` without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def git_commit(root: Path = HERE.parent) -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it; ``"unknown"``
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def spread(samples: Sequence[float]) -> dict:
    """``{"median", "p20", "p80"}`` of ``samples`` (the 20th / 80th percentiles by linear
    interpolation; ``None`` from a single sample, which has no spread)."""
    xs = sorted(float(v) for v in samples)
    if not xs:
        raise ValueError("samples is empty")
    if len(xs) == 1:
        return {"median": xs[0], "p20": None, "p80": None}

    def q(p: float) -> float:
        i = p * (len(xs) - 1)
        lo = int(i)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

    return {"median": statistics.median(xs), "p20": q(0.2), "p80": q(0.8)}


def _versions() -> dict:
    out = {}
    for mod in ("torch", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def _finite(v: Any) -> Any:
    """JSON has no NaN / inf: they become null."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


class _Tee:
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)


def printed_to_markdown(text: str) -> str:
    """Printed output as markdown: runs of lines starting with ``|`` (the benches' markdown tables)
    stay as they are, printed headings (``# ...``) go two levels down (under the run's heading);
    every other run of lines goes into a text block, so nothing is reflowed."""
    out, block, table = [], [], []

    def flush_block():
        while block and not block[-1].strip():
            block.pop()
        while block and not block[0].strip():
            block.pop(0)
        if block:
            out.extend(["```text", *block, "```", ""])
        block.clear()

    def flush_table():
        if table:
            out.extend([*table, ""])
        table.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            flush_block()
            table.append(line.strip())
        elif re.match(r"#{1,4} \S", line):  # a printed heading, two levels below the run's own
            flush_block()
            flush_table()
            out.extend(["##" + line, ""])
        else:
            flush_table()
            block.append(line.rstrip())
    flush_block()
    flush_table()
    return "\n".join(out).rstrip() + "\n"


class Recorder:
    """Collects one bench run's rows and printed output and writes them (module docstring).

    ``args``: the parsed command line holding ``results_dir`` / ``no_results`` (:func:`add_args`),
    or ``None`` with ``results_dir`` given. ``enabled=False`` (e.g. ranks other than 0) records
    nothing and writes nothing. ``world``: ranks that ran the bench together (the machine name's
    ``x<world>``); ``gpu`` / ``machine`` replace what this process finds (a projection names its
    machine ``projected``). Printed output is recorded from construction (``capture=False``: not at
    all; :meth:`text` adds text by hand).
    """

    def __init__(self, topic: str, args: Optional[argparse.Namespace] = None, *, results_dir: Optional[str] = None,
                 enabled: bool = True, world: int = 1, gpu: Optional[str] = None, machine: Optional[str] = None,
                 capture: bool = True, argv: Optional[Sequence[str]] = None,
                 now: Optional[datetime.datetime] = None):
        if not re.fullmatch(r"[a-z0-9][a-z0-9_]*", topic or ""):
            raise ValueError(f"topic={topic!r} must be lower-case letters, digits and '_'")
        if args is not None:
            results_dir = getattr(args, "results_dir", results_dir)
            enabled = enabled and not getattr(args, "no_results", False)
        self.topic, self.enabled = topic, bool(enabled)
        self.dir = Path(results_dir) if results_dir else DEFAULT_DIR
        self.gpu = gpu if gpu is not None else (gpu_name() if self.enabled else "cpu")
        self.world = world
        if machine is not None and not re.fullmatch(r"[a-z0-9]+", machine):
            raise ValueError(f"machine={machine!r} must be lower-case letters and digits")
        self.machine = machine or machine_name(self.gpu, world)
        self.now = (now or datetime.datetime.now(datetime.timezone.utc)).astimezone(datetime.timezone.utc)
        self.argv = list(sys.argv if argv is None else argv)
        self.rows: list[dict] = []
        self._texts: list[str] = []
        self._tee: Optional[_Tee] = None
        self._written = False
        if self.enabled and capture:
            self._tee = _Tee(sys.stdout)
            sys.stdout = self._tee

    @property
    def stem(self) -> str:
        return f"{self.topic}_{self.machine}_{self.now:%Y%m%d}"

    def row(self, op: str, provider: str, shape: Any, median: Optional[float], p20: Optional[float] = None,
            p80: Optional[float] = None, unit: str = "ms", **extra: Any) -> None:
        """One measurement: ``op`` (what ran: ``"dispatch"``, ``"fwd"``), ``provider`` (whose code),
        ``shape`` (a dict of sizes, or a name), ``median`` / ``p20`` / ``p80`` in ``unit``; ``extra``:
        anything else the bench knows about it (ratios, errors, the spread's samples)."""
        for name, v in (("op", op), ("provider", provider), ("unit", unit)):
            if not isinstance(v, str) or not v:
                raise TypeError(f"{name}={v!r} must be a non-empty str")
        for name, v in (("median", median), ("p20", p20), ("p80", p80)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"{name}={v!r} must be a number or None")
        self.rows.append({"op": op, "provider": provider, "shape": shape, "median": _finite(median),
                          "p20": _finite(p20), "p80": _finite(p80), "unit": unit,
                          "extra": {k: v for k, v in extra.items()}})

    def text(self, s: str) -> None:
        """Adds ``s`` to the ``.md`` as if it had been printed."""
        self._texts.append(s if s.endswith("\n") else s + "\n")

    def stop_capture(self) -> str:
        """Stops recording stdout; returns what was recorded."""
        if self._tee is not None:
            if sys.stdout is self._tee:
                sys.stdout = self._tee.stream
            self._texts.append("".join(self._tee.parts))
            self._tee = None
        return "".join(self._texts)

    def write(self) -> Optional[tuple[Path, Path]]:
        """Appends this run to ``<dir>/<stem>.md`` and ``.jsonl``; returns their paths (``None``
        when disabled). Once per recorder."""
        printed = self.stop_capture()
        if not self.enabled:
            return None
        if self._written:
            raise RuntimeError("Recorder.write() was already called")
        self._written = True
        self.dir.mkdir(parents=True, exist_ok=True)
        md, jl = self.dir / f"{self.stem}.md", self.dir / f"{self.stem}.jsonl"
        v = _versions()
        commit = git_commit()
        run = self.now.strftime("%Y-%m-%dT%H:%M:%SZ")
        common = {"gpu": self.gpu, "machine": self.machine, "world": self.world, "date": f"{self.now:%Y-%m-%d}",
                  "run": run, "commit": commit, "torch": v["torch"], "triton": v["triton"], "topic": self.topic,
                  "bench": Path(self.argv[0]).name if self.argv else None}
        with jl.open("a") as f:
            for r in self.rows:
                f.write(json.dumps({**r, **common}, default=str) + "\n")
        head = [] if md.exists() else [f"# {self.topic} results: {self.machine}, {self.now:%Y-%m-%d}", ""]
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        head += [f"## Run {run}", "",
                 f"- GPU: {self.gpu}" + (f" x {self.world} ranks" if self.world > 1 else ""),
                 f"- commit {commit}, torch {v['torch']}, triton {v['triton']}",
                 f"- command: `{cmd}`",
                 f"- raw rows: [{jl.name}]({jl.name}) ({len(self.rows)} rows of this run)", ""]
        with md.open("a") as f:
            f.write("\n".join(head) + "\n" + printed_to_markdown(printed) + "\n")
        print(f"results: {md} and {jl.name} (+{len(self.rows)} rows)", flush=True)
        return md, jl

    def close(self) -> None:
        """Stops recording without writing (an error path)."""
        self.stop_capture()


def env_world() -> int:
    """The torchrun world size from the environment (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
