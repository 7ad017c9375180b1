"""Gather-on-load by ``cp.async``, shared by the Hopper and Blackwell fused MoE kernels.

Neither generation has a TMA row gather we rely on, so a producer partition of P warps copies the
rows of a tile by index with 16-byte ``cp.async`` straight into the NVMMA-swizzled stage buffer the
MMA (wgmma / tcgen05) reads, commits one group per stage, and -- completion being per thread --
signals the stage through a per-thread warp barrier ``afull[s]`` (P * 32 arrivals) after
``cp.async.wait_group`` + ``fence.proxy.async`` (the MMA reads shared memory through the async
proxy). The signal lags the issue by LAG stages so that LAG + 1 stages of copies are in flight; at
the end of every tile the producer drains (waits for all its copies, signals the stages not yet
signalled), so a tile change or a tile without k-steps never leaves a stage unsignalled. How large
LAG may be depends on when the consumer releases a stage (see each kernel file).

Legend: ROWS x COLS the gathered block; ``idx_ptr[lo + r]`` the source row of block row r; rows at
or past ``cnt`` and columns at or past ``col_lim`` load zeros (masked ``cp.async``).
"""

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx


@triton.jit
def gather_ptrs(base_ptr, idx_ptr, lo, r0, cnt, stride_row, c0, col_lim, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Pointers ``[ROWS, COLS]`` to ``base[idx[lo + r0 + r], c0 + c]`` and their mask (row ``r0 + r <
    cnt``, column ``c0 + c < col_lim``); masked rows read index 0 (never dereferenced)."""
    r = r0 + tl.arange(0, ROWS)
    ok = r < cnt
    rows = tl.load(idx_ptr + lo + r, mask=ok, other=0).to(tl.int64)
    cols = c0 + tl.arange(0, COLS)
    ptrs = base_ptr + rows[:, None] * stride_row + cols[None, :]
    return ptrs, ok[:, None] & (cols < col_lim)[None, :]


@triton.jit
def row_ptrs(base_ptr, rows, ok, stride_row, c0, col_lim, COLS: tl.constexpr):
    """As :func:`gather_ptrs` for row indices already loaded (``rows``, valid where ``ok``): the dW
    kernels load the next step's indices one step ahead."""
    cols = c0 + tl.arange(0, COLS)
    ptrs = base_ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    return ptrs, ok[:, None] & (cols < col_lim)[None, :]


@triton.jit
def signal_gathered(it, k, LAG: tl.constexpr, NUM_STAGES: tl.constexpr, afull):
    """After issuing stage ``it`` (step ``k`` of its tile): stage ``it - LAG`` has landed; publish it."""
    if k >= LAG:
        tlx.async_load_wait_group(LAG)
        tlx.fence_async_shared()
        tlx.barrier_arrive(afull[(it - LAG) % NUM_STAGES])


@triton.jit
def drain_gathered(it, steps, LAG: tl.constexpr, NUM_STAGES: tl.constexpr, afull):
    """End of a tile of ``steps`` stages (``it`` one past its last): wait for every copy of this
    thread and publish the stages not yet signalled."""
    tlx.async_load_wait_group(0)
    tlx.fence_async_shared()
    for j in range(tl.maximum(steps - LAG, 0), steps):
        tlx.barrier_arrive(afull[(it - steps + j) % NUM_STAGES])
