"""Tier T0 for the per-category step profile (train/profiling.py): the categoriser on synthetic
kernel / op names as torch.profiler reports them on an H200 and on CPU; the GPU attribution on a
synthetic event tree built from torch's own FunctionEvent (nested ops, record_function scopes,
kernels on several streams, the host records that used to be counted twice); the summary of a
real CPU profile of a few training steps of a tiny model, and of `--profile 2` in the loop."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from tests._train import DEBUG, TINY, one_rank_group
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
    # The fused expert pipeline: its GEMM kernels are expert GEMMs (as H200 profiles name them);
    # the fills and casts of its op are not.
    ("_fused_mm_hopper_kernel", ["tlx_dist::fused_experts_fwd", "MoELayer", STEP], "expert GEMMs"),
    ("_fused_wgrad_hopper_kernel", ["tlx_dist::fused_experts_bwd",
                                    "GeneratedBackwardFor_tlx_dist_fused_experts_fwd_default", STEP], "expert GEMMs"),
    ("_fused_mm_blackwell_kernel", ["tlx_dist::fused_experts_fwd", STEP], "expert GEMMs"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     ["aten::fill_", "aten::zero_", "aten::zeros", "tlx_dist::fused_experts_fwd", STEP], "elementwise/casts"),
    # The symmetric-memory exchange kernels, also outside a dispatcher scope (the fused EP pipeline).
    ("_send_tokens_kernel", ["tlx_dist::dispatch_rows", STEP], "exchange"),
    ("_reduce_send_kernel", [STEP], "exchange"),
    ("_route_kernel", [STEP], "exchange"),
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
    total = sum(ms[c] for c in CATEGORIES)
    # Self CPU times of ops inside the steps are disjoint parts of the steps' wall time.
    assert 0 < total <= ms["step (wall)"] * (1 + 1e-9) and ms["left out"] == 0
    text = format_profile(ms, device=False)
    assert "exchange" in text and "step (wall)" in text


class _Trace:
    """A synthetic ``prof.events()`` list made of torch's own FunctionEvent objects, wired the way
    torch.autograd.profiler._parse_kineto_results wires a CUDA trace: host events nest through
    ``cpu_parent`` / ``cpu_children``; a device record carries the correlation id of the op that
    launched it in ``linked_correlation_id`` and is also appended to that op's ``kernels``. Times in
    microseconds. Fields newer than some torch versions are set as attributes, not constructor
    arguments."""

    def __init__(self):
        self._events: list[FunctionEvent] = []
        self._next_id = 100

    @property
    def events(self) -> list[FunctionEvent]:
        return sorted(self._events, key=lambda e: (e.time_range.start, -e.time_range.end))  # torch's order

    def _add(self, e, kind, linked=0):
        e.activity_type = kind
        e.linked_correlation_id = linked
        self._events.append(e)
        return e

    def op(self, name, start, end, parent=None, kind="cpu_op", id=None, thread=1):
        if id is None:
            self._next_id += 1
            id = self._next_id
        e = FunctionEvent(id=id, name=name, thread=thread, start_us=start, end_us=end, use_device="cuda",
                          is_user_annotation=kind == "user_annotation")
        if parent is not None:
            e.set_cpu_parent(parent)
            parent.append_cpu_child(e)
        return self._add(e, kind)

    def device(self, name, start, end, launcher=None, kind="kernel", stream=7, device=0, linked=None):
        e = FunctionEvent(id=0, name=name, thread=stream, start_us=start, end_us=end, use_device="cuda",
                          device_type=DeviceType.CUDA, device_index=device, device_resource_id=stream,
                          is_user_annotation=kind == "gpu_user_annotation")
        if launcher is not None:
            launcher.append_kernel(name, device, end - start)  # what torch does by correlation id
        return self._add(e, kind, linked if linked is not None else (launcher.id if launcher is not None else 0))


def _h200_like_step():
    """One step shaped like a real H200 training trace: nested GEMM ops, a dispatcher scope, the
    TLX grouped GEMM, the fused optimizer -- and the records that once inflated the table to several
    times the step: a CUPTI "Command Buffer Full" overhead record inside the optimizer
    to which torch attaches another op's kernels (same correlation number), GPU-side annotation
    spans of the step and of Optimizer.step, a stream-wait sync record, and a kernel queued before
    the profiled step. Returns (trace, ms per category a correct table shows, left-out ms)."""
    t = _Trace()
    step = t.op("ProfilerStep*", 0, 1000, kind="user_annotation")
    linear = t.op("aten::linear", 10, 60, step)
    mm = t.op("aten::mm", 12, 58, t.op("aten::matmul", 11, 59, linear))
    t.device("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 100, 200, mm)
    disp = t.op("moe.dispatch", 60, 120, step, kind="user_annotation")
    t.device("void at::native::indexSelectLargeIndex<float>", 200, 230, t.op("aten::index_select", 61, 80, disp))
    t.device("_dispatch_send_kernel", 230, 250, disp)  # a Triton kernel launched in the scope itself
    gmm = t.op("tlx_dist::grouped_mm", 120, 200, step)
    t.device("_grouped_gemm_hopper_kernel", 250, 450, gmm)
    opt = t.op("Optimizer.step#AdamW.step", 300, 900, step, kind="user_annotation")
    adamw = t.op("aten::_fused_adamw_", 310, 890, opt)
    t.device("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
             450, 500, adamw)
    t.device("Memcpy DtoD (Device -> Device)", 520, 540, t.op("aten::copy_", 900, 910, step), kind="gpu_memcpy")
    mul = t.op("aten::mul", 910, 920, step)
    t.device("void at::native::vectorized_elementwise_kernel<4>", 540, 560, mul)
    # The host blocked on a full launch queue in the optimizer, four times. torch gives these
    # records a correlation number an op also has and appends that op's kernels to them too; the
    # old table counted those again, under the records' ancestors: "optimizer".
    # A runtime call inside the optimizer that shares aten::mul's correlation number, and a memset
    # linked to no op (correlation 0, like a collective launched off the profiled thread).
    t.op("cudaStreamWaitEvent", 700, 705, adamw, kind="cuda_runtime", id=mul.id)
    t.device("Memset (Device)", 560, 570, linked=0, kind="gpu_memset")
    zero_grad = t.op("Optimizer.zero_grad#AdamW.zero_grad", 930, 990, step, kind="user_annotation")
    for start, parent in ((320, adamw), (400, adamw), (600, adamw), (940, zero_grad)):  # before and after mul
        overhead = t.op("Command Buffer Full", start, start + 10, parent, kind="overhead", id=mul.id)
        overhead.append_kernel("void at::native::vectorized_elementwise_kernel<4>", 0, 20.0)
    t.device("ProfilerStep#4", 100, 600, linked=step.id, kind="gpu_user_annotation")
    t.device("Optimizer.step#AdamW.step", 450, 500, linked=opt.id, kind="gpu_user_annotation")
    t.device("Stream Wait Event", 500, 520, kind="cuda_sync", linked=adamw.id)
    t.device("void at::native::vectorized_elementwise_kernel<4>", 50, 90, linked=99999)  # warm-up op
    # Linked to no op in the trace, yet inside the step's device span (as on a real H200 trace,
    # where such kernels, the AdamW update among them, were once dropped): it counts, by its own
    # name.
    t.device("_adamw_kernel", 570, 590, linked=88888)
    want_us = {"other GEMMs": 100, "exchange": 50, "expert GEMMs": 200, "optimizer": 70, "other": 30,
               "elementwise/casts": 20}
    return t, {c: want_us.get(c, 0) / 1e3 for c in CATEGORIES}, 40 / 1e3


def _no_new_fields(trace, linked=True, kind=True):
    """The same trace as an older torch reports it: without linked_correlation_id and / or
    activity_type on its events."""
    for e in trace._events:
        if not linked:
            del e.linked_correlation_id
        if not kind:
            e.activity_type = None
    return trace


@pytest.mark.parametrize("linked, kind", [
    (True, True),     # this torch: device records carry their launcher's correlation id
    (True, False),    # no activity_type: host ops and device work told apart by name
    (False, True),    # no linked_correlation_id: matched through each op's kernels list
    (False, False),   # neither field: device work and host ops told apart by name
])
def test_each_kernel_counted_once_by_its_launching_op(linked, kind):
    t, want, left_out = _h200_like_step()
    # The trap is real in this trace: the naive sum over every host event's kernels (the old
    # table) counts the aten::mul kernel four more times through the overhead records.
    naive = sum(k.duration for e in t.events if e.device_type == DeviceType.CPU for k in e.kernels) / 1e3
    assert naive == pytest.approx(0.52)
    ms = step_profile(_no_new_fields(t, linked, kind).events, steps=1, device=True)
    for c in CATEGORIES:
        assert ms[c] == pytest.approx(want[c], abs=1e-12), (c, ms)
    total = sum(ms[c] for c in CATEGORIES)
    assert total == pytest.approx(0.47) and ms["device busy"] == pytest.approx(0.47)
    assert ms["kernel time"] == pytest.approx(0.47) and ms["left out"] == pytest.approx(left_out)
    assert ms["unlinked"] == pytest.approx(0.03)  # the memset and the AdamW kernel
    assert ms["step (wall)"] == pytest.approx(1.0)


def test_unlinked_kernel_after_its_steps_device_span_counts():
    """Two profiled steps, each ending in a sync, as tests/test_train_profiling.py's GPU test runs
    them: the fused AdamW kernel of each step is linked to no op (CUPTI lost the link), so torch's
    GPU-side ProfilerStep span of that step ends before it. It still counts, for its own step, as
    "optimizer" (by name); only the kernel queued before the first profiled step is left out."""
    t = _Trace()
    adam = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>"
    t.device("void at::native::vectorized_elementwise_kernel<4>", 5, 15, linked=99999)  # a warm-up step's
    for base in (0, 1000):
        step = t.op("ProfilerStep*", base + 0, base + 1000, kind="user_annotation")
        mm = t.op("aten::mm", base + 10, base + 20, step)
        t.device("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", base + 100, base + 300, mm)
        t.device("ProfilerStep#1", base + 100, base + 300, linked=step.id, kind="gpu_user_annotation")
        t.device(adam, base + 310, base + 400, linked=77777)  # after the span: no op linked
    ms = step_profile(t.events, steps=2, device=True)
    assert ms["optimizer"] == pytest.approx(0.09) and ms["other GEMMs"] == pytest.approx(0.2)
    assert ms["unlinked"] == pytest.approx(0.09)
    assert ms["left out"] == pytest.approx(0.005)  # the warm-up kernel, 10 us over 2 steps
    assert ms["device busy"] == pytest.approx(0.29) and ms["kernel time"] == pytest.approx(0.29)


def test_steps_divide_and_table_states_busy_fraction():
    t, want, _ = _h200_like_step()
    ms = step_profile(t.events, steps=2, device=True)
    assert ms["expert GEMMs"] == pytest.approx(want["expert GEMMs"] / 2)
    assert ms["step (wall)"] == pytest.approx(0.5) and ms["device busy"] == pytest.approx(0.235)
    text = format_profile(ms, device=True)
    assert "device busy 0.23 ms/step = 47.0% of the wall step time" in text
    assert "of which 0.01 ms/step launched by no op in the trace" in text
    assert "left out: 0.02 ms/step" in text
    rows = dict(re.findall(r"^(\S.*?)\s+(\d+\.\d+)(?:\s+[\d.]+%)?$", text, re.M))
    assert float(rows["total"]) == pytest.approx(0.235, abs=0.005)


def test_concurrent_streams_are_split_not_summed():
    """Two kernels overlapping for 50 us on two streams of one device: each gets half of the
    overlap, so the categories sum to the busy time (250 us), not the kernels' 300 us. Back-to-back
    kernels on one stream do not count as concurrent; another device's time is its own."""
    t = _Trace()
    step = t.op("ProfilerStep*", 0, 1000, kind="user_annotation")
    mm = t.op("aten::mm", 10, 20, step)
    disp = t.op("moe.dispatch", 20, 40, step, kind="user_annotation")
    add = t.op("aten::add", 40, 50, step)
    t.device("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 0, 100, mm, stream=7)
    t.device("ncclDevKernel_SendRecv(ncclDevComm*)", 50, 150, t.op("nccl:all_to_all", 21, 30, disp), stream=9)
    t.device("void at::native::vectorized_elementwise_kernel<4>", 200, 250, add, stream=7)
    t.device("void at::native::vectorized_elementwise_kernel<4>", 250, 300, add, stream=7)
    t.device("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 0, 100, mm, stream=7, device=1)
    ms = step_profile(t.events, steps=1, device=True)
    assert ms["other GEMMs"] == pytest.approx(0.075 + 0.1)
    assert ms["exchange"] == pytest.approx(0.075)
    assert ms["elementwise/casts"] == pytest.approx(0.1)
    assert sum(ms[c] for c in CATEGORIES) == pytest.approx(ms["device busy"]) == pytest.approx(0.35)
    assert ms["kernel time"] == pytest.approx(0.4)
    assert "(0.05 ms on concurrent streams, split evenly)" in format_profile(ms, device=True)


def test_cpu_profile_counts_self_time_inside_steps_only():
    """On CPU: each op's self time once (a parent's total holds its children's), only inside the
    ProfilerStep scopes; an op outside them is reported as left out."""
    t = _Trace()
    step = t.op("ProfilerStep*", 0, 100, kind="user_annotation")
    linear = t.op("aten::linear", 10, 50, step)
    t.op("aten::mm", 20, 40, linear)
    t.op("aten::silu", 50, 60, step)
    t.op("aten::add", 150, 160)
    ms = step_profile(t.events, steps=1, device=False)
    assert ms["other GEMMs"] == pytest.approx(0.04)          # linear self 20 + mm 20
    assert ms["elementwise/casts"] == pytest.approx(0.01)    # silu; not the add outside the step
    assert ms["left out"] == pytest.approx(0.01) and ms["step (wall)"] == pytest.approx(0.1)
    assert "ops cover 50.0% of the wall step time" in format_profile(ms, device=False)


@pytest.fixture
def one_rank():
    with one_rank_group():
        yield torch.device("cpu")


def test_profile_flag_table_fits_in_the_step(one_rank, capsys):
    """``--profile 2`` in the training loop on CPU: the printed categories sum to at most the
    measured wall step time, and the dispatcher, GEMMs and optimizer are all found."""
    from train.config import load_config
    from train.pretrain import train

    train(load_config(DEBUG, TINY + ["train.steps=5"]), one_rank, profile_steps=2)
    text = capsys.readouterr().out
    table = text[text.index("step profile:"):]
    rows = dict(re.findall(r"^(\S.*?)\s+(\d+\.\d+)(?:\s+[\d.]+%)?$", table, re.M))
    cats = {c: float(rows[c]) for c in CATEGORIES}
    for c in ("exchange", "other GEMMs", "optimizer", "elementwise/casts"):
        assert cats[c] > 0, (c, table)
    assert 0 < sum(cats.values()) <= float(rows["step (wall)"])
    assert abs(sum(cats.values()) - float(rows["total"])) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_counts_each_kernel_once():
    """A real CUDA trace of 2 steps (GEMMs, a dispatcher scope, fused AdamW), each step ending in a
    sync so that no work crosses a step boundary: every kernel is linked to the op that launched
    it (none left out), the categories sum to the device's busy time, which fits in the steps'
    wall time, and the kernels' summed time is the trace's own."""
    from torch.profiler import ProfilerActivity, profile, schedule

    dev = torch.device("cuda")
    w = torch.nn.Parameter(torch.randn(2048, 2048, device=dev))
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True)
    idx = torch.randperm(4096, device=dev)
    seen = {}

    def report(p):
        seen["events"] = list(p.events())

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1), on_trace_ready=report) as prof:
        for _ in range(3):
            x = torch.randn(4096, 2048, device=dev)
            with torch.profiler.record_function("moe.dispatch"):
                x = x.index_select(0, idx)
            (x @ w).square().mean().backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            prof.step()
    ms = step_profile(seen["events"], steps=2, device=True)
    print("\n" + format_profile(ms, device=True))
    for c in ("exchange", "other GEMMs", "optimizer", "elementwise/casts"):
        assert ms[c] > 0, (c, ms)
    assert ms["left out"] == 0
    total = sum(ms[c] for c in CATEGORIES)
    assert total == pytest.approx(ms["device busy"], rel=1e-9)
    assert 0 < ms["device busy"] <= ms["kernel time"] + 1e-9 and ms["device busy"] <= ms["step (wall)"]
    work = [e for e in seen["events"] if e.device_type == DeviceType.CUDA and not e.is_user_annotation
            and getattr(e, "activity_type", "kernel") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert ms["kernel time"] == pytest.approx(sum(e.time_range.end - e.time_range.start for e in work) / 2e3)


def test_annotated_dispatchers_keep_the_pipeline_and_scope_the_combine(monkeypatch):
    """The profiling wrapper must not change what is measured: the layer still sees its Local
    dispatcher when it picks the fused pipeline, and combine_weighted (what MoELayer calls) opens
    the moe.combine scope like dispatch opens moe.dispatch."""
    import tlx_dist.moe as moe_mod
    from tlx_dist import MoEConfig, MoELayer

    cfg = MoEConfig(dim=16, moe_inter_dim=8, num_experts=4, top_k=2, dtype="float32")
    layer = MoELayer(cfg, pipeline="auto")
    monkeypatch.setattr(moe_mod, "fused_tlx_supports", lambda *a: True)  # as on an H200
    x = torch.randn(6, 16)
    assert layer._fused(x)
    # Wide experts (Mixtral's F = 3.5 D ran faster separate on an H200): auto stays separate;
    # "fused" still forces the fused pipeline.
    wide = MoEConfig(dim=16, moe_inter_dim=40, num_experts=4, top_k=2, dtype="float32")
    assert not MoELayer(wide, pipeline="auto")._fused(x)
    assert MoELayer(wide, pipeline="fused")._fused(x)
    # Under EP, auto takes the fused form over the symmetric exchange, not over all-to-all.
    from tlx_dist.comm import AllToAllDispatcher
    from tlx_dist.comm.symm import SymmDispatcher
    ep = MoELayer(cfg, pipeline="auto")
    ep.ep_size = 2
    ep.dispatcher = object.__new__(SymmDispatcher)
    assert ep._fused(x)
    ep.dispatcher = object.__new__(AllToAllDispatcher)
    assert not ep._fused(x)
    with annotate_dispatchers([layer]):
        assert layer._fused(x), "the wrapper turned the fused pipeline off"
        layer.pipeline = "separate"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            layer(x)
    names = {e.name for e in prof.events()}
    assert {"moe.dispatch", "moe.combine"} <= names, sorted(n for n in names if n.startswith("moe."))
