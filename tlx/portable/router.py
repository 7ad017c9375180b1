"""The MoE router after its GEMM, in one launch forward and one backward (stock Triton).

Legend: T tokens, E experts (EP: next power of two), K top-k, BT tokens per program. Per token row
of fp32 logits ``l``:

    p    = softmax(l) (SOFTMAX) | sigmoid(l)          scores
    sel  = p + bias (HAS_BIAS)                          selection only
    idx  = the K largest sel, descending (iterative arg-max; a NaN entry ranks below every number,
           a picked one below everything, so the K picks are distinct even in a NaN row)
    gate = p[idx] (/ sum_k p[idx], ROUTE_NORM) * scale
    fin  = every logit of the row finite

and per program (block b) the partial sums the load-balancing losses need, written to
``part[b, :]`` (fp32; summed in fp64 in a fixed order by ``_router_sums_kernel``, so deterministic):

    [0, E)      sum over fin rows of q_e (q = p for softmax, p / sum_e p for sigmoid)
    [E, 2E)     slots of fin rows per expert
    [2E, 3E)    slots of all rows per expert (the dispatch counts)
    3E          fin rows
    3E + 1      sum over fin rows of logsumexp(l)^2

``_router_bwd_kernel`` recomputes p from the logits and returns dL/dl for given dL/dgate [T, K],
dL/d(part[:, :E] summed) [E] and dL/d(part[:, 3E+1] summed) (a one-element tensor): the gates' gradient through
the normalisation and the gather, the aux loss's through q (fin rows only), the z loss's through
logsumexp (fin rows only), then the score function's Jacobian. A non-finite row adds nothing to
the losses or their gradients. Unlike torch.topk (which ranks NaN first), a NaN score ranks last:
a softmax row with a NaN or +inf logit is all NaN (its gates and gradient too, as with torch); a
sigmoid row routes around its NaN entries, whose own logit gradient is NaN (0 * NaN).
Reference: ``tlx_dist.router.Router(kernel=False)`` (the torch ops)."""

import triton
import triton.language as tl
from tlx import c_launch as _c_launch


@triton.jit
def _scores(l, cm, SOFTMAX: tl.constexpr):
    """(p, lse) of a [BT, EP] logit tile (columns past E hold -inf)."""
    m = tl.max(l, axis=1)
    ex = tl.where(cm, tl.exp(l - m[:, None]), 0.0)
    s = tl.sum(ex, axis=1)
    lse = m + tl.log(s)
    if SOFTMAX:
        p = ex / s[:, None]
    else:
        p = tl.where(cm, 1.0 / (1.0 + tl.exp(-l)), 0.0)
    return p, ex / s[:, None], lse


@triton.jit
def _finite_rows(l, cm, tm):
    bad = cm & ((l != l) | (tl.abs(l) == float("inf")))
    return tm & (tl.sum(bad.to(tl.int32), axis=1) == 0)


@triton.jit
def _router_fwd_kernel(logits_ptr, bias_ptr, idx_ptr, gate_ptr, part_ptr, T, scale,
                       E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                       SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr,
                       BT: tl.constexpr):
    b = tl.program_id(0)
    t = b * BT + tl.arange(0, BT)
    e = tl.arange(0, EP)
    tm = t < T
    cm = (e < E)[None, :]
    m2 = tm[:, None] & cm
    l = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=m2, other=float("-inf"))
    p, sm, lse = _scores(l, cm, SOFTMAX)
    fin = _finite_rows(l, cm, tm)
    sel = p
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
    # rank keys: picked < padding column < NaN < any number
    key = tl.where(sel != sel, -3.0e38, sel)
    key = tl.where(cm, key, float("-inf"))
    taken = tl.zeros([BT, EP], tl.int1)
    kk = tl.arange(0, KP)
    idx_t = tl.zeros([BT, KP], tl.int64)
    g_t = tl.zeros([BT, KP], tl.float32)
    for k in range(K):
        kv = tl.where(taken, float("-inf"), key)
        j = tl.argmax(kv, axis=1)
        hit = e[None, :] == j[:, None]
        taken = taken | hit
        gk = tl.sum(tl.where(hit, p, 0.0), axis=1)
        idx_t = tl.where(kk[None, :] == k, j.to(tl.int64)[:, None], idx_t)
        g_t = tl.where(kk[None, :] == k, gk[:, None], g_t)
    if ROUTE_NORM:
        g_t = g_t / (tl.sum(g_t, axis=1)[:, None] + 1e-20)
    g_t = g_t * scale
    om = tm[:, None] & (kk < K)[None, :]
    off = t.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(idx_ptr + off, idx_t, mask=om)
    tl.store(gate_ptr + off, g_t, mask=om)
    # the losses' partial sums over this block's finite rows, and every row's slot counts
    if SOFTMAX:
        q = p
    else:
        q = p / (tl.sum(p, axis=1)[:, None] + 1e-20)
    fin2 = fin[:, None] & cm
    row = part_ptr + b.to(tl.int64) * (3 * E + 2)
    tl.store(row + e, tl.sum(tl.where(fin2, q, 0.0), axis=0), mask=e < E)
    tl.store(row + E + e, tl.sum((taken & fin2).to(tl.float32), axis=0), mask=e < E)
    tl.store(row + 2 * E + e, tl.sum((taken & m2).to(tl.float32), axis=0), mask=e < E)
    tl.store(row + 3 * E, tl.sum(fin.to(tl.float32), axis=0))
    tl.store(row + 3 * E + 1, tl.sum(tl.where(fin, lse * lse, 0.0), axis=0))


@triton.jit
def _router_bwd_kernel(logits_ptr, idx_ptr, g_gate_ptr, g_q_ptr, g_z_ptr, dl_ptr, T, scale,
                       E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                       SOFTMAX: tl.constexpr, ROUTE_NORM: tl.constexpr, HAS_GGATE: tl.constexpr,
                       HAS_GQ: tl.constexpr, HAS_GZ: tl.constexpr, BT: tl.constexpr):
    b = tl.program_id(0)
    t = b * BT + tl.arange(0, BT)
    e = tl.arange(0, EP)
    tm = t < T
    cm = (e < E)[None, :]
    m2 = tm[:, None] & cm
    l = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=m2, other=float("-inf"))
    p, sm, lse = _scores(l, cm, SOFTMAX)
    fin = _finite_rows(l, cm, tm)
    fin2 = fin[:, None] & cm
    dp = tl.zeros([BT, EP], tl.float32)
    if HAS_GGATE:
        kk = tl.arange(0, KP)
        om = tm[:, None] & (kk < K)[None, :]
        off = t.to(tl.int64)[:, None] * K + kk[None, :]
        idx = tl.load(idx_ptr + off, mask=om, other=-1)
        g = tl.load(g_gate_ptr + off, mask=om, other=0.0) * scale
        # the selected scores, in slot order
        sel = tl.zeros([BT, KP], tl.float32)
        for k in range(K):
            ik = tl.sum(tl.where(kk[None, :] == k, idx, 0), axis=1)
            pk = tl.sum(tl.where(e[None, :] == ik[:, None], p, 0.0), axis=1)
            sel = tl.where(kk[None, :] == k, pk[:, None], sel)
        if ROUTE_NORM:
            S = tl.sum(sel, axis=1)[:, None] + 1e-20
            dsel = g / S - (tl.sum(g * sel, axis=1)[:, None]) / (S * S)
        else:
            dsel = g
        for k in range(K):
            ik = tl.sum(tl.where(kk[None, :] == k, idx, 0), axis=1)
            dk = tl.sum(tl.where(kk[None, :] == k, dsel, 0.0), axis=1)
            dp += tl.where(e[None, :] == ik[:, None], dk[:, None], 0.0)
    if HAS_GQ:
        gq = tl.where(fin2, tl.load(g_q_ptr + e, mask=e < E, other=0.0)[None, :], 0.0)
        if SOFTMAX:
            dp += gq
        else:  # q = p / (sum p + eps), finite rows only (a NaN score would spread NaN over the row)
            pf = tl.where(fin2, p, 0.0)
            S = tl.sum(pf, axis=1)[:, None] + 1e-20
            dp += gq / S - tl.sum(gq * pf, axis=1)[:, None] / (S * S)
    if SOFTMAX:
        dl = p * (dp - tl.sum(tl.where(cm, dp * p, 0.0), axis=1)[:, None])
    else:
        dl = dp * p * (1.0 - p)
    if HAS_GZ:  # d(lse^2)/dl = 2 lse softmax(l); the scalar's gradient read on the device (no sync)
        g_z = tl.load(g_z_ptr)
        dl += tl.where(fin2, (2.0 * g_z) * lse[:, None] * sm, 0.0)
    tl.store(dl_ptr + t.to(tl.int64)[:, None] * E + e[None, :], dl, mask=m2)


@triton.jit
def _router_sums_kernel(part_ptr, NB, q_ptr, fin_ptr, slots_ptr, nfin_ptr, zsum_ptr,
                        E: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """The forward's block partials summed over the ``NB`` blocks in fp64, in a fixed order (so
    deterministic), and written out in the outputs' dtypes: ``q [E]`` fp32, ``fin [E]`` fp32,
    ``slots [E]`` int64 (exact: counts), ``nfin`` and ``zsum`` fp32 scalars. grid = cdiv(3E+2, BC)
    column blocks; each walks the rows BR at a time."""
    C: tl.constexpr = 3 * E + 2
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = c < C
    acc = tl.zeros([BC], tl.float64)
    for r0 in range(0, NB, BR):
        r = r0 + tl.arange(0, BR)
        v = tl.load(part_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=(r < NB)[:, None] & cm[None, :],
                    other=0.0)
        acc += tl.sum(v.to(tl.float64), axis=0)
    tl.store(q_ptr + c, acc.to(tl.float32), mask=c < E)
    tl.store(fin_ptr + (c - E), acc.to(tl.float32), mask=(c >= E) & (c < 2 * E))
    tl.store(slots_ptr + (c - 2 * E), acc.to(tl.int64), mask=(c >= 2 * E) & (c < 3 * E))
    tl.store(nfin_ptr + (c - 3 * E), acc.to(tl.float32), mask=c == 3 * E)
    tl.store(zsum_ptr + (c - 3 * E - 1), acc.to(tl.float32), mask=c == 3 * E + 1)


# Launched every step (eager): fbtriton's C launch path (tlx.c_launch) once compiled.
_c_launch(_router_fwd_kernel)
_c_launch(_router_bwd_kernel)
_c_launch(_router_sums_kernel)
