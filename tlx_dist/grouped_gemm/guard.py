"""Device-side guard of grouped-GEMM offsets: clamp on the device, flag, check later.

Legend: N rows of the operand, E experts, ``offsets_E`` the caller's cumulative end rows.

Validating offsets on the host would sync, so on an accelerator every backend instead runs on the
*safe* offsets (``host.guard_offsets``, or the scheduler's prep kernel inside a kernel backend's
launch) ``safe_E = min(N, running max(max(0, offsets_E)))`` (int32): in range and
non-decreasing, equal to ``offsets_E`` when those are valid. No kernel can then touch a row outside
its operands, whatever the caller passes. What was wrong is ORed into a sticky per-device int32
flag (bits below), on the device; nothing reads it on the hot path.

    y = grouped_mm(x, w, offsets)          # never syncs; bad offsets -> defined result + flag
    ...
    check_offsets()                        # e.g. at a logging step: syncs, raises ValueError, resets

Where the flag is set, the results of the flagged calls are those of the safe offsets (experts with
negative or past-the-end ranges get those rows clamped away), which is rarely what the caller meant:
``check_offsets()`` turns it into an error. ``TLX_DIST_CHECK_OFFSETS=1`` instead validates each
call's offsets on the host before the launch (raises at once; syncs). On CPU that check always runs.
"""

from __future__ import annotations

import threading
from typing import Optional, Union

import torch

__all__ = ["OFFSETS_NEGATIVE", "OFFSETS_PAST_END", "OFFSETS_DECREASING", "offsets_flag", "check_offsets",
           "describe_flag"]

# Same values as tlx/common/scheduler.py (which cannot import torch-side code).
OFFSETS_NEGATIVE = 1
OFFSETS_PAST_END = 2
OFFSETS_DECREASING = 4
_WHAT = {OFFSETS_NEGATIVE: "an offset was negative", OFFSETS_PAST_END: "an offset exceeded the number of rows N",
         OFFSETS_DECREASING: "offsets decreased (must be non-decreasing)"}

_FLAGS: dict[torch.device, torch.Tensor] = {}
_LOCK = threading.Lock()


def _norm(device: Union[str, torch.device]) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def offsets_flag(device: Union[str, torch.device]) -> torch.Tensor:
    """The ``[1]`` int32 flag of ``device`` (allocated, zeroed, on first use). Non-zero bits say
    which offsets faults some grouped GEMM on this device has seen since the last reset. Touch it
    once before capturing a CUDA graph, so that the flag is not allocated inside the capture."""
    d = _norm(device)
    flag = _FLAGS.get(d)
    if flag is None:
        with _LOCK:
            flag = _FLAGS.get(d)
            if flag is None:
                flag = _FLAGS[d] = torch.zeros(1, dtype=torch.int32, device=d)
    return flag


def describe_flag(bits: int) -> str:
    return "; ".join(msg for bit, msg in _WHAT.items() if bits & bit) or "no fault"


def check_offsets(device: Optional[Union[str, torch.device]] = None, *, reset: bool = True) -> None:
    """Raises ValueError if any grouped GEMM since the last reset got out-of-range offsets (on
    ``device``, or on every device with a flag). Reads the flag: a host sync, so call it where one
    is cheap (a logging step). ``reset`` zeroes the flag after reading it."""
    devices = [_norm(device)] if device is not None else list(_FLAGS)
    faults = []
    for d in devices:
        flag = _FLAGS.get(d)
        if flag is None:
            continue
        bits = int(flag.item())
        if reset:
            flag.zero_()
        if bits:
            faults.append(f"{d}: {describe_flag(bits)} (flag={bits})")
    if faults:
        raise ValueError("grouped_mm got out-of-range offsets_E; the kernels ran on offsets clamped into "
                         "[0, N] and made non-decreasing. " + " | ".join(faults))
