"""The hierarchical exchange's part of a buffer set: its symmetric regions (``tlx/comm/hier.py``
lists them) after the flat ones, and the per-leg counters.

Legend: W ranks in N nodes of L ranks, T_max tokens per rank, K top-k, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HierLayout", "HierState", "LEG_COUNTERS", "leg_counters_dict"]

# ctr[i] of tlx/comm/hier.py: what dispatch-direction ops (dispatch, combine's backward) and
# combine-direction ops (combine, dispatch's backward) sent over the NIC and into other ranks of the
# node (NVLink), rows and their payload bytes (rows * D * itemsize; metadata and signals not counted).
LEG_COUNTERS = ("dispatch_nic_rows", "dispatch_nic_bytes", "dispatch_nvl_rows", "dispatch_nvl_bytes",
                "combine_nic_rows", "combine_nic_bytes", "combine_nvl_rows", "combine_nvl_bytes")


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class HierLayout:
    """Byte offsets of the hierarchical regions, from ``base_nbytes`` (the flat layout's end);
    ``nbytes``: the whole allocation. ``hmeta_words``: HM = 2K + L + 1 int32 a relay row."""

    ranks_per_node: int
    num_nodes: int
    hmeta_words: int
    off_hflag: int
    off_hcnt: int
    off_harrive: int
    off_hcarr: int
    off_hdone: int
    off_hmeta: int
    off_hcomb: int
    off_shcnt: int
    off_shmeta: int
    nbytes: int

    @classmethod
    def build(cls, base_nbytes: int, world_size: int, max_tokens: int, top_k: int, hidden: int, itemsize: int,
              ranks_per_node: int, staging: bool) -> "HierLayout":
        """``staging``: the NVSHMEM route's staging regions (SHCNT, SHMETA) too."""
        W, T, K, L = world_size, max_tokens, top_k, ranks_per_node
        if L < 1 or W % L:
            raise ValueError(f"ranks_per_node={L} does not divide the world size {W}")
        N = W // L
        hm = 2 * K + L + 1
        off, offs = _align(base_nbytes), {}
        sizes = [("hflag", 8 * W), ("hcnt", 8 * W), ("harrive", 8 * W), ("hcarr", 8 * W), ("hdone", 16),
                 ("hmeta", 4 * W * T * hm), ("hcomb", hidden * itemsize * N * T * L)]
        if staging:
            sizes += [("shcnt", 8 * N), ("shmeta", 4 * T * N * hm)]
        for name, size in sizes:
            offs[name] = off
            off = _align(off + size)
        return cls(L, N, hm, offs["hflag"], offs["hcnt"], offs["harrive"], offs["hcarr"], offs["hdone"],
                   offs["hmeta"], offs["hcomb"], offs.get("shcnt", 0), offs.get("shmeta", 0), off)


class HierState:
    """A rank's hierarchical part of a buffer set (``SymmBuffers.hier``): the layout, and the
    per-leg counters ``counters`` (int64 ``[8]`` on the device, :data:`LEG_COUNTERS`; they add up
    until :meth:`reset`)."""

    def __init__(self, layout: HierLayout, device: torch.device):
        self.layout = layout
        self.counters = torch.zeros(len(LEG_COUNTERS), dtype=torch.int64, device=device)

    def reset(self) -> None:
        self.counters.zero_()


def leg_counters_dict(counters: torch.Tensor) -> dict:
    """``{name: int}`` of a counters tensor (a host sync: for tests and benchmark reports)."""
    return dict(zip(LEG_COUNTERS, (int(v) for v in counters.tolist())))
