#!/usr/bin/env bash
# Written at the end of session 16 (not yet run). One GPU (< 9 min):
#   source .carry/setup.sh && bash scripts/device/h200_s24.sh
# 1. The C dispatcher's context fix (tlx._bind_context, 5b45f62): the fresh-thread test, and
#    tests/test_fused_ep_gpu.py run on its own (3 of its cases failed in h200_s23 with "invalid device
#    context (201)" before the fix).
# 2. The GPU tiers at session 16's final code (moe incl. torch.compile and graph capture, grouped GEMM,
#    fused, symm emulated incl. the per-block combine counters).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 180 -rfE tests/test_c_launch.py \
  tests/test_fused_ep_gpu.py > "$out/ctx.log" 2>&1
echo "== context fix: fresh thread + fused EP alone rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/ctx.log")"
grep -E "^(FAILED|ERROR)" "$out/ctx.log" | cut -c1-300 | head -n 6
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 300 -rfE tests/test_moe_gpu.py \
  tests/test_grouped_gemm_gpu.py tests/test_symm_gpu.py -k "not fused_vs_separate_vs_fp64" > "$out/tiers.log" 2>&1
echo "== GPU tiers rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/tiers.log")"
grep -E "^(FAILED|ERROR)" "$out/tiers.log" | cut -c1-300 | head -n 8
exit 0
