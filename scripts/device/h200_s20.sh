#!/usr/bin/env bash
# Session 15, one GPU (< 6 min):  source .carry/setup.sh && bash scripts/device/h200_s20.sh
# The C dispatcher is now the default: the router / layout / fused GPU tests at the defaults (no env),
# then three samples of issue 9's T=4096 shapes, one five-shape table, eager / graph-replayed latency.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 tests/test_router_gpu.py \
  tests/test_fused_moe_gpu.py tests/test_moe_gpu.py -k "router or graph_capture or layer_fused_vs_separate or layout_kernel or fwd_bwd_vs_fp64" \
  > "$out/gpu_tests.log" 2>&1
echo "== GPU tests at the defaults rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|Timeout|UserWarning: \[Triton\]" "$out/gpu_tests.log" | cut -c1-300 | sort | uniq -c | head -n 10
for r in 1 2 3; do
  timeout 60 python3 bench/moe_layer.py --shapes deepseek-v2-lite,qwen3-30b-a3b,olmoe --tokens 4096 \
    --latency-tokens "" --reps 7 --providers fused,torchtitan > "$out/t4096_$r.log" 2>&1
  echo "== T=4096 sample $r rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^\| [a-z]" "$out/t4096_$r.log" | grep -v "^| shape"
done
timeout 100 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens "" --reps 7 --providers fused,torchtitan \
  --json "$out/layer.json" > "$out/layer.log" 2>&1
echo "== layer, five shapes rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]" "$out/layer.log" | head -n 12
timeout 90 python3 bench/moe_layer.py --shapes deepseek-v2-lite,olmoe --tokens "" --latency-tokens 1024,4096 \
  --providers fused,torchtitan > "$out/latency.log" 2>&1
echo "== eager / graph-replayed latency rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]" "$out/latency.log" | head -n 8
exit 0
