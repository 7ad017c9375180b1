"""Run a function on W gloo ranks in separate processes (CPU, tier T1)."""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, out_dir: str, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rc = 0
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        rc = 1
    finally:
        dist.destroy_process_group()
    # End the worker without interpreter finalization, as train.pretrain does (issue 16): gloo's
    # worker threads can still be releasing the last collective's tensors, and taking the GIL
    # during finalization aborts the process ("terminate called without an active exception").
    from train.pretrain import exit_process
    exit_process(rc)


# Imported once by the fork server, so that its children start in a fraction of a second instead of
# importing torch and the library again (several seconds a process on a loaded 2-core machine).
FORKSERVER_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "tlx_dist", "train.pretrain"]


def run_world(fn, world: int, *args, start_method: str = "spawn"):
    """Runs ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the list of their results.
    ``fn`` must be a module-level function (it is pickled by name).

    ``start_method="forkserver"``: the ranks are forked from one server process that imported
    ``FORKSERVER_PRELOAD`` when the first such world started (it never ran an op, so forking it is
    safe); the children see the environment of that moment, so pass anything that varies as
    ``args``."""
    if start_method == "forkserver":
        import multiprocessing
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.start_processes(_entry, args=(world, init_file, tmp, fn, args), nprocs=world, join=True,
                               start_method=start_method)
        except Exception as err:
            msgs = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
            raise AssertionError("a rank failed:\n" + "\n".join(msgs)) from err
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
