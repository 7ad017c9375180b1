#!/usr/bin/env bash
# Session 15, one GPU (< 8 min):  source .carry/setup.sh && bash scripts/device/h200_s19.sh
# 1. GPU tests of this session's host-cost changes with fbtriton's C dispatcher on (TLX_DIST_C_DISPATCH=1):
#    the router (its one-launch block sums), the grouped dW with a handed-in order / trusted offsets, the
#    fused primitives, graph capture, the dout-copy fused-vs-fp64 cases (dW2 through the trusted grouped dW),
#    the overlapped EP form with the bulk send (its corrected spy).
# 2. Host enqueue and layer ratio, DeepSeek-V2-Lite / OLMoE T=4096, C dispatcher off / on / off / on.
# 3. The five-shape layer table with the dispatcher on.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
TLX_DIST_C_DISPATCH=1 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 \
  tests/test_router_gpu.py tests/test_grouped_gemm_gpu.py tests/test_fused_moe_gpu.py tests/test_fused_ep_gpu.py \
  -k "router or lpt or primitives_vs_fp64 or graph_capture or layer_fused_vs_separate or layout_kernel or (fused_vs_separate and copy and not pingpong and not xcopy) or (overlapped_rows and 4-random-4)" \
  > "$out/gpu_tests.log" 2>&1
echo "== GPU tests, C dispatcher on rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|Timeout|UserWarning: \[Triton\]" "$out/gpu_tests.log" | cut -c1-300 | sort | uniq -c | head -n 10
for r in 0a 1a 0b 1b; do
  d=${r:0:1}
  TLX_DIST_C_DISPATCH=$d timeout 70 python3 bench/moe_layer.py --shapes deepseek-v2-lite,olmoe --tokens 4096 \
    --latency-tokens "" --reps 7 --providers fused,torchtitan --host-profile > "$out/host_$r.log" 2>&1
  echo "== C dispatch $d rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "host enqueue|^\| [a-z]" "$out/host_$r.log" | grep -v "^| shape" | head -n 8
done
TLX_DIST_C_DISPATCH=1 timeout 100 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens "" --reps 7 \
  --providers fused,torchtitan --json "$out/layer.json" > "$out/layer.log" 2>&1
echo "== layer, five shapes, C dispatcher on rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]" "$out/layer.log" | head -n 12
exit 0
