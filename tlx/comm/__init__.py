"""Device code for symmetric-memory token dispatch and combine (``@triton.jit`` only).

``exchange``: the phase kernels every rank runs for one deduplicated exchange (barrier -> send
token rows once per rank -> expand to expert-major rows; reduce per token -> send partial sums
home), with bounded waits; ``protocol`` their shared waits and signals, ``route`` a dispatch's
first phase, ``copy_engine`` the ready / signal / fix-up kernels of the copy-engine row form
(whose copies the host issues). ``nvshmem``: the NVSHMEM device calls of their ``USE_NVSHMEM`` variants
(peers on other nodes), emulated under the interpreter. ``hier``: the hierarchical exchange's kernels
(one row per (token, node) to a relay, which forwards it inside its node; node-first combine). Host wrappers, buffer allocation and
autograd live in ``tlx_dist.comm.symm``.
"""

from .exchange import (  # noqa: F401
    _ce_fixup_kernel,
    _ce_ready_kernel,
    _ce_signal_kernel,
    _expand_kernel,
    _gate_grad_recv_kernel,
    _landed_rows_copy_kernel,
    _phase_offsets_kernel,
    _reduce_recv_kernel,
    _reduce_send_kernel,
    _route_kernel,
    _rows_wait_kernel,
    _send_tokens_kernel,
)
