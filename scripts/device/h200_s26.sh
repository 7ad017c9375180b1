#!/usr/bin/env bash
# Session 17, one GPU (< 7 min):  source .carry/setup.sh && bash scripts/device/h200_s26.sh
# The exchange's GPU tier at the copy-engine row form's code (COMB as [W, T_max, D], the dense layout,
# the emulated world's copies by cuMemcpyAsync on one GPU) and the fused EP tier (its exchange changed).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 300 -rfE tests/test_symm_gpu.py \
  > "$out/symm.log" 2>&1
echo "== symm GPU tier rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/symm.log")"
grep -E "^(FAILED|ERROR)" "$out/symm.log" | cut -c1-300 | head -n 8
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 180 -rfE tests/test_fused_ep_gpu.py \
  > "$out/fused_ep.log" 2>&1
echo "== fused EP GPU tier rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/fused_ep.log")"
grep -E "^(FAILED|ERROR)" "$out/fused_ep.log" | cut -c1-300 | head -n 8
exit 0
