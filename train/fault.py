"""Bounded failure: a rank that dies or hangs makes every other rank exit with a clear error.

A dead peer (process killed, node lost) usually breaks its sockets and the others' next collective
fails at once. A *hung* peer (a stuck kernel, a stopped process, a deadlock) keeps its sockets
open: without a timeout every other rank would wait in its next collective for the backend's
default (30 min for gloo, 10 for NCCL) or forever. ``train.comm_timeout_s`` bounds that wait on
every process group the loop uses: the default group (``init_process_group(timeout=...)``) and,
explicitly, the DeviceMesh's dp / ep / world groups (torch 2.13's mesh subgroups inherit the default
group's timeout; setting it does not rely on that). NCCL's watchdog then aborts the communicator
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default); gloo raises in the waiting call. The loop
catches the error and prints one line saying what most likely happened before exiting non-zero.
Set the timeout above the longest legitimate wait between ranks (first-step kernel compilation,
a checkpoint save), which is why the default is generous.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["set_comm_timeouts", "failure_message"]


def set_comm_timeouts(groups, timeout_s: float) -> None:
    """Applies ``timeout_s`` to each process group in ``groups`` (duplicates and ``None`` skipped)."""
    seen = set()
    for g in groups:
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        # Private but stable (torchtitan uses it the same way).
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), g)


def failure_message(err: BaseException, rank: int, timeout_s: float) -> str:
    """The line a rank prints when training stops on an error."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    comm = isinstance(err, dist.DistError) or any(
        s in str(err) for s in ("gloo", "NCCL", "Connection", "Timed out", "timed out", "peer"))
    hint = (f" A collective failed or waited longer than train.comm_timeout_s={timeout_s:g} s: another rank "
            f"most likely died or hangs (see its log).") if comm else ""
    return f"rank {rank}: training stopped: {type(err).__name__}: {first[:300]}.{hint}"
