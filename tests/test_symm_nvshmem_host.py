"""Host side of the NVSHMEM route (CPU, T0/T1): the staging layout, which launches get the
USE_NVSHMEM variant and the NVSHMEM library, which compiled modules get NVSHMEM module init, and
the backend choice for groups that span nodes. The kernels themselves: test_symm_nvshmem_compile.py."""

from __future__ import annotations

import os
import types

import pytest
import torch

pytest.importorskip("triton")

from _dist import run_world  # noqa: E402
from tlx_dist.comm.symm import buffers as sb  # noqa: E402
from tlx_dist.comm.symm.buffers import SymmBuffers, SymmLayout  # noqa: E402

STAGING = ("srows", "smeta", "sgates", "scomb", "sdgate")
REGIONS = ("state", "flags", "arrive", "counts", "meta", "gates", "recv", "comb", "dgate")


@pytest.mark.parametrize("T,D,K,E,W,dtype", [
    (128, 64, 8, 16, 4, torch.bfloat16),
    (1, 3, 1, 2, 2, torch.float64),  # one token, odd D, K = 1: the smallest regions still align
    (7, 5, 3, 6, 3, torch.float16),  # odd everything (W = 3: META rows of 4 words)
])
def test_staging_layout_appends_regions_and_moves_nothing(T, D, K, E, W, dtype):
    plain = SymmLayout.build(T, D, K, E, W, dtype)
    st = SymmLayout.build(T, D, K, E, W, dtype, staging=True)
    assert not plain.staging and st.staging
    # The peer-pointer regions keep their offsets, so both routes agree on every receiver slot.
    assert all(getattr(st, f"off_{n}") == getattr(plain, f"off_{n}") for n in REGIONS)
    es, R = dtype.itemsize, W * T
    sizes = dict(srows=T * D * es, smeta=T * W * (K + 1) * 4, sgates=T * K * es, scomb=R * D * es, sdgate=R * K * 8)
    offs = [plain.nbytes] + [getattr(st, f"off_{n}") for n in STAGING] + [st.nbytes]
    for i, n in enumerate(STAGING):  # in order, after DGATE, aligned, each big enough, no overlap
        assert offs[i + 1] >= offs[i] and offs[i + 1] % 256 == 0
        assert offs[i + 2] - offs[i + 1] >= sizes[n], n
    assert st.nbytes - plain.nbytes < sum(sizes.values()) + 256 * len(STAGING)


def _nvshmem_buffers(ptrs, monkeypatch, lib_dir):
    """A SymmBuffers as the nvshmem backend builds it (CPU memory: only the host logic runs)."""
    W = len(ptrs)
    L = SymmLayout.build(4, 8, 2, 2 * W, W, torch.float32, staging=True)
    b = SymmBuffers.__new__(SymmBuffers)
    b._init(L, 0, torch.zeros(L.nbytes, dtype=torch.uint8), ptrs, [10 + d for d in range(W)], "nvshmem", None, 1.0)
    (lib_dir / "libnvshmem_device_sm_90.bc").write_bytes(b"")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(lib_dir))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return b


def test_nvshmem_meta_only_when_a_peer_has_no_pointer(monkeypatch, tmp_path):
    from tlx.comm import exchange

    import triton
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    # Emulated world and a one-node NVSHMEM group: every peer has a pointer -> peer-pointer kernels.
    for b in SymmBuffers.emulated(2, 4, 8, 2, 4, torch.float32, device="cpu"):
        assert not b.use_nvshmem and b.nvshmem_meta(exchange._send_tokens_kernel) == {}
        assert b.pes.tolist() == [0, 1]
    assert _nvshmem_buffers([64, 128], monkeypatch, tmp_path).nvshmem_meta(exchange._reduce_send_kernel) == {}
    # Rank 1 on another node: the sending kernels get their USE_NVSHMEM variant and the library.
    b = _nvshmem_buffers([64, 0], monkeypatch, tmp_path)
    L = b.layout
    assert b.use_nvshmem and b.pes.dtype == torch.int32 and b.pes.tolist() == [10, 11]
    lib = {"libnvshmem_device": str(tmp_path / "libnvshmem_device_sm_90.bc")}
    meta = b.nvshmem_meta(exchange._send_tokens_kernel)
    assert meta.pop("pes_ptr") is b.pes
    assert meta == dict(USE_NVSHMEM=True, OFF_SROWS=L.off_srows, OFF_SMETA=L.off_smeta, OFF_SGATES=L.off_sgates,
                        extern_libs=lib)
    assert set(b.nvshmem_meta(exchange._reduce_send_kernel)) == {"pes_ptr", "USE_NVSHMEM", "OFF_SCOMB", "extern_libs"}
    assert set(b.nvshmem_meta(exchange._expand_kernel)) == {"pes_ptr", "USE_NVSHMEM", "OFF_SDGATE", "extern_libs"}
    for k in (exchange._route_kernel, exchange._reduce_recv_kernel, exchange._gate_grad_recv_kernel):
        assert set(b.nvshmem_meta(k)) == {"pes_ptr", "USE_NVSHMEM", "extern_libs"}  # counts / readiness
    # The module-init hook is installed by the first NVSHMEM launch.
    assert triton.knobs.runtime.jit_post_compile_hook is sb._nvshmem_module_init_hook
    with pytest.raises(TypeError, match="_wait_geq has no USE_NVSHMEM parameter"):
        b.nvshmem_meta(exchange._wait_geq)  # not a sending kernel


def test_module_init_only_for_modules_holding_nvshmem_state(monkeypatch):
    inited, chained = [], []
    monkeypatch.setattr(sb, "_cumodule_init", inited.append)
    monkeypatch.setattr(sb, "_PREV_HOOK", lambda *a, **kw: chained.append(kw["key"]))

    def compile_event(key, libs, cubin):
        kernel = types.SimpleNamespace(asm={"cubin": cubin}, run=None, module=f"module-{key}")
        jit = types.SimpleNamespace(device_caches={0: ({key: kernel},)}, fn=types.SimpleNamespace(__name__="k"))
        sb._nvshmem_module_init_hook(key=key, fn=types.SimpleNamespace(jit_function=jit),
                                     compile={"device": 0, "extern_libs": libs})

    libdevice = (("libdevice", "/x/libdevice.10.bc"),)
    compile_event("peer", libdevice, b"\x7fELF...")  # no NVSHMEM library: left to the previous hook
    # Linked with NVSHMEM but without any NVSHMEM call (e.g. the dispatch expand): no init, which
    # nvshmemx_cumodule_init would fail on.
    compile_event("quiet", libdevice + (("libnvshmem_device", "/x/nv.bc"),), b"\x7fELF...")
    compile_event("sender", libdevice + (("libnvshmem_device", "/x/nv.bc"),), b"..nvshmemi_device_state_d..")
    assert chained == ["peer"] and inited == ["module-sender"]


def test_device_library_lookup(monkeypatch, tmp_path):
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path))
    (tmp_path / "libnvshmem_device.bc").write_bytes(b"")  # wheels <= 3.6: one file for every arch
    assert sb.nvshmem_device_library(100) == str(tmp_path / "libnvshmem_device.bc")
    (tmp_path / "libnvshmem_device_sm_100.bc").write_bytes(b"")  # 3.7+: one per arch, preferred
    assert sb.nvshmem_device_library(100) == str(tmp_path / "libnvshmem_device_sm_100.bc")


def _two_node_worker(rank, world, backend):
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per node: the group spans 2 nodes
    try:
        SymmBuffers(4, 8, 2, 4, torch.float32, torch.distributed.group.WORLD, backend=backend, device="cpu")
    except (ValueError, RuntimeError) as err:
        return type(err).__name__, str(err)
    return None


def test_groups_spanning_nodes_pick_nvshmem():
    """backend='cuda' is refused across nodes; 'auto' picks NVSHMEM, which this CPU build of torch
    lacks: a clear error naming the fallback, not a hang or a peer-pointer build."""
    cuda, auto = run_world(_two_node_worker, 2, "cuda"), run_world(_two_node_worker, 2, "auto")
    for kind, msg in cuda:
        assert kind == "ValueError" and "spans nodes" in msg and "nvshmem" in msg
    for kind, msg in auto:
        assert kind == "RuntimeError" and "NVSHMEM" in msg and "all_to_all" in msg


def test_region_bases_must_be_16_byte_aligned():
    """The exchange kernels declare every region start 16-byte aligned (16-byte row vectors), so a
    misaligned peer base is refused when the buffers are built, not left to fault in a kernel."""
    L = SymmLayout.build(4, 8, 2, 4, 2, torch.float32)
    mem = torch.zeros(2 * L.nbytes + 16, dtype=torch.uint8)
    base = mem.data_ptr() + (-mem.data_ptr()) % 16
    b = SymmBuffers.__new__(SymmBuffers)
    b._init(L, 0, mem, [base, base + L.nbytes], [0, 1], "emulated", None, 1.0)  # aligned: fine
    with pytest.raises(RuntimeError, match=r"16-byte aligned.*\(1, "):
        SymmBuffers.__new__(SymmBuffers)._init(L, 0, mem, [base, base + L.nbytes + 8], [0, 1], "emulated", None,
                                               1.0)
