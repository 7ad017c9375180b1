#!/usr/bin/env bash
# Session 13, final two-GPU call (< 9 min):  source .carry/setup.sh && bash scripts/device/x2_s29.sh
# The scatter form's new default (EPI_WG: its epilogue in a fourth warp group, 5 stages) and the dW GROUP_M
# rule, through every fused / EP / layer GPU tier and T5; the layer table against the torchtitan-style
# layer with the new defaults (GPU 1), and with the old scatter config (GPU 0, after the tiers).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
OLD="scatter:EPI_WG=0,REGS=232,STAGES=4"
t0=$(date +%s)
( CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
    tests/test_fused_moe_gpu.py tests/test_fused_ep_gpu.py tests/test_moe_gpu.py > "$out/gpu_tiers.log" 2>&1
  echo $? > "$out/gpu_tiers.rc"
  CUDA_VISIBLE_DEVICES=0 TLX_DIST_FUSED_CONFIG="$OLD" timeout 110 python3 bench/moe_layer.py \
    --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite,deepseek-v3-rank --tokens 16384 --latency-tokens "" --reps 5 \
    --providers fused,torchtitan --json "$out/layer_old_scatter.json" > "$out/layer_old_scatter.log" 2>&1 ) &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout 330 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens "" --reps 5 \
  --providers fused,torchtitan --json "$out/layer.json" > "$out/layer.log" 2>&1 &
p2=$!
wait $p1; wait $p2; r2=$?
echo "== GPU tiers (fused, fused EP, layer) rc=$(cat "$out/gpu_tiers.rc") [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_tiers.log" | cut -c1-300 | head -n 10
echo "== layer, new defaults (GPU 1) rc=$r2"
grep -E "^\| [a-z]|^Medians|median" "$out/layer.log" | head -n 14
echo "== layer, old scatter config (GPU 0)"
grep -E "^\| [a-z]" "$out/layer_old_scatter.log" | head -n 6
t5_peer
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
exit 0
