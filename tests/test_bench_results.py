"""bench/_results.py, the writer every bench calls (tier T0, CPU): file names, the .md (what was
printed) and the .jsonl rows, appends on a second run, bad input; and every bench script's CLI
has --results-dir / --no-results."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _results  # noqa: E402

NOW = datetime.datetime(2026, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
ROW_KEYS = {"op", "provider", "shape", "median", "p20", "p80", "unit", "gpu", "machine", "world", "date", "run",
            "commit", "torch", "triton", "topic", "bench", "extra"}


@pytest.mark.parametrize("gpu, world, name", [
    ("NVIDIA H200", 1, "h200"),
    ("NVIDIA H200", 2, "h200x2"),
    ("NVIDIA H100 80GB HBM3", 1, "h100"),
    ("NVIDIA A100-SXM4-80GB", 8, "a100x8"),
    ("NVIDIA B200", 1, "b200"),
    ("AMD Instinct MI300X", 1, "mi300x"),
    ("NVIDIA GeForce RTX 4090", 1, "rtx4090"),   # words before the one with a digit, vendor names dropped
    ("cpu", 1, "cpu"),
    ("", 1, "unknown"),
])
def test_machine_name(gpu, world, name):
    assert _results.machine_name(gpu, world) == name


@pytest.mark.parametrize("world", [0, -1, 1.5, "2"])
def test_machine_name_rejects_bad_world(world):
    with pytest.raises(ValueError, match="world="):
        _results.machine_name("NVIDIA H200", world)


def test_spread():
    q = _results.spread([5.0, 1.0, 4.0, 2.0, 3.0])   # sorted 1..5: p20 at index 0.8, p80 at 3.2
    assert q == {"median": 3.0, "p20": pytest.approx(1.8), "p80": pytest.approx(4.2)}
    assert _results.spread([2.5]) == {"median": 2.5, "p20": None, "p80": None}   # one sample: no spread
    with pytest.raises(ValueError, match="empty"):
        _results.spread([])


def _args(tmp_path, *extra):
    ap = argparse.ArgumentParser()
    _results.add_args(ap)
    return ap.parse_args(["--results-dir", str(tmp_path), *extra])


def test_add_args_defaults():
    ap = argparse.ArgumentParser()
    _results.add_args(ap)
    a = ap.parse_args([])
    assert Path(a.results_dir) == ROOT / "bench" / "results" and a.no_results is False


def test_a_run_writes_the_printed_tables_and_raw_rows(tmp_path, capsys):
    rec = _results.Recorder("grouped_gemm", _args(tmp_path), gpu="NVIDIA H200", now=NOW,
                            argv=["bench/grouped_gemm.py", "--shapes", "olmoe"])
    print("olmoe balanced fwd  tlx=612.0")           # a progress line
    print("| shape | tlx TFLOP/s |\n|---|---|\n| olmoe | 612.0 |")
    rec.row("fwd", "tlx", {"shape": "olmoe", "N": 131072}, 612.0, unit="TFLOP/s", vs_torch=1.02)
    rec.row("fwd", "torch", {"shape": "olmoe", "N": 131072}, 0.61, 0.60, 0.63)   # ms, with a spread
    rec.row("dW", "tlx", "olmoe", float("nan"))      # NaN is not JSON: it becomes null
    md, jl = rec.write()
    assert md == tmp_path / "grouped_gemm_h200_20260304.md" and jl == md.with_suffix(".jsonl")
    assert "olmoe balanced fwd" in capsys.readouterr().out   # still printed, not only recorded
    text = md.read_text()
    assert text.startswith("# grouped_gemm results: h200, 2026-03-04\n")
    assert "## Run 2026-03-04T05:06:07Z" in text and "- GPU: NVIDIA H200" in text
    assert "`bench/grouped_gemm.py --shapes olmoe`" in text
    assert "```text\nolmoe balanced fwd  tlx=612.0\n```" in text   # progress in a text block ...
    assert "\n| shape | tlx TFLOP/s |\n|---|---|\n| olmoe | 612.0 |\n" in text   # ... tables as tables
    rows = [json.loads(line) for line in jl.read_text().splitlines()]
    assert len(rows) == 3 and all(set(r) == ROW_KEYS for r in rows)
    a, b, c = rows
    assert (a["op"], a["provider"], a["median"], a["p20"], a["p80"], a["unit"]) == ("fwd", "tlx", 612.0, None, None,
                                                                                     "TFLOP/s")
    assert a["extra"] == {"vs_torch": 1.02} and a["shape"] == {"shape": "olmoe", "N": 131072}
    assert (b["median"], b["p20"], b["p80"], b["unit"]) == (0.61, 0.60, 0.63, "ms")
    assert c["median"] is None and c["shape"] == "olmoe"
    assert {(r["gpu"], r["machine"], r["world"], r["date"], r["run"]) for r in rows} == {
        ("NVIDIA H200", "h200", 1, "2026-03-04", "2026-03-04T05:06:07Z")}
    assert rows[0]["torch"] and rows[0]["commit"] and rows[0]["bench"] == "grouped_gemm.py"


def test_a_second_run_the_same_day_appends(tmp_path):
    for i, when in enumerate((NOW, NOW + datetime.timedelta(hours=1))):
        rec = _results.Recorder("exchange", _args(tmp_path), gpu="NVIDIA H200", world=2, now=when, capture=False)
        rec.text(f"| T | us |\n|---|---|\n| 128 | {i} |")
        rec.row("dispatch", "symm", {"W": 2, "T": 128}, float(i), unit="us")
        rec.write()
    md, = tmp_path.glob("*.md")
    assert md.name == "exchange_h200x2_20260304.md"
    text = md.read_text()
    assert text.count("# exchange results") == 1 and text.count("## Run ") == 2 and "| 128 | 1 |" in text
    rows = [json.loads(line) for line in md.with_suffix(".jsonl").read_text().splitlines()]
    assert [r["median"] for r in rows] == [0.0, 1.0] and rows[0]["run"] != rows[1]["run"]


@pytest.mark.parametrize("how", ["--no-results", "enabled=False"])
def test_disabled_writes_nothing_and_stops_recording(tmp_path, how):
    out = sys.stdout
    if how == "--no-results":
        rec = _results.Recorder("moe_layer", _args(tmp_path, "--no-results"), gpu="cpu")
    else:
        rec = _results.Recorder("moe_layer", _args(tmp_path), enabled=False)
    assert sys.stdout is out   # nothing replaced stdout
    rec.row("fwd_bwd", "fused", {"T": 1}, 1.0)
    assert rec.write() is None and list(tmp_path.iterdir()) == []


def test_recording_stops_at_write(tmp_path):
    out = sys.stdout
    rec = _results.Recorder("p2p_copy", _args(tmp_path), gpu="cpu", now=NOW)
    assert sys.stdout is not out
    rec.write()
    assert sys.stdout is out
    with pytest.raises(RuntimeError, match="already called"):
        rec.write()


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="topic="):
        _results.Recorder("Grouped GEMM", _args(tmp_path), capture=False)
    with pytest.raises(ValueError, match="machine="):
        _results.Recorder("scaling", _args(tmp_path), machine="H200!", capture=False)
    rec = _results.Recorder("scaling", _args(tmp_path), gpu="cpu", capture=False)
    with pytest.raises(TypeError, match="op="):
        rec.row("", "fused", {}, 1.0)
    with pytest.raises(TypeError, match="median="):
        rec.row("step", "fused", {}, "1.0")
    with pytest.raises(TypeError, match="p80="):
        rec.row("step", "fused", {}, 1.0, 0.5, True)


def test_printed_to_markdown_keeps_order_and_headings():
    text = "# Title\nline a\n\nline b\n| x |\n|---|\n| 1 |\nafter\n"
    assert _results.printed_to_markdown(text) == (
        "### Title\n\n```text\nline a\n\nline b\n```\n\n| x |\n|---|\n| 1 |\n\n```text\nafter\n```\n")


BENCH_SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py")
                       if not p.name.startswith("_") and 'if __name__ == "__main__"' in p.read_text())


def test_the_bench_scripts_are_found():
    assert {"dispatch.py", "grouped_gemm.py", "moe_layer.py", "scaling.py"} <= set(BENCH_SCRIPTS)


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_every_bench_script_takes_the_results_flags(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [f"bench/{script}", "--help"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    assert e.value.code == 0
    assert "--results-dir" in buf.getvalue() and "--no-results" in buf.getvalue(), buf.getvalue()[-2000:]
