"""Failure of a rank (tier T1, gloo on CPU): two training processes, one of them killed or frozen
mid-run; the other must exit non-zero with a clear error within a bounded time, never hang.

The ranks are started as two plain processes (RANK / WORLD_SIZE / MASTER_* set by hand), not by
torchrun: torchrun's agent would kill the survivor itself, which would hide whether the training
loop bounds its own waits (across nodes, each node's agent only sees its own workers).
* SIGKILL: the dead peer's sockets close; the survivor's next collective fails at once.
* SIGSTOP: the frozen peer keeps its sockets open (a hung rank); only ``train.comm_timeout_s``
  ends the survivor's wait. The bound asserted is that timeout plus 45 s of slack for a loaded CI
  machine (the failure path itself takes well under a second beyond the timeout).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from _train import ROOT, TINY, _env, free_port, pretrain_cmd

TIMEOUT_S = 10


def _launch(tmp_path):
    port = free_port()
    ov = TINY + ["train.steps=100000", "data.batch_size=4", "parallel.ep=2", "train.log_every=1",
                 f"train.comm_timeout_s={TIMEOUT_S}"]
    procs = []
    for r in range(2):
        env = _env(1)
        env.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        out = subprocess.PIPE if r == 0 else open(tmp_path / f"rank{r}.log", "w")
        procs.append(subprocess.Popen(pretrain_cmd(ov, None), cwd=ROOT, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, id="killed"),
                                 pytest.param(signal.SIGSTOP, id="frozen")])
def test_survivor_exits_with_clear_error_in_bounded_time(tmp_path, sig):
    procs = _launch(tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(procs[0].stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 240
        while not any(re.search(r"step +3/", ln) for ln in list(lines)):  # training is under way
            assert procs[0].poll() is None and procs[1].poll() is None, "".join(lines)[-3000:]
            assert time.time() < deadline, "training did not reach step 3:\n" + "".join(lines)[-3000:]
            time.sleep(0.05)
        t0 = time.time()
        os.kill(procs[1].pid, sig)  # mid-step: the ranks run steps back to back
        try:
            rc = procs[0].wait(timeout=TIMEOUT_S + 45)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running {TIMEOUT_S + 45} s after rank 1 got {sig.name}: a hang")
        elapsed = time.time() - t0
        reader.join(timeout=10)
        out = "".join(lines)
        assert rc != 0, f"rank 0 exited 0 after its peer got {sig.name}:\n{out[-3000:]}"
        assert "rank 0: training stopped" in out and "another rank most likely died or hangs" in out, out[-3000:]
        if sig == signal.SIGSTOP:
            assert f"comm_timeout_s={TIMEOUT_S} s" in out
            assert elapsed >= TIMEOUT_S * 0.9, f"exited after {elapsed:.1f} s, before the timeout: not a timeout?"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped process
            p.wait()


def test_comm_timeout_must_be_positive():
    from _train import DEBUG
    from train.config import load_config

    assert load_config(DEBUG).train.comm_timeout_s == 600.0
    with pytest.raises(ValueError, match=r"train.comm_timeout_s=0.0 must be positive"):
        load_config(DEBUG, ["train.comm_timeout_s=0"])
