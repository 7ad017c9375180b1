"""scripts/gpu_checks.py and its list scripts/gpu_checks.toml, on CPU (tier T0): the list parses and
covers every GPU test file, --list / --kind / --only choose what they say, bad lists and bad flags
are one error naming the check and field, and the runner itself (logs, timeouts, the per-GPU-node
launch, the summary) on stand-in commands that need no GPU."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_checks as gc  # noqa: E402

ONE, TWO = "nvidia-h200", "nvidia-h200-x2"


@pytest.fixture(scope="module")
def real():
    return gc.load()


def test_the_list_parses_and_says_what_each_check_checks(real):
    assert len(real.checks) >= 10 and real.kinds[ONE] == 1 and real.kinds["nvidia-h200-x8"] == 8
    for c in real.checks:
        assert c.checks and c.timeout > 0 and c.kinds
        for word in re.findall(r"scripts/[\w./-]+|tests/[\w./-]+|bench/[\w./-]+|configs/[\w./-]+", c.command):
            assert (ROOT / word).exists(), (c.name, word)   # every file a command names is in the tree
    assert real.env["NCCL_NVLS_ENABLE"] == "0" and real.env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def _pytest_files(command: str) -> tuple[set, set]:
    files = set(re.findall(r"(?<![=\w/])(tests/test_\w+\.py)", command))
    ignored = set(re.findall(r"--ignore=(tests/test_\w+\.py)", command))
    return files, ignored


def _marked(marker: str) -> set:
    pat = re.compile(rf"pytest\.mark\.{marker}\b")
    return {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if pat.search(p.read_text())}


@pytest.mark.parametrize("marker", ["gpu", "multigpu"])
def test_every_gpu_test_file_runs_in_a_check(real, marker):
    """The -m <marker> checks name files explicitly; one of them takes the rest by --ignore. Every
    file holding such a test lands in exactly one explicit list or in the rest, and the rest ignores
    exactly what the explicit ones run."""
    checks = [c for c in real.checks if re.search(rf"-m {marker}\b", c.command) and c.launch == "once"]
    explicit, rest = {}, []
    for c in checks:
        files, ignored = _pytest_files(c.command)
        if files:
            explicit[c.name] = files
        else:
            rest.append((c.name, ignored))
    assert len(rest) == 1, rest
    named = [f for fs in explicit.values() for f in fs]
    assert len(named) == len(set(named)), "a file runs in two checks"
    assert rest[0][1] == set(named)
    assert set(named) <= _marked(marker), set(named) - _marked(marker)   # each named file has such tests


def test_select_by_kind(real):
    one = {c.name for c in gc.select(real, ONE)}
    two = {c.name for c in gc.select(real, TWO)}
    assert {"gpu-gemm", "gpu-exchange", "gpu-rest", "memcheck-fused", "train-1gpu"} <= one
    assert not {"multigpu", "multigpu-per-gpu-node", "train-ep2"} & one
    assert one < two and {"multigpu", "multigpu-nvshmem", "multigpu-per-gpu-node", "train-ep2"} <= two
    assert not any(real.get(n).optional for n in two)
    with_opt = {c.name for c in gc.select(real, TWO, optional=True)}
    assert {"bench-dispatch", "bench-grouped-gemm"} <= with_opt - two


def test_select_only(real):
    assert [c.name for c in gc.select(real, None, ["train-1gpu", "gpu-gemm"])] == ["train-1gpu", "gpu-gemm"]
    assert [c.name for c in gc.select(real, ONE, ["bench-grouped-gemm"])] == ["bench-grouped-gemm"]  # optional ok
    with pytest.raises(ValueError, match="no check named 'nope'"):
        gc.select(real, ONE, ["nope"])
    with pytest.raises(ValueError, match="--only multigpu: not for --kind nvidia-h200"):
        gc.select(real, ONE, ["multigpu"])
    with pytest.raises(ValueError, match="--kind 'h100' is not a known kind"):
        gc.select(real, "h100")
    with pytest.raises(ValueError, match="give --kind"):
        gc.select(real, None)


def test_list_prints_every_check(real, capsys):
    assert gc.main(["--list"]) == 0
    out = capsys.readouterr().out
    for c in real.checks:
        assert f"| {c.name}" in out and c.checks in out
    assert "x2 = nvidia-h200-x2 (2 GPUs)" in out


def test_dry_run_fills_in_the_placeholders(capsys, tmp_path):
    assert gc.main(["--kind", TWO, "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "multigpu: torchrun --standalone --nproc-per-node=2 " in out
    assert f"metrics.out_dir='{tmp_path}/train-1gpu/run'" in out and "{" not in out
    assert "multigpu-per-gpu-node: python3 -m pytest -m multigpu" in out and "[per-gpu-node]" in out
    assert list(tmp_path.iterdir()) == []   # a dry run writes nothing


@pytest.mark.parametrize("argv, msg", [
    (["--kind", "nvidia-h100"], "--kind 'nvidia-h100' is not a known kind"),
    (["--only", "gpu-gemm,nope"], "no check named 'nope'"),
    ([], "give --kind"),
    (["--kind", ONE, "--out", "/tmp/a b"], "--out '/tmp/a b'"),
    (["--kind", ONE, "--gpus", "0"], "--gpus 0 must be positive"),
])
def test_bad_flags_are_one_error_line(argv, msg, capsys):
    assert gc.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and msg in err, err


GOOD = """
[kinds]
one = 1
two = 2
[[check]]
name = "a"
kinds = ["one", "two"]
command = "true"
timeout = 5
checks = "a passes"
"""


@pytest.mark.parametrize("edit, msg", [
    (lambda t: t.replace('name = "a"', 'name = "A b"'), "name='A b' must be lower-case"),
    (lambda t: t.replace('kinds = ["one", "two"]', 'kinds = ["three"]'), "kinds has 'three', not in [kinds]"),
    (lambda t: t.replace('timeout = 5', 'timeout = 0'), "timeout=0 must be a positive number"),
    (lambda t: t.replace('checks = "a passes"', ''), "missing field(s) ['checks']"),
    (lambda t: t + 'colour = "red"\n', "unknown field(s) ['colour']"),
    (lambda t: t + 'launch = "mpi"\n', "launch='mpi' must be one of once, per-gpu-node"),
    (lambda t: t + 'launch = "per-gpu-node"\n', "per-gpu-node' needs kinds of 2 or more GPUs"),
    (lambda t: t + 'optional = "yes"\n', "optional='yes' must be true or false"),
    (lambda t: t.replace('command = "true"', 'command = "echo {world}"'), "may use only {gpus}, {out} and {results}"),
    (lambda t: t + GOOD[GOOD.index("[[check]]"):], "name 'a' is used twice"),
    (lambda t: t.replace("one = 1", "one = 0"), "kinds.one=0 must be a positive GPU count"),
    (lambda t: t + "[extra]\n", "unknown table(s) ['extra']"),
    (lambda t: t + "x = = 1\n", "invalid TOML"),
])
def test_bad_lists_name_the_check_and_field(edit, msg):
    with pytest.raises(ValueError) as e:
        gc.parse(edit(GOOD), "list.toml")
    assert msg in str(e.value) and "list.toml" in str(e.value), str(e.value)


def test_the_runner_on_stand_in_commands(tmp_path, capsys):
    """Stand-ins for GPU commands: one passes, one fails, one outlives its timeout (killed with its
    children), one per-GPU-node launch that checks its rank environment, one heartbeat."""
    py = sys.executable
    lst = tmp_path / "checks.toml"
    lst.write_text(f"""
[kinds]
two = 2
[env]
FROM_LIST = "yes"
[[check]]
name = "ok"
kinds = ["two"]
command = "echo gpus={{gpus}} $FROM_LIST $OWN > {{out}}/made.txt; echo '3 passed in 0.1s'"
env = {{ OWN = "own" }}
timeout = 60
checks = "passes"
[[check]]
name = "bad"
kinds = ["two"]
command = "echo '1 failed, 2 passed in 0.2s'; exit 3"
timeout = 60
checks = "fails"
[[check]]
name = "slow"
kinds = ["two"]
command = "echo started; sleep 1.5; echo heartbeat-seen; sleep 60"
timeout = 3
checks = "times out"
[[check]]
name = "nodes"
kinds = ["two"]
launch = "per-gpu-node"
command = "{py} -c \\"import os; e = os.environ; assert e['LOCAL_WORLD_SIZE'] == '1' and e['WORLD_SIZE'] == '2' and e['RANK'] == e['LOCAL_RANK'] == e['GROUP_RANK']; print('rank', e['RANK'], 'port', e['MASTER_PORT'])\\""
timeout = 60
checks = "one node per GPU"
""")
    cl = gc.load(lst)
    rows = [gc.run_check(c, 2, tmp_path / "out", tmp_path / "out" / "results", cl.env, heartbeat_s=2.0)
            for c in cl.checks]
    by = {r["name"]: r for r in rows}
    assert (by["ok"]["status"], by["ok"]["rc"], by["ok"]["line"]) == ("pass", 0, "3 passed in 0.1s")
    assert (tmp_path / "out" / "ok" / "made.txt").read_text().strip() == "gpus=2 yes own"
    assert (by["bad"]["status"], by["bad"]["rc"], by["bad"]["line"]) == ("FAIL", 3, "1 failed, 2 passed in 0.2s")
    assert by["slow"]["status"] == "timeout" and by["slow"]["seconds"] < 30 and "killed after 3 s" in by["slow"]["line"]
    assert by["nodes"]["status"] == "pass"
    logs = [(tmp_path / "out" / "nodes" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert logs[0].startswith("rank 0 port ") and logs[1].startswith("rank 1 port ")
    assert logs[0].split()[-1] == logs[1].split()[-1]   # one rendezvous port for both
    out = capsys.readouterr().out
    assert "slow: running" in out and "== bad: FAIL (rc 3" in out
    table = gc.format_summary(rows)
    assert table.splitlines()[0] == "| check | result | rc | seconds | summary |" and "| slow | timeout |" in table


def test_main_writes_the_summary_and_fails_when_a_check_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gc, "preflight", lambda echo=print: 2)
    lst = tmp_path / "checks.toml"
    lst.write_text(GOOD + GOOD[GOOD.index("[[check]]"):].replace('"a"', '"b"').replace('"true"', '"false"'))
    out = tmp_path / "out"
    assert gc.main(["--file", str(lst), "--kind", "two", "--out", str(out)]) == 1
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["name"], r["status"]) for r in rows] == [("a", "pass"), ("b", "FAIL")]
    assert "| b | FAIL | 1 |" in (out / "summary.md").read_text()
    assert "1 of 2 checks passed; not: b" in capsys.readouterr().out
    assert gc.main(["--file", str(lst), "--only", "a", "--out", str(out)]) == 0
