"""Device code for symmetric-memory token dispatch and combine (``@triton.jit`` only).

``primitives``: peer addressing from a device-side peer table, arrival signals (release adds,
acquire polls), NVSHMEM extern declarations for peers outside the node.
``dispatch``: the phase kernels every rank runs for one exchange (signal -> wait -> send -> receive).
Host wrappers, buffer allocation and autograd live in ``tlx_dist.comm.symm``.
"""

from .dispatch import (  # noqa: F401
    _barrier_signal_kernel,
    _barrier_wait_kernel,
    _combine_recv_kernel,
    _combine_send_kernel,
    _dispatch_recv_kernel,
    _dispatch_send_kernel,
)
