#!/usr/bin/env bash
# Session 14, one GPU, last call (< 3 min):  source .carry/setup.sh && bash scripts/device/h200_s18.sh
# A third sample of the shapes at issue 9's line (DeepSeek-V2-Lite, Qwen3-30B-A3B at T=4096; OLMoE beside
# them) at the final defaults, 7 reps; then the gathered-dout GPU tests the last call cut short.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 80 python3 bench/moe_layer.py --shapes deepseek-v2-lite,qwen3-30b-a3b,olmoe --tokens 4096,16384 \
  --latency-tokens "" --reps 7 --providers fused,torchtitan --json "$out/layer.json" > "$out/layer.log" 2>&1
echo "== layer rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]|median" "$out/layer.log" | head -n 9
grep -qE "^\| [a-z]" "$out/layer.log" || grep -E "TF/s|failed" "$out/layer.log"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 80 tests/test_fused_moe_gpu.py \
  -k "fused_vs_separate and gather" > "$out/gpu_gather.log" 2>&1
echo "== GPU fused vs separate vs fp64, dout gathered rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_gather.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_gather.log" | cut -c1-300 | head -n 6
exit 0
