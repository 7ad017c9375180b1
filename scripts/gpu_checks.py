"""Runs the project's GPU checks, declared once in scripts/gpu_checks.toml.

    python3 scripts/gpu_checks.py --list
    python3 scripts/gpu_checks.py --kind nvidia-h200-x2 [--optional] [--out DIR]
    python3 scripts/gpu_checks.py --only gpu-kernels,memcheck-fused [--kind nvidia-h200]

Each check runs from the repository root with the tree on PYTHONPATH, its output in
``<out>/<name>.log`` (``<out>/<name>/rank<r>.log`` for a per-GPU-node launch), a heartbeat line on
this terminal every 30 s while it runs, and a summary table at the end (also written to
``<out>/summary.md`` and ``summary.json``). Exit status 0 when every check passed.

What it needs (it sources nothing; set the environment up first):
  * a CUDA build of torch and the GPUs the kind names (``nvidia-smi`` / ``torch.cuda.device_count()``);
  * fbtriton (TLX) importable as ``triton``: ``pip install -e '.[tlx]'`` (or ``bash scripts/setup.sh
    test``), after ``pip uninstall -y triton``; where no package index is reachable, unpack the
    fbtriton wheel into a folder and put it first on PYTHONPATH;
  * for the NVSHMEM checks, the nvshmem4py wheel matching the CUDA build (``pip install -e
    '.[nvshmem]'`` for CUDA 13, ``'.[nvshmem-cu12]'`` for CUDA 12) and NVSHMEM's library (CUDA builds of
    torch bring the ``nvidia-nvshmem`` wheel);
  * ``compute-sanitizer`` on PATH for the memcheck checks (it ships with the CUDA toolkit).
The runner prints what it finds of these before the first check and warns about what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = Path(__file__).resolve().parent / "gpu_checks.toml"
LAUNCHES = ("once", "per-gpu-node")
HEARTBEAT_S = 30.0
_FIELDS = {"name", "kinds", "command", "timeout", "checks", "launch", "env", "optional"}
_REQUIRED = ("name", "kinds", "command", "timeout", "checks")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9@%+=:,./_-]+$")


@dataclass(frozen=True)
class Check:
    """One ``[[check]]`` of the list (scripts/gpu_checks.toml says what each field means)."""

    name: str
    kinds: tuple[str, ...]
    command: str
    timeout: float
    checks: str
    launch: str = "once"
    env: dict = field(default_factory=dict)
    optional: bool = False


@dataclass(frozen=True)
class CheckList:
    kinds: dict            # kind -> GPUs of one host
    env: dict              # environment of every check
    checks: tuple[Check, ...]

    def get(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise ValueError(f"--only: no check named {name!r}; known: {', '.join(c.name for c in self.checks)}")


def _str_table(d, where: str) -> dict:
    if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in d.items()):
        raise ValueError(f"{where} must be a table of strings")
    return dict(d)


def parse(text: str, source: str = "gpu_checks.toml") -> CheckList:
    """The check list in ``text`` (TOML), validated: every problem is a ValueError naming the
    check and the field."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: invalid TOML: {e}") from None
    unknown = sorted(set(d) - {"kinds", "env", "check"})
    if unknown:
        raise ValueError(f"{source}: unknown table(s) {unknown}; known: check, env, kinds")
    kinds = d.get("kinds")
    if not isinstance(kinds, dict) or not kinds:
        raise ValueError(f"{source}: [kinds] must map each machine kind to its GPU count")
    for k, n in kinds.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{source}: kinds.{k}={n!r} must be a positive GPU count")
    env = _str_table(d.get("env", {}), f"{source}: [env]")
    raw = d.get("check", [])
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: no [[check]] entries")
    checks, seen = [], set()
    for i, c in enumerate(raw):
        where = f"{source}: check {c.get('name', f'#{i + 1}')!r}" if isinstance(c, dict) else f"{source}: check #{i + 1}"
        if not isinstance(c, dict):
            raise ValueError(f"{where} must be a table")
        bad = sorted(set(c) - _FIELDS)
        if bad:
            raise ValueError(f"{where}: unknown field(s) {bad}; known: {sorted(_FIELDS)}")
        missing = [f for f in _REQUIRED if f not in c]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        name = c["name"]
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise ValueError(f"{where}: name={name!r} must be lower-case letters, digits and '-'")
        if name in seen:
            raise ValueError(f"{where}: name {name!r} is used twice")
        seen.add(name)
        ks = c["kinds"]
        if not isinstance(ks, list) or not ks or not all(isinstance(k, str) for k in ks):
            raise ValueError(f"{where}: kinds={ks!r} must be a non-empty list of kinds")
        for k in ks:
            if k not in kinds:
                raise ValueError(f"{where}: kinds has {k!r}, not in [kinds] ({', '.join(kinds)})")
        if not isinstance(c["command"], str) or not c["command"].strip():
            raise ValueError(f"{where}: command must be a non-empty string")
        t = c["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"{where}: timeout={t!r} must be a positive number of seconds")
        if not isinstance(c["checks"], str) or not c["checks"].strip():
            raise ValueError(f"{where}: checks must say what the check checks")
        launch = c.get("launch", "once")
        if launch not in LAUNCHES:
            raise ValueError(f"{where}: launch={launch!r} must be one of {', '.join(LAUNCHES)}")
        if launch == "per-gpu-node" and any(kinds[k] < 2 for k in ks):
            raise ValueError(f"{where}: launch='per-gpu-node' needs kinds of 2 or more GPUs")
        opt = c.get("optional", False)
        if not isinstance(opt, bool):
            raise ValueError(f"{where}: optional={opt!r} must be true or false")
        try:
            c["command"].format(gpus=1, out="o", results="r")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{where}: command may use only {{gpus}}, {{out}} and {{results}} ({e!r})") from None
        checks.append(Check(name, tuple(ks), c["command"], float(t), c["checks"].strip(), launch,
                            _str_table(c.get("env", {}), f"{where}: env"), opt))
    return CheckList(dict(kinds), env, tuple(checks))


def load(path: Path = DEFAULT_FILE) -> CheckList:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    return parse(text, str(path))


def select(cl: CheckList, kind: Optional[str], only: Optional[list[str]] = None,
           optional: bool = False) -> list[Check]:
    """The checks to run: ``only`` (in that order; each must allow ``kind`` when one is given), else
    every check ``kind`` allows, the optional ones only with ``optional``."""
    if kind is not None and kind not in cl.kinds:
        raise ValueError(f"--kind {kind!r} is not a known kind ({', '.join(cl.kinds)})")
    if only:
        picked = [cl.get(n) for n in only]
        if kind is not None:
            bad = [c.name for c in picked if kind not in c.kinds]
            if bad:
                raise ValueError(f"--only {','.join(bad)}: not for --kind {kind} (see --list)")
        return picked
    if kind is None:
        raise ValueError("give --kind (or --only): which machine is this?")
    return [c for c in cl.checks if kind in c.kinds and (optional or not c.optional)]


def format_list(cl: CheckList) -> str:
    kinds = list(cl.kinds)
    short = {k: ("x" + k.rsplit("-x", 1)[1]) if "-x" in k else "x1" for k in kinds}
    head = "| check | " + " | ".join(short[k] for k in kinds) + " | timeout s | checks |"
    lines = [f"kinds: " + ", ".join(f"{short[k]} = {k} ({n} GPU{'s' if n > 1 else ''})" for k, n in cl.kinds.items()),
             "", head, "|---" * (3 + len(kinds)) + "|"]
    for c in cl.checks:
        cells = " | ".join("yes" if k in c.kinds else "" for k in kinds)
        opt = " (optional)" if c.optional else ""
        lines.append(f"| {c.name}{opt} | {cells} | {c.timeout:.0f} | {c.checks} |")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [l.strip() for l in f.read().decode("utf-8", "replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


_SUMMARY = re.compile(r"(\d+ (passed|failed|error|errors)\b.*)|ERROR SUMMARY.*|all ok|^step +\d+.*", re.I)


def _summary_line(path: Path) -> str:
    """The log's pytest / memcheck / training summary line, else its last line."""
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    for l in reversed(lines):
        if _SUMMARY.search(l.strip("= ")):
            return l.strip("= ")[:160]
    return lines[-1][:160] if lines else ""


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_check(c: Check, gpus: int, out: Path, results: Path, base_env: dict, heartbeat_s: float = HEARTBEAT_S,
              echo=print) -> dict:
    """Runs one check; returns its summary row (name, status, rc, seconds, log, line)."""
    cmd = c.command.format(gpus=gpus, out=out / c.name, results=results)
    (out / c.name).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **base_env, **c.env}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if c.launch == "per-gpu-node":
        port = str(_free_port())
        ranks = [dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(gpus), LOCAL_WORLD_SIZE="1",
                      RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK=str(r)) for r in range(gpus)]
        logs = [out / c.name / f"rank{r}.log" for r in range(gpus)]
    else:
        ranks, logs = [env], [out / f"{c.name}.log"]
    echo(f"== {c.name}: {cmd}" + (f"  (x{gpus}, one node per GPU)" if c.launch == "per-gpu-node" else ""), flush=True)
    t0 = time.monotonic()
    procs, files = [], []
    try:
        for e, log in zip(ranks, logs):
            f = open(log, "w")
            files.append(f)
            procs.append(subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=e, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        timed_out, next_beat = False, t0 + heartbeat_s
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now - t0 > c.timeout:
                timed_out = True
                _kill(procs)
                break
            if now >= next_beat:
                echo(f"   {c.name}: running {now - t0:.0f} s | {_last_line(logs[0])}", flush=True)
                next_beat += heartbeat_s
            time.sleep(0.2)
        for p in procs:
            p.wait()
    finally:
        _kill(procs)
        for f in files:
            f.close()
    secs = time.monotonic() - t0
    rcs = [p.returncode for p in procs]
    rc = next((r for r in rcs if r != 0), 0)
    status = "timeout" if timed_out else ("pass" if rc == 0 else "FAIL")
    row = {"name": c.name, "status": status, "rc": rc, "seconds": round(secs, 1),
           "log": str(logs[0] if len(logs) == 1 else out / c.name), "line": _summary_line(logs[0])}
    if status == "timeout":
        row["line"] = f"killed after {c.timeout:.0f} s | {row['line']}"
    echo(f"== {c.name}: {status} (rc {rc}, {secs:.0f} s) {row['line']}", flush=True)
    return row


def format_summary(rows: list[dict]) -> str:
    lines = ["| check | result | rc | seconds | summary |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['rc']} | {r['seconds']:.0f} | {r['line'].replace('|', '/')} |"
              for r in rows]
    return "\n".join(lines)


def preflight(echo=print) -> Optional[int]:
    """Prints what this machine has (torch, GPUs, triton/TLX, compute-sanitizer); returns the GPU count
    (None when torch is missing)."""
    probe = ("import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
             "names = sorted({torch.cuda.get_device_name(i) for i in range(n)})\n"
             "try:\n    import triton; tv = triton.__version__\nexcept ImportError:\n    tv = None\n"
             "try:\n    import tlx; tlx_ok = tlx.tlx_available()\nexcept Exception:\n    tlx_ok = False\n"
             "print(torch.__version__, n, tv, tlx_ok, '; '.join(names), sep='|')")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    except subprocess.TimeoutExpired:
        echo("preflight: probing torch timed out")
        return None
    if p.returncode != 0:
        echo(f"preflight: torch is not importable here ({p.stderr.strip().splitlines()[-1:] or '?'})")
        return None
    tv, n, trv, tlx_ok, names = p.stdout.strip().splitlines()[-1].split("|")
    san = subprocess.run(["bash", "-c", "command -v compute-sanitizer"], capture_output=True, text=True).stdout.strip()
    echo(f"preflight: torch {tv}; {n} CUDA GPU(s) {names}; triton {trv}; TLX {'yes' if tlx_ok == 'True' else 'NO'}; "
         f"compute-sanitizer {san or 'NOT on PATH'}")
    if tlx_ok != "True":
        echo("preflight: TLX is not importable: the TLX kernels' checks will skip or fail (see --help)")
    return int(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_checks.py", description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the checks and the kinds each runs on")
    ap.add_argument("--kind", help="the machine kind (a key of [kinds]): run every check it allows")
    ap.add_argument("--only", help="comma-separated check names: run just these, in this order")
    ap.add_argument("--optional", action="store_true", help="with --kind: the optional checks (benchmarks) too")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_checks",
                    help="logs folder (default: $OUT, else /tmp/gpu_checks)")
    ap.add_argument("--gpus", type=int, help="GPU count for {gpus} (default: the kind's; with --only and no "
                                               "--kind, the GPUs this machine has)")
    ap.add_argument("--file", default=str(DEFAULT_FILE), help="the check list (default: scripts/gpu_checks.toml)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    try:
        cl = load(Path(args.file))
        if args.list:
            print(format_list(cl))
            return 0
        only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
        picked = select(cl, args.kind, only, args.optional)
        if args.gpus is not None and args.gpus < 1:
            raise ValueError(f"--gpus {args.gpus} must be positive")
        if not _SAFE_PATH.match(args.out):
            raise ValueError(f"--out {args.out!r}: use a path of letters, digits and ./_-+=:,@% (it goes into commands)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    results = out / "results"
    found = None if args.dry_run else preflight()
    gpus = args.gpus or (cl.kinds[args.kind] if args.kind else found) or 1
    if args.dry_run:
        for c in picked:
            print(f"{c.name}: {c.command.format(gpus=gpus, out=out / c.name, results=results)}"
                  + ("  [per-gpu-node]" if c.launch == "per-gpu-node" else ""))
        return 0
    if found is not None and found < gpus:
        print(f"warning: {gpus} GPU(s) asked for, {found} found: the checks that need them will fail")
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_check(c, gpus, out, results, cl.env) for c in picked]
    table = format_summary(rows)
    print("\n" + table)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    failed = [r["name"] for r in rows if r["status"] != "pass"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed" + (f"; not: {', '.join(failed)}" if failed else "")
          + f"; logs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
