"""The fused layer's view of an overlapped dispatch (CPU): the exchange's RowsOverlap is an
``ArrivalPlan`` (the protocol tlx_dist.fused declares), and the protocol names exactly what the
fused forward calls."""

from __future__ import annotations

import ast
import inspect
import types

import torch

from tlx_dist.comm.symm import RowsOverlap, SymmHandle
from tlx_dist.fused import arrival, backends
from tlx_dist.fused.arrival import ArrivalPlan


def _plan() -> RowsOverlap:
    """A RowsOverlap over a handle of W = 2 ranks, T_max = 4, e = 2 local experts (no memory behind it)."""
    L = types.SimpleNamespace(max_tokens=4, recv_rows=8)
    bufs = types.SimpleNamespace(layout=L, rank=1, device=torch.device("cpu"))
    z = torch.zeros(2, dtype=torch.int64)
    h = SymmHandle(num_tokens=3, top_k=2, num_recv_rows=8, offsets_e=torch.zeros(2, dtype=torch.int32),
                   recv_counts_e=z, tokens_per_expert_E=torch.zeros(4, dtype=torch.int64), order_S=None,
                   inverse_S=None, send_row_TW=torch.zeros(3, 2, dtype=torch.int32), rows_to_W=z, rows_from_W=z,
                   pos_RK=torch.zeros(8, 2, dtype=torch.int32), gate_RK=torch.zeros(8, 2), tok_R=torch.zeros(8),
                   src_map_N=torch.zeros(8, dtype=torch.int32), gate_TK=torch.zeros(3, 2), buffers=bufs)
    return RowsOverlap(h, 0, torch.zeros(6, dtype=torch.int32), side_sms=32, side_done=None)


def test_rows_overlap_is_an_arrival_plan():
    plan = _plan()
    assert isinstance(plan, ArrivalPlan)
    assert plan.own_rows == (4, 8) and plan.side_sms == 32 and plan.offsets_V.shape == (6,)
    assert not isinstance(object(), ArrivalPlan)


def test_the_protocol_is_what_the_fused_forward_calls():
    """Every attribute the fused code reads of a plan (``ov.X`` / ``overlap.X``) is a member of the
    protocol, and the protocol declares nothing the fused code does not use."""
    members = {n for n in vars(ArrivalPlan) if not n.startswith("_")} | set(ArrivalPlan.__annotations__)
    used = set()
    from tlx_dist.fused import api
    for mod in (backends, api):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("ov",
                                                                                                        "overlap"):
                used.add(node.attr)
    assert used <= members, f"the fused code calls {sorted(used - members)} outside the protocol"
    assert members == used, sorted(members - used)
    assert "tlx_dist.comm" not in inspect.getsource(arrival).split('"""', 2)[2]  # no import of the exchange
