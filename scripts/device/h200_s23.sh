#!/usr/bin/env bash
# Session 16, one GPU (< 4.5 min):  source .carry/setup.sh && bash scripts/device/h200_s23.sh
# The emulated world's tiers not yet run at this session's code: the fused EP pipeline's row form (its
# combine_rows now sums by the per-block counters, "blocks"), the W = 1 layer under graph capture, capacity
# overflow, W = 8.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -rfE tests/test_fused_ep_gpu.py \
  > "$out/fused_ep.log" 2>&1
echo "== fused EP (emulated) rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/fused_ep.log")"
grep -E "^(FAILED|ERROR)" "$out/fused_ep.log" | cut -c1-300 | head -n 6
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 -rfE tests/test_symm_gpu.py \
  -k "layer_fwd_bwd or capacity_overflow or one_expert-8" > "$out/symm.log" 2>&1
echo "== symm (emulated, W=1 layer) rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/symm.log")"
grep -E "^(FAILED|ERROR)" "$out/symm.log" | cut -c1-300 | head -n 6
exit 0
