"""FP8 dispatch over the symmetric exchange on CPU: the real tlx/comm kernels under TRITON_INTERPRET=1
in an emulated world, on the peer-pointer route and the emulated NVSHMEM route (ranks_per_node);
the check and its oracle: tests/fp8_dispatch_cases.py. Run through tests/test_symm_interpreted.py."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from fp8_dispatch_cases import CASES, check_fp8_dispatch_world  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run through tests/test_symm_interpreted.py (needs TRITON_INTERPRET=1)")


@pytest.mark.parametrize("W,rpn,E,K,Ts,D,routing,why", CASES, ids=[c[-1] for c in CASES])
def test_fp8_dispatch_equals_bf16_dispatch_then_quantize(W, rpn, E, K, Ts, D, routing, why):
    check_fp8_dispatch_world(W, rpn, E, K, Ts, D, routing, why)


def test_fp8_dispatch_over_the_hierarchical_exchange():
    # nodes of 2: each token crosses to a node once, relays forward it inside the node
    from tlx_dist.comm.symm import ExchangeConfig

    check_fp8_dispatch_world(4, 2, 8, 2, [6, 3, 0, 5], 256, "random", "hierarchical, 2 nodes x 2",
                             config=ExchangeConfig(topology="hierarchical"))
