#!/usr/bin/env bash
# Session 10, one GPU, one call (~6 min):  source .carry/setup.sh && bash scripts/device/h200_s14.sh
# The GEMM-side kernels now launch through fbtriton's C path by default (tlx.c_launch): the GPU
# tiers of the fused, grouped-GEMM and layer kernels under it; the host enqueue of one eager OLMoE
# T=1024 fwd+bwd with it off (TLX_DIST_C_LAUNCH=0) and on; then where the GPU idles in one eager
# fwd+bwd (bench/_profile.gap_profile) beside the T=4096 / 16384 table of the three small-expert shapes.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/test_fused_moe_gpu.py \
  tests/test_grouped_gemm_gpu.py tests/test_moe_gpu.py > "$out/gpu_tiers.log" 2>&1
echo "== GPU tiers (C launch on) rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
for cl in 0 1; do
  t0=$(date +%s)
  TLX_DIST_C_LAUNCH=$cl timeout 50 python3 bench/moe_layer.py --shapes olmoe --tokens 1024 --latency-tokens "" \
    --reps 3 --host-profile --providers fused,torchtitan --json "$out/host_cl$cl.json" > "$out/host_cl$cl.log" 2>&1
  echo "== host enqueue, TLX_DIST_C_LAUNCH=$cl rc=$? [$(( $(date +%s)-t0 ))s]"; grep -B1 "host enqueue" "$out/host_cl$cl.log"
done
t0=$(date +%s)
timeout 150 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite --tokens 4096,16384 \
  --latency-tokens "" --reps 7 --gaps --providers fused,torchtitan --json "$out/moe_layer.json" > "$out/moe_layer.log" 2>&1
echo "== moe_layer + gaps rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\|" "$out/moe_layer.log"
grep -A 7 "GPU idle" "$out/moe_layer.log" | grep -E "idle|step:|^ +[0-9]" | cut -c1-230 | head -n 60
