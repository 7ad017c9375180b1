"""The FP8 dispatch check of an emulated world, shared by the interpreter cases
(tests/symm_fp8_interpreted_cases.py, CPU) and the GPU tests (tests/test_moe_fp8_gpu.py: the real
kernels, W virtual ranks on one GPU). Not collected (no test_ prefix).

The token rows leave quantized and packed (tlx_dist/fp8/dispatch.py: e4m3 values + fp32 scales in
one row of bf16-typed bytes, about half the bf16 row) through a buffer set of the packed width; the
receiver unpacks them. Oracle: the bf16 exchange of the same rows, quantized after it arrives --
payloads must be equal bit for bit (quantization is per row; the exchange moves bits). The combine
and the dispatch's backward run on the bf16 buffer set with the packed dispatch's handle and must
equal those of the bf16 dispatch's handle bit for bit (the same layout, the same kernels)."""

from __future__ import annotations

import dataclasses

import torch

from symm_interpreted_cases import _kind_routing
from tlx_dist.comm.emulated import EmulatedWorld, reference_dispatch
from tlx_dist.fp8.dispatch import pack_rows, packed_width, unpack_rows
from tlx_dist.fp8.quant import quantize_rows
from tlx_dist.testing import assert_close_ksum_bf16


def _on(world, rpn):
    """The emulated NVSHMEM route serves one world's heaps at a time (tlx/comm/nvshmem.py): register
    the world whose op runs next (a real PE's heap holds both buffer sets)."""
    if rpn is not None:
        from tlx.comm.nvshmem import emulate_heaps

        b0 = world.buffers[0]
        n = b0.layout.nbytes
        emulate_heaps([(b0._world_mem.data_ptr() + v * n, n) for v in range(world.world_size)])
    return world


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# (W, ranks_per_node, E, K, Ts, D, routing, why)
CASES = [
    (2, None, 4, 2, [12, 9], 256, "random", "peer pointers, two ranks of unequal T"),
    (4, 2, 8, 2, [6, 0, 5, 7], 200, "heavy_imbalance",
     "the emulated NVSHMEM route (2 nodes x 2), a rank with no tokens, D not a multiple of 128, all slots to rank 0"),
    (4, None, 8, 3, [5, 8, 3, 6], 128, "zero_token_experts", "zero-token experts, K = 3"),
]


def check_fp8_dispatch_world(W, rpn, E, K, Ts, D, routing, why, device="cpu", config=None):
    """The FP8 dispatch of an emulated world (``config``: its ExchangeConfig) vs its bf16 dispatch +
    quantize-after (module docstring)."""
    dt = torch.bfloat16
    P = packed_width(D, dt)
    assert P * 2 < 0.6 * D * 2, "the packed row must be about half the bf16 row"
    T_max = max(Ts)
    bf = EmulatedWorld(W, T_max, D, K, E, dt, device=device, ranks_per_node=rpn, config=config)
    q8 = EmulatedWorld(W, T_max, P, K, E, dt, device=device, ranks_per_node=rpn, config=config)
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(T, D, generator=g) * (1 + 100 * torch.rand(T, 1, generator=g))).to(dt).to(device) for T in Ts]
    for x in xs:
        if x.shape[0]:
            x[0, : min(D, 128)] = 0.0  # an all-zero tile
            x[-1, 3] = 1e4  # an outlier
    idxs = [_kind_routing(20 + s, T, K, E, W, routing) if T else torch.zeros(0, K, dtype=torch.long)
            for s, T in enumerate(Ts)]
    idxs = [i.to(device) for i in idxs]
    gates = [torch.rand(T, K, generator=g).to(dt).to(device) for T in Ts]

    ref = _on(bf, rpn).dispatch(xs, idxs, gates)
    packed = [pack_rows(quantize_rows(x), dt) for x in xs]
    got = _on(q8, rpn).dispatch(packed, idxs, gates)
    handles = []
    for d, ((x_exp, h_bf), (p_exp, h_q)) in enumerate(zip(ref, got)):
        assert torch.equal(h_q.offsets_e, h_bf.offsets_e), f"rank {d}: the layouts differ"
        n = int(h_bf.offsets_e[-1]) if h_bf.offsets_e.numel() else 0
        want = quantize_rows(x_exp[:n])
        rows = unpack_rows(p_exp[:n], D)
        assert torch.equal(_bits(rows.q_MC), _bits(want.q_MC)), f"rank {d}: e4m3 payload differs ({why})"
        assert torch.equal(rows.s_MCb, want.s_MCb), f"rank {d}: scales differ ({why})"
        handles.append(dataclasses.replace(h_q, buffers=bf.buffers[d]))

    # combine (bf16 rows, fp32 k-sum) and the dispatch's backward, on the bf16 set with either handle
    ys = [torch.randn(x_exp.shape, generator=g).to(dt).to(device) for x_exp, _ in ref]
    out_ref = _on(bf, rpn).combine(ys, [h for _, h in ref])
    out = bf.combine(ys, handles)
    gs = [torch.randn(x_exp.shape, generator=g).to(dt).to(device) for x_exp, _ in ref]
    dx_ref = bf.combine_grad(gs, [h for _, h in ref])
    dx = bf.combine_grad(gs, handles)
    for d in range(W):
        if device == "cpu":  # the interpreter runs the programs in order: the same sums, bit for bit
            assert torch.equal(out[d], out_ref[d]), f"rank {d}: combine differs"
            assert torch.equal(dx[d], dx_ref[d]), f"rank {d}: the dispatch's backward differs"
        else:  # a GPU may order the fp32 k-sums differently between two launches: one bf16 ulp
            assert_close_ksum_bf16(out_ref[d], out[d])
            assert_close_ksum_bf16(dx_ref[d], dx[d])
    # packed bytes are not numbers: any bit pattern, bf16 NaN payloads included, must arrive as sent
    raw = [torch.randint(0, 256, (T, 2 * P), generator=g, dtype=torch.uint8).view(dt).to(device) for T in Ts]
    moved = _on(q8, rpn).dispatch(raw, idxs, gates)
    for d, ((got_rows, _), (want_rows, _)) in enumerate(zip(moved, reference_dispatch(raw, idxs, E))):
        n = want_rows.shape[0]
        assert torch.equal(got_rows[:n].view(torch.uint8), want_rows.view(torch.uint8)), f"rank {d}: bytes changed"
    bf.check()
    q8.check()
    bf.close()
    q8.close()
