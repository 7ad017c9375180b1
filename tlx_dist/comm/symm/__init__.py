"""Expert-parallel dispatch/combine over symmetric memory: deduplicated token rows, peer stores,
device-side signals and bounded waits.

Legend: T tokens on this rank, D hidden, K top-k, E experts, W ranks, e = E/W, R = W * T_max
receive rows, N expanded (expert-major) rows of this rank.

    x_exp_ND, handle = dispatcher.dispatch(x_TD, idx_TK, gate_TK)
    y_exp_ND         = experts(x_exp_ND, handle.offsets_e)          # grouped GEMMs
    out_TD           = dispatcher.combine_weighted(y_exp_ND, handle, gate_TK)

**Dispatch.** A token row crosses to a destination rank once, however many of that rank's experts
it picked: row ``send_row_TW[t, d]`` of the source's block ``[s*T_max, (s+1)*T_max)`` of rank d's
receive buffer, with metadata (the expanded row of each k-slot that lives on d, the K gates, the
token id). The receiver expands the rows into the expert-major layout of :mod:`layout` (the same
rows, in the same order, as :class:`AllToAllDispatcher` and :class:`LocalDispatcher` produce).
**Combine.** The owning rank sums, per received token, ``gate * y`` over its own slots (products in
the activation dtype, as the per-token reference does, accumulated in fp32, rounded once) and sends
one row back per (token, rank); the source adds the partial sums of the ranks it sent t to (fp32,
one rounding). Backward mirrors both: combine's backward dispatches ``dout`` rows once per rank and
returns gate-scaled expert-row gradients plus the gate gradients ``<dout[t], y[t, k]>`` (computed
where ``y`` lives, sent back per slot); dispatch's backward is an ungated combine.

**Expanded rows** (``capacity``): ``"exact"`` reads this rank's row count on the host once per
dispatch (one sync, as the all-to-all path does) and allocates exactly; ``"worst"`` allocates the
worst case ``W*T_max*min(K, E/W)``; a float f allocates ``ceil(f*T_max*K)`` rows (f = 1 is a
perfectly balanced load) and a positive int that many rows -- static shapes, no host sync, CUDA-graph
capturable; rows past it are not computed, raise the device overflow flag and :meth:`check` raises.

No other host sync and no data-dependent shape: counts travel through the symmetric COUNTS region,
the layout is computed on the GPU, and signals use device-side epochs and counters, so a captured
CUDA graph replays correctly. Each op is a sequence of *phases* (Python generators that yield
between kernel launches, ``tlx/comm/exchange.py`` lists them): a real rank runs its generator
straight through; the emulated world (``emulated.py``) advances W ranks' generators in lockstep.

Files: ``api.py`` (SymmDispatcher, ep_buffers, autograd), ``config.py`` (ExchangeConfig, Tile),
``handle.py`` (SymmHandle, capacity), ``steps.py`` (the ops as phase generators), ``launch.py`` (one
wrapper per phase kernel), ``overlap.py`` (RowsOverlap), ``policy.py`` (which form each op takes),
``tuning.py`` (launch shapes), ``ce_transport.py`` (the copy-engine row form), ``buffers.py``
(SymmBuffers, the layout), ``hier.py`` / ``hier_layout.py`` (the hierarchical exchange across nodes:
a row once per destination node, forwarded inside it by a relay; docs/exchange.md).
"""

from .api import SymmDispatcher, ep_buffers
from .buffers import DEFAULT_TIMEOUT_S, ExchangeError, SymmBuffers, SymmLayout
from .config import ExchangeConfig, Tile
from .handle import Capacity, SymmHandle, check_capacity, expanded_rows
from .hier import HierHandle, HierRoute
from .hier_layout import LEG_COUNTERS, leg_counters_dict
from .overlap import RowsOverlap
from .steps import (combine_grad_steps, combine_rows_grad_steps, combine_rows_steps, combine_steps,
                    dispatch_grad_steps, dispatch_rows_grad_steps, dispatch_steps, run_steps)

__all__ = ["SymmDispatcher", "SymmHandle", "ExchangeConfig", "Tile", "RowsOverlap", "SymmBuffers", "SymmLayout",
           "ExchangeError",
           "DEFAULT_TIMEOUT_S", "ep_buffers", "expanded_rows", "check_capacity", "Capacity", "dispatch_steps",
           "combine_steps", "dispatch_grad_steps", "combine_grad_steps", "combine_rows_steps",
           "combine_rows_grad_steps", "dispatch_rows_grad_steps", "run_steps", "HierHandle", "HierRoute",
           "LEG_COUNTERS", "leg_counters_dict"]
