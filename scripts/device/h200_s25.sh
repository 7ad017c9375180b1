#!/usr/bin/env bash
# Session 17's first one-GPU call (< 4 min): the C dispatcher's context fix (tlx._bind_context, 5b45f62):
# the fresh-thread test, and tests/test_fused_ep_gpu.py run on its own (3 of its cases failed in
# h200_s23 with "invalid device context (201)" before the fix).
#   source .carry/setup.sh && bash scripts/device/h200_s25.sh
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE tests/test_c_launch.py \
  tests/test_fused_ep_gpu.py > "$out/ctx.log" 2>&1
echo "== context fix: fresh thread + fused EP alone rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/ctx.log")"
grep -E "^(FAILED|ERROR)" "$out/ctx.log" | cut -c1-300 | head -n 6
exit 0
