#!/usr/bin/env bash
# Session 15, one GPU (< 3 min):  source .carry/setup.sh && bash scripts/device/h200_s21.sh
# memcheck of the router kernels (the new one-launch block sums: E 64..256 -> 1..4 column-block programs).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 170 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_router_gpu.py -k "matches_torch and 333" > "$out/memcheck_router.log" 2>&1
echo "== memcheck: router kernels (T 333, four configs) rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|passed|failed' "$out/memcheck_router.log" | tail -n 2 | tr '\n' ' ')"
exit 0
