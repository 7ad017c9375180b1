"""Tier T0 for the training CLI as a user meets it: one-line errors with exit status 2, the help
text, the ETA, the metrics log of a resumed run, resume mismatches, and the plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _train import one_rank_group
from train.config import UsageError, load_config
from train.metrics import MetricLogger, eta_seconds
from train.pretrain import main, plot_run, train

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ROOT / "configs" / "debug_cpu.toml"
TINY = ["model.dim=32", "model.n_heads=2", "model.dense_inter_dim=64", "model.moe.moe_inter_dim=32",
        "model.moe.num_experts=4", "data.seq_len=16", "data.batch_size=2", "metrics.progress=false",
        "metrics.tensorboard=false", "train.log_every=3"]


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m train.pretrain")


def _bad_toml(tmp):
    p = tmp / "bad.toml"
    p.write_text("[model]\ndim = 64\nn_layers = = 2\n")
    return [str(p)], [], str(p)


@pytest.mark.parametrize("case", ["missing file", "bad toml", "no equals", "bad value", "unknown key",
                                  "empty key", "bad choice"])
def test_config_errors_print_one_line_and_exit_2(case, tmp_path, capsys):
    """Each user error: exit status 2, exactly one line on stderr starting 'error:' that names the
    file or field, nothing on stdout, no traceback."""
    config, overrides, expect = {
        "missing file": ([str(tmp_path / "nope.toml")], [], f"config file {tmp_path / 'nope.toml'} does not exist"),
        "bad toml": _bad_toml(tmp_path),
        "no equals": ([str(DEBUG)], ["train.steps"], "--override 'train.steps' must look like key.path=value"),
        "bad value": ([str(DEBUG)], ["train.steps=-3"], "train.steps=-3 must be positive"),
        "unknown key": ([str(DEBUG)], ["train.stpes=3"], "train: unknown field(s) ['stpes']"),
        "empty key": ([str(DEBUG)], ["train..steps=3"], "empty key"),
        "bad choice": ([str(DEBUG)], ["train.activation_checkpoint=attn"],
                       "train.activation_checkpoint='attn' must be one of 'none', 'moe', 'full'"),
    }[case]
    argv = ["--config", *config] + [a for o in overrides for a in ("--override", o)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and expect in err, err
    assert "Traceback" not in err
    if case == "bad toml":
        assert "invalid TOML" in err


def test_usage_error_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        load_config(DEBUG, ["model.n_heads=5"])
    p = tmp_path / "bad.toml"
    p.write_text("x = [")
    with pytest.raises(UsageError, match="bad.toml: invalid TOML"):
        load_config(p)


def test_eta_uses_the_measured_step_time(capsys):
    """At step 10 of 100 with 0.5 s per step: 90 steps * 0.5 s = 45 s left, not the first
    interval's whole time divided by one step (which made the first ETA 10x too long)."""
    assert eta_seconds(0.5, 10, 100) == 45.0 and eta_seconds(0.5, 100, 100) == 0.0
    cfg = load_config(DEBUG, ["metrics.out_dir=''"])
    log = MetricLogger(cfg, 0, 100)
    rec = {"loss": 3.0, "aux_loss": 0.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s_per_gpu": 1.0, "mfu": None,
           "peak_mem_gib": 0.1, "peak_mem_kind": "rss", "load_imbalance": 1.0, "step_time_s": 60.0}
    log.log(1, rec)          # step 1 includes start-up (compilation): no ETA from it
    assert "eta ?:??:??" in capsys.readouterr().out
    log.log(10, {**rec, "step_time_s": 0.5})
    assert "eta 0:00:45" in capsys.readouterr().out


def test_resumed_log_keeps_each_step_once(tmp_path):
    """A job logged steps 3, 6, 9 and died after its checkpoint at step 6: the resumed run keeps
    3 and 6 and logs 9 again, once."""
    cfg = load_config(DEBUG, [f"metrics.out_dir='{tmp_path}'", "metrics.tensorboard=false"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (3, 6, 9)))
    log = MetricLogger(cfg, 0, 12, resume_step=6)
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [3, 6]
    log.jsonl.write(json.dumps({"step": 9}) + "\n")
    log.close()
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [3, 6, 9]
    MetricLogger(cfg, 0, 12).close()                  # a fresh run starts a new log
    assert path.read_text() == ""


@pytest.fixture
def one_rank():
    with one_rank_group():
        yield torch.device("cpu")


def test_resume_mismatch_and_resume_at_end(one_rank, tmp_path, capsys):
    """One run that checkpoints at step 4 of 6 (logs 1, 3, 6); then (a) a resume with another
    expert count is one clear UsageError naming the tensor and both shapes; (b) a resume at
    train.steps = 4 says there is nothing to train; (c) a resume to step 9 re-logs step 6 once
    and its steps 5-6 repeat the first run's losses exactly."""
    ck = [f"checkpoint.dir='{tmp_path / 'ck'}'", "checkpoint.every=4", f"metrics.out_dir='{tmp_path / 'run'}'"]
    first = train(load_config(DEBUG, TINY + ck + ["train.steps=6"]), one_rank)
    assert len(first) == 6
    with pytest.raises(UsageError) as e:
        train(load_config(DEBUG, TINY + ck + ["train.steps=6", "model.moe.num_experts=2"]), one_rank)
    msg = str(e.value)
    # Experts are saved per global id (resumable at any EP degree), so the router is the tensor
    # whose shape names the expert count.
    assert "\n" not in msg and "step_4" in msg and "ffn.router.weight is [4, 32] in the checkpoint but [2, 32]" in msg
    capsys.readouterr()
    assert train(load_config(DEBUG, TINY + ck + ["train.steps=4"]), one_rank) == []
    assert "at or past train.steps=4: nothing to train" in capsys.readouterr().out
    resumed = train(load_config(DEBUG, TINY + ck + ["train.steps=9"]), one_rank)
    assert resumed[:2] == first[4:6]
    steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 3, 6, 9]


def _records(mfu):
    return [{"step": s, "loss": 5.0 / s, "aux_loss": 1e-3, "tokens_per_s_per_gpu": 1000.0 + s,
             "mfu": mfu, "load_imbalance": 1.5, "tokens_per_expert": [[5, 3, 0, 8], [4, 4, 4, 4]],
             "moe_layers": [1, 3]} for s in (1, 10, 20)]


@pytest.mark.parametrize("mfu, names", [
    (None, {"loss.png", "tokens_per_s.png", "expert_load.png"}),               # CPU: MFU unknown
    (0.3, {"loss.png", "tokens_per_s.png", "mfu.png", "expert_load.png"}),    # GPU: both
])
def test_plot_files_are_named_for_what_they_show(tmp_path, mfu, names):
    pytest.importorskip("matplotlib")
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _records(mfu)))
    assert plot_run(str(tmp_path)) == 0
    assert {q.name for q in tmp_path.glob("*.png")} == names


def test_expert_load_rows_are_model_layers(tmp_path, monkeypatch):
    """The heat map's rows are labelled with the MoE layers' model indices at integer ticks."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    seen = {}
    real_close = plt.close

    def spy(fig):
        for ax in fig.axes:
            if ax.get_ylabel() == "model layer (MoE)":
                seen["ticks"] = list(ax.get_yticks())
                seen["labels"] = [t.get_text() for t in ax.get_yticklabels()]
        real_close(fig)
    monkeypatch.setattr(plt, "close", spy)
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _records(None)))
    from train.plot import plot
    plot(p, tmp_path)
    assert seen == {"ticks": [0, 1], "labels": ["1", "3"]}


def test_plot_failures_are_reported_truthfully(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    assert plot_run(str(tmp_path)) == 1                      # no metrics.jsonl: the real cause
    err = capsys.readouterr().err
    assert "plotting" in err and "FileNotFoundError" in err and "matplotlib" not in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import fails as if not installed
    assert plot_run(str(tmp_path)) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["missing", "folder", "no fields"])
def test_plot_cli_errors_are_one_line_naming_the_path(tmp_path, capsys, what):
    """``python -m train.plot`` on a bad path: one ``error:`` line naming it, no traceback."""
    from train.plot import main as plot_main
    path = {"missing": tmp_path / "nope.jsonl", "folder": tmp_path, "no fields": tmp_path / "m.jsonl"}[what]
    if what == "no fields":
        pytest.importorskip("matplotlib")
        path.write_text(json.dumps({"step": 1}) + "\n")
    assert plot_main([str(path)]) == (1 if what == "no fields" else 2)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and str(path) in err, err
    assert {"missing": "does not exist", "folder": "is not a file", "no fields": "KeyError"}[what] in err


@pytest.mark.parametrize("after_s", [0.5, 2.0])
def test_ctrl_c_during_start_up_is_one_line_and_status_130(after_s):
    """SIGINT while torch imports (0.5 s) or while the run starts (2 s; later on a slow machine):
    stderr is the one line 'interrupted', the status 130, whatever the phase it lands in."""
    import os
    import signal
    import subprocess
    import time
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "train.pretrain", "--config", str(DEBUG), "--override",
                          "train.steps=100000", "--override", "metrics.out_dir=''"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where it is stuck: every thread's stack (faulthandler, SIGUSR1)
        p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"no exit 60 s after Ctrl-C; stdout tail {out[-500:]!r}; stderr {err[-6000:]}")
    assert p.returncode == 130 and err == "interrupted\n", (p.returncode, err[-3000:])


_HUNG_UNWIND = """
import signal, sys, time
import train.pretrain as P
P.INTERRUPT_GRACE_S = float(sys.argv[1])
signal.signal(signal.SIGINT, P._on_sigint)
print("ready", flush=True)
while True:  # an unwinding that never ends: every KeyboardInterrupt swallowed
    try:
        time.sleep(30)
    except KeyboardInterrupt:
        pass
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_ends_a_hung_shutdown(presses):
    """A shutdown stuck after Ctrl-C (here: a loop that swallows KeyboardInterrupt) still ends with the
    one line and status 130: after the grace period, or at once on a second Ctrl-C."""
    import os
    import signal
    import subprocess
    import time
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    grace = 1.0 if presses == 1 else 120.0
    p = subprocess.Popen([sys.executable, "-c", _HUNG_UNWIND, str(grace)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    for _ in range(presses):
        p.send_signal(signal.SIGINT)
        time.sleep(0.3)
    try:
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    took = time.monotonic() - t0
    assert p.returncode == 130 and err == "interrupted\n", (p.returncode, err[-3000:])
    assert (took >= grace) if presses == 1 else (took < 30), took


def test_sigusr1_prints_every_thread_stack_and_the_run_goes_on():
    """``kill -USR1`` on a running job: the Python stacks on stderr, and training continues
    (a later Ctrl-C still ends it with status 130)."""
    import os
    import signal
    import subprocess
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "train.pretrain", "--config", str(DEBUG), "--override",
                          "train.steps=100000", "--override", "train.log_every=1", "--override",
                          "metrics.out_dir=''"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not p.stdout.readline().startswith("step "):
            assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGUSR1)
        for _ in range(3):  # three more steps after the dump
            assert p.stdout.readline().startswith("step ")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, (p.returncode, err[-3000:])
    assert "most recent call first" in err and "train/pretrain.py" in err and err.endswith("interrupted\n"), err[-3000:]
