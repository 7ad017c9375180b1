#!/usr/bin/env bash
# Session 8, two GPUs, one call:  source .carry/setup.sh && bash scripts/device/x2_s11.sh
# After the row form's own-rows bypass and the few-row wide tiles (exchange), and the bench's
# capture fix (moe_layer): GPU 0 runs the exchange + fused-EP GPU tiers while GPU 1 runs the layer
# latency bench (eager + CUDA graph); then T5 on peer pointers, the W=2 dispatch grid, and the
# MoE-layer test over NVSHMEM (each GPU its own node).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_fused_ep_gpu.py \
  tests/test_symm_gpu.py -k "not (random-8 or zero_token_experts-8 or heavy_imbalance-8 or one_expert-8)" \
  > "$out/gpu_tiers.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout 270 python3 bench/moe_layer.py --shapes olmoe --tokens "" --latency-tokens 1024,4096 \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "== GPU tiers rc=$r1, layer latency rc=$r2 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
grep -E "^\| (olmoe|shape)|graph_error|failed" "$out/moe_latency.log" | cut -c1-300 | tail -n 6
t5_peer
dispatch_w2
t5_nvshmem "moe_layer or skips" 150
exit 0
