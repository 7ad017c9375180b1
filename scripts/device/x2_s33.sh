#!/usr/bin/env bash
# Session 15, two GPUs (< 5 min):  source .carry/setup.sh && bash scripts/device/x2_s33.sh
# Issue 8's targets again at the landed defaults: three samples of the exchange (W=2, D=7168, E=64, K=8,
# graph-replayed, T=4096 / 16384); the per-kernel split of one T=4096 dispatch / combine; and the link's
# SM-copy ceiling with 16 programs per SM (is ~329 GB/s per direction both ways the ceiling?); memcheck of
# the router kernels (the new one-launch block sums).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
for r in 1 2 3; do
  timeout 80 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
    --configs "default" --json "$out/exchange_$r.json" > "$out/exchange_$r.log" 2>&1
  echo "== exchange sample $r rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^\| default|Error|error|mismatch" "$out/exchange_$r.log" | head -n 4
done
timeout 60 python3 bench/p2p_copy.py --mb 235 --sm --programs 16 > "$out/p2p16.log" 2>&1
echo "== link ceiling, 16 programs per SM [$(( $(date +%s)-t0 ))s]"
grep -E "^\||SM kernels|Error" "$out/p2p16.log"
timeout 90 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 4096 --dims 7168 --experts 64 \
  --profile --no-rows --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch.py T=4096 with the per-kernel profile rc=$? [$(( $(date +%s)-t0 ))s]"
grep -vE "^\s*$|Warning|warn" "$out/dispatch.log" | tail -n 40
CUDA_VISIBLE_DEVICES=0 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_router_gpu.py -k "matches_torch and 333" > "$out/memcheck_router.log" 2>&1
echo "== memcheck: the router kernels incl. the block sums (E 64..256, T 333) rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|passed|failed' "$out/memcheck_router.log" | tail -n 2 | tr '\n' ' ')"
exit 0
