"""The LigerMoE anchor of ``bench/moe_layer.py`` (provider ``liger_cute``): liger-cute-kernels' persistent
warp-specialized CUTLASS + NVSHMEM fused expert-parallel MoE, called through
``liger_kernel.ops.cute.ops.moe.moe_fused`` on the same router output and the same expert weights as
the other providers. Optional: :func:`available` says in one line why it cannot run here.

Legend: T tokens on this rank, D hidden, F expert intermediate, E experts (global), e = E / W local
experts, K top-k, S tokens of the correctness subset.

Weight layouts (this rank's e experts):
  ours       w13_eDF2 [e, D, 2F] = [gate | up] along the last dim (SwiGLU: silu(h[:, :F]) * h[:, F:]),
             w2_eFD [e, F, D]
  LigerMoE   gate_eID [e, F, D], up_eID [e, F, D], down_eDI [e, D, F], bf16, contiguous (its backward
             needs contiguous weights);  y = sum_k gate_k * (silu(x gate^T) * (x up^T)) down^T
The conversion is a copy made once, outside the timed region; its gradients map back with
:func:`from_liger_grads` so dw13 compares with the other providers'.

Runtime: NVSHMEM is initialized once per process (:class:`LigerRuntime`, sized for the largest
problem the bench runs: its capacity cannot grow) and finalized once, before the process group is
destroyed. One NVSHMEM host library may live in a process: the process must start with
``LD_PRELOAD`` naming the ``libnvshmem_host.so.3`` LigerMoE was built against (a mismatched
library aborts the process at init, which no ``try`` can catch, hence the check in :func:`available`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Optional

import torch
import torch.nn.functional as F

NAME = "liger_cute"


def available() -> str:
    """'' when LigerMoE can run in this process, else the one-line reason it cannot."""
    for mod in ("liger_cute_kernels", "liger_kernel"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{mod} is not installed (pip install liger-cute-kernels liger-kernel)"
    if not torch.cuda.is_available():
        return "LigerMoE needs a CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0) and cap[0] != 10:
        return f"LigerMoE runs on Hopper (sm_90) and Blackwell (sm_10x), not sm_{cap[0]}{cap[1]}"
    if "libnvshmem_host" not in os.environ.get("LD_PRELOAD", ""):
        return ("start the process with LD_PRELOAD=<LigerMoE's libnvshmem_host.so.3> (a second NVSHMEM "
                "host library in the process aborts it at init)")
    try:
        importlib.import_module("liger_kernel.ops.cute.ops.moe")
    except Exception as err:  # noqa: BLE001 -- any failure to load means the anchor cannot run
        return f"liger_kernel.ops.cute.ops.moe failed to import: {type(err).__name__}: {str(err)[:200]}"
    return ""


def to_liger_weights(w13_EDF2: torch.Tensor, w2_EFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gate_EID, up_EID, down_EDI)``: contiguous copies of ``w13_EDF2`` [E, D, 2F] (gate half
    first) and ``w2_EFD`` [E, F, D] in LigerMoE's layouts [E, F, D], [E, F, D], [E, D, F]; same dtype."""
    if w13_EDF2.dim() != 3 or w2_EFD.dim() != 3:
        raise ValueError(f"w13_EDF2 {tuple(w13_EDF2.shape)} and w2_EFD {tuple(w2_EFD.shape)} must be 3-D")
    E, D, F2 = w13_EDF2.shape
    if F2 % 2 or w2_EFD.shape != (E, F2 // 2, D):
        raise ValueError(f"w13_EDF2 {tuple(w13_EDF2.shape)} must be [E, D, 2F] and w2_EFD "
                         f"{tuple(w2_EFD.shape)} [E, F, D] with the same E, D, F")
    Fe = F2 // 2
    gate = w13_EDF2[:, :, :Fe].transpose(1, 2).contiguous()
    up = w13_EDF2[:, :, Fe:].transpose(1, 2).contiguous()
    return gate, up, w2_EFD.transpose(1, 2).contiguous()


def from_liger_grads(dgate_EID: torch.Tensor, dup_EID: torch.Tensor,
                     ddown_EDI: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(dw13_EDF2, dw2_EFD)`` in our layouts from gradients in LigerMoE's (``dw2`` None without ``ddown``)."""
    dw13 = torch.cat([dgate_EID.transpose(1, 2), dup_EID.transpose(1, 2)], dim=2)
    return dw13, None if ddown_EDI is None else ddown_EDI.transpose(1, 2).contiguous()


def liger_moe_ref(x_TD: torch.Tensor, idx_TK: torch.Tensor, gate_TK: torch.Tensor, gate_EID: torch.Tensor,
                  up_EID: torch.Tensor, down_EDI: torch.Tensor) -> torch.Tensor:
    """LigerMoE's documented math in plain torch, token by token (one PE):
    ``y_t = sum_k gate_TK[t, k] * (silu(x_t gate_e^T) * (x_t up_e^T)) down_e^T`` with e = idx_TK[t, k].
    x_TD [T, D], idx_TK [T, K] int, gate_TK [T, K], weights in its layouts; all in x_TD's dtype. The
    CPU emulation the weight conversion is tested with."""
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            a = F.silu(x_TD[t] @ gate_EID[e].T) * (x_TD[t] @ up_EID[e].T)
            out[t] += gate_TK[t, k].to(x_TD.dtype) * (a @ down_EDI[e].T)
    return out


def experts_ref(x_SD: torch.Tensor, idx_SK: torch.Tensor, gate_SK: torch.Tensor, w13_eDF2: torch.Tensor,
                w2_eFD: torch.Tensor, first_expert: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's experts' share of the SwiGLU MoE output for ``x_SD`` [S, D], in ``dtype`` per
    expert (x, h, the SwiGLU and y rounded to it; the gate-weighted k-sum in fp32). Slots whose
    expert (``idx_SK`` [S, K], global ids) is outside [first_expert, first_expert + e) add nothing, so
    an all-reduce over the EP ranks gives the whole output. Returns fp32 [S, D]. An expert loop
    (no permutation kernels), so it shares no code with the providers it checks."""
    e, Fe = w13_eDF2.shape[0], w2_eFD.shape[1]
    out = torch.zeros(x_SD.shape, dtype=torch.float32, device=x_SD.device)
    for j in range(e):
        s, k = torch.nonzero(idx_SK == first_expert + j, as_tuple=True)
        if s.numel() == 0:
            continue
        h = x_SD[s].to(dtype) @ w13_eDF2[j].to(dtype)
        y = (F.silu(h[:, :Fe]) * h[:, Fe:]) @ w2_eFD[j].to(dtype)
        out.index_add_(0, s, y.float() * gate_SK[s, k].float().unsqueeze(1))
    return out


def check_close(out_SD: torch.Tensor, ref_SD: torch.Tensor, twin_SD: torch.Tensor) -> tuple[float, Optional[str]]:
    """``(max |out - ref|, None)`` when ``out_SD`` is as close to the fp32 reference ``ref_SD`` as a bf16
    layer may be, else ``(err, reason)``. The bound is measured, not chosen (STYLE 6): twice the error
    of ``twin_SD`` (the same experts computed by torch in bf16, :func:`experts_ref`) plus one bf16
    rounding of the largest output (2**-9 * max |ref|, the half-ulp at that magnitude)."""
    ref = ref_SD.float()
    err = float((out_SD.float() - ref).abs().max())
    bound = 2.0 * float((twin_SD.float() - ref).abs().max()) + 2.0 ** -9 * float(ref.abs().max())
    if not err <= bound:  # NaN fails too
        return err, f"output off the fp32 reference: max |err| {err:.3e} > bound {bound:.3e} (2x torch bf16 + 2^-9 max)"
    return err, None


class LigerRuntime:
    """LigerMoE's NVSHMEM runtime in this process: configured once, for the largest problem
    (``max_tokens`` per rank, ``hidden``, ``num_experts`` global, ``top_k``), on ``group`` (the EP group;
    None: a world-size-1 NCCL group made here, one PE); :meth:`close` finalizes NVSHMEM once, before
    that group is destroyed. Its EP team is described to it as ``W / LOCAL_WORLD_SIZE`` hosts of
    ``LOCAL_WORLD_SIZE`` GPUs."""

    def __init__(self, *, max_tokens: int, hidden: int, num_experts: int, top_k: int, group=None):
        import torch.distributed as dist
        import liger_cute_kernels as lck

        self._own_group = False
        if group is None:
            if not dist.is_initialized():
                # One PE: the runtime bootstraps over a process group; an in-process store serves one rank.
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                        device_id=torch.device("cuda", torch.cuda.current_device()))
                self._own_group = True
            group = dist.group.WORLD
        W = dist.get_world_size(group)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", W))
        if local < 1 or W % local:
            raise ValueError(f"LOCAL_WORLD_SIZE={local} must divide the EP group's {W} ranks")
        self.group = group
        self._closed = False
        try:
            lck.configure(process_groups={"ep": group}, bootstrap_group=group,
                          device=torch.device("cuda", torch.cuda.current_device()),
                          moe=lck.MoEConfig(max_tokens=max_tokens, hidden_size=hidden, num_experts=num_experts,
                                            top_k=top_k, num_hosts=W // local, gpus_per_host=local,
                                            max_inflight=2))
        except BaseException:
            if self._own_group:
                dist.destroy_process_group()
            raise
        from liger_kernel.ops.cute.ops.moe import moe_fused

        self.moe_fused = moe_fused

    def close(self) -> None:
        """Finalize NVSHMEM (after every forward and backward finished), then drop the group made here."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist
        from liger_cute_kernels import nvshmem

        torch.cuda.synchronize()
        try:
            nvshmem.finalize()
        finally:
            if self._own_group:
                dist.destroy_process_group()


class LigerExperts:
    """The ``liger_cute`` provider's experts: LigerMoE-layout copies of ``w13_eDF2`` / ``w2_eFD`` (this
    rank's experts) as leaf tensors that take gradients, called on a router's ``idx_TK`` / ``gate_TK``."""

    def __init__(self, runtime: LigerRuntime, w13_eDF2: torch.Tensor, w2_eFD: torch.Tensor, num_experts: int,
                 top_k: int):
        with torch.no_grad():
            self.params = [w.requires_grad_(True) for w in to_liger_weights(w13_eDF2.detach(), w2_eFD.detach())]
        self.runtime, self.num_experts, self.top_k = runtime, num_experts, top_k

    def __call__(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, gate_TK: torch.Tensor) -> torch.Tensor:
        """[T, D] bf16 output of the routed experts (combined over the EP group)."""
        gate, up, down = self.params
        return self.runtime.moe_fused(x_TD, idx_TK.to(torch.int32), gate_TK.to(torch.bfloat16), gate, up, down,
                                      self.num_experts, self.top_k, self.runtime.group)

    def dw13(self, out_TD: torch.Tensor, g_TD: torch.Tensor) -> torch.Tensor:
        """d(out . g)/d w13 in our [e, D, 2F] layout (the backward run once)."""
        dgate, dup = torch.autograd.grad(out_TD, self.params[:2], g_TD)
        return from_liger_grads(dgate, dup)[0]
