#!/usr/bin/env bash
# Session 18, one GPU of the two-GPU host (< 5 min):  source .carry/setup.sh && bash scripts/device/x2_s50.sh
# The one-GPU tier where this session's changes reach: the copy-engine row form in the emulated world on
# one GPU (same-device copies, now in cut-down chunks), then the fused EP tier.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 140 -rfE -k "copy_engine or overflow" \
  tests/test_symm_gpu.py > "$out/symm.log" 2>&1
echo "== symm GPU tier (-k copy_engine or overflow) rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/symm.log")"
grep -E "^(FAILED|ERROR)" "$out/symm.log" | cut -c1-300 | head -n 8
timeout 180 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 170 -rfE tests/test_fused_ep_gpu.py \
  > "$out/fused_ep.log" 2>&1
echo "== fused EP GPU tier rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/fused_ep.log")"
grep -E "^(FAILED|ERROR)" "$out/fused_ep.log" | cut -c1-300 | head -n 8
exit 0
