"""Tier T0 for the per-category step profile (train/profiling.py): the categoriser on synthetic
kernel / op names as torch.profiler reports them on an H200 and on CPU, and the summary of a
real CPU profile of a few training steps of a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.profiling import CATEGORIES, annotate_dispatchers, categorize, format_profile, step_profile

STEP = "ProfilerStep#4"
BWD = "autograd::engine::evaluate_function: {}"


@pytest.mark.parametrize("name, stack, want", [
    # Expert GEMMs: the TLX kernel under the custom op, torch's grouped GEMM and its CUTLASS kernel,
    # the weight-gradient op in the backward.
    ("_grouped_gemm_hopper_kernel", ["tlx_dist::grouped_mm", STEP], "expert GEMMs"),
    # torch._grouped_mm's CUTLASS kernel says "Gemm" but not "grouped": the op decides.
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
     "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>>>>",
     ["aten::_grouped_mm", "tlx_dist::grouped_mm", STEP], "expert GEMMs"),
    ("_grouped_gemm_hopper_kernel", ["tlx_dist::grouped_mm_wgrad", BWD.format("GroupedMmBackward"), STEP],
     "expert GEMMs"),
    # Exchange: ops inside the dispatch scope (a plain gather must not count as elementwise there),
    # the permutation's backward node, NCCL all-to-all (not "communication"), symm kernels.
    ("void at::native::indexSelectLargeIndex<float>", ["aten::index_select", "moe.dispatch", STEP], "exchange"),
    ("void at::native::indexSelectLargeIndex<float>", ["aten::index_select", BWD.format("_PermuteRowsBackward"), STEP],
     "exchange"),
    ("ncclDevKernel_SendRecv(ncclDevComm*)", ["nccl:all_to_all", "c10d::alltoall_base_", "moe.combine", STEP], "exchange"),
    ("ncclDevKernel_SendRecv(ncclDevComm*)", ["nccl:all_to_all", "c10d::alltoall_base_",
                                              BWD.format("_AllToAllRowsBackward"), STEP], "exchange"),
    # The dispatcher's count all-gather is part of the exchange when inside its scope.
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", ["nccl:all_gather", "c10d::_allgather_base_", "moe.dispatch",
                                                      STEP], "exchange"),
    ("Memcpy DtoH (Device -> Pageable)", ["aten::copy_", "aten::to", "moe.dispatch", STEP], "exchange"),
    # Activation checkpointing recomputes an MoE layer inside the backward node that first needs
    # it (here the combine's): its expert and router GEMMs stay GEMMs, not exchange.
    ("_grouped_gemm_hopper_kernel", ["tlx_dist::grouped_mm", "CheckpointFunction", BWD.format("_PermuteRowsBackward"),
                                     STEP], "expert GEMMs"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", ["aten::mm", "aten::matmul", "aten::linear",
                                          BWD.format("_PermuteRowsBackward"), STEP], "other GEMMs"),
    ("_dispatch_send_kernel", ["moe.dispatch", STEP], "exchange"),
    # Attention: flash / cuDNN SDPA forward and backward.
    ("void pytorch_flash::flash_fwd_kernel<...>", ["aten::_flash_attention_forward",
                                                  "aten::_scaled_dot_product_flash_attention", STEP], "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7", ["aten::_scaled_dot_product_cudnn_attention_backward",
                                                      BWD.format("ScaledDotProductCudnnAttentionBackward0"), STEP],
     "attention"),
    # Other GEMMs: cuBLAS kernels under mm / linear, and their backward; CPU mm by op name.
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ["aten::mm", "aten::matmul", "aten::linear", STEP], "other GEMMs"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ["aten::mm", BWD.format("MmBackward0"), STEP],
     "other GEMMs"),
    ("aten::mm", ["aten::matmul", "aten::linear", STEP], "other GEMMs"),
    ("unnamed_kernel", ["aten::addmm", STEP], "other GEMMs"),
    # Elementwise / casts: copies, pointwise, norms, torch.compile's fused Triton kernels.
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda...>", ["aten::copy_", "aten::_to_copy",
                                                                                  "aten::to", STEP], "elementwise/casts"),
    ("triton_poi_fused__to_copy_add_mul_rsqrt_0", ["CompiledFunction", STEP], "elementwise/casts"),
    ("aten::silu", [STEP], "elementwise/casts"),
    # Optimizer: fused AdamW kernels, zero_grad, clipping's norm kernels (not "elementwise").
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     ["aten::_fused_adamw_", "Optimizer.step#AdamW.step", STEP], "optimizer"),
    ("void at::native::lpnorm_cleanup<float, 1, float, float>", ["aten::_foreach_norm", "train.clip_grad_norm", STEP],
     "optimizer"),
    ("aten::zero_", ["Optimizer.zero_grad#AdamW.zero_grad", STEP], "optimizer"),
    # Communication: NCCL all-reduce (also inside clipping), FSDP2's all-gather and its copy-in.
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", ["nccl:all_reduce", "c10d::allreduce_",
                                                               "train.clip_grad_norm", STEP], "communication"),
    ("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<...>", ["aten::_chunk_cat",
                                                                            "FSDP::all_gather_copy_in", STEP],
     "communication"),
    ("gloo:all_reduce", [STEP], "communication"),
    # An NCCL kernel no op claims.
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevComm*)", [], "communication"),
    # Other: device memcpy / memset.
    ("Memcpy HtoD (Pageable -> Device)", ["aten::copy_", "aten::to", STEP], "other"),
    ("Memset (Device)", ["aten::zero_", STEP], "other"),
])
def test_categorize_synthetic_names(name, stack, want):
    assert categorize(name, stack) == want


def test_every_category_is_reachable_and_known():
    assert set(CATEGORIES) == {"expert GEMMs", "exchange", "attention", "other GEMMs", "elementwise/casts",
                               "optimizer", "communication", "other"}
    assert categorize("aten::add") in CATEGORIES


def test_step_profile_of_a_cpu_run():
    """A real torch.profiler trace of 2 steps of a tiny MoE model on CPU: the dispatcher scopes
    appear (exchange > 0), GEMMs and the optimizer are found, the shares add up, and the
    dispatchers are restored after profiling."""
    from torch.profiler import ProfilerActivity, profile

    from train.config import load_config
    from train.model import Transformer

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "debug_cpu.toml",
                      ["model.dim=32", "model.n_heads=2", "model.dense_inter_dim=64", "model.moe.moe_inter_dim=32",
                       "model.moe.num_experts=4"])
    m = Transformer(cfg.model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randint(0, 259, (2, 16))
    before = [l.dispatcher for l in m.moe_layers()]
    with annotate_dispatchers(m.moe_layers()), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with torch.profiler.record_function(f"ProfilerStep#{i}"):
                (m(x, x) + m.aux_loss()).backward()
                opt.step()
                opt.zero_grad()
    assert [l.dispatcher for l in m.moe_layers()] == before
    ms = step_profile(prof.events(), steps=2, device=False)
    for c in ("exchange", "other GEMMs", "optimizer", "elementwise/casts", "attention"):
        assert ms[c] > 0, (c, ms)
    assert ms["expert GEMMs"] >= 0 and ms["step (wall)"] > 0
    total = sum(v for k, v in ms.items() if k != "step (wall)")
    # Self CPU times of ops inside the steps cannot exceed the steps' wall time.
    assert 0 < total <= ms["step (wall)"] * 1.01
    text = format_profile(ms, device=False)
    assert "exchange" in text and "step (wall)" in text
