#!/usr/bin/env bash
# Written in session 11 after its last device call (not yet run), two GPUs, one call (< 5 min):
#   source .carry/setup.sh && bash scripts/device/x2_s20.sh
# 1. The exchange sweep's second round (bench/exchange_tiles.py's grid): the copy-ahead loop (pipe:
#    a row's next column chunk loaded before this one is stored) in the send and the row-form
#    reduce_send at a few shapes, and the route kernel's tokens per block (16 / 32 / 64 against the
#    default 128 at T=128, where route takes ~12 us of the ~40 us dispatch), T = 128, 4096, 16384.
#    Land what beats `default` at every T in symm._DEFAULT_SHAPES / _route.
# 2. One GPU, nothing else running: the router kernel's GPU tests (the dW bound rewritten after
#    x2_s19), then the layer table with TLX_DIST_ROUTER_KERNEL=0 / 1 / 0 / 1 (repeats, to see past
#    the 5-10% run-to-run spread). Flip `auto` on for CUDA in tlx_dist/router.py if 1 wins both times.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 128,4096,16384 \
  --json "$out/exchange_tiles.json" > "$out/exchange_tiles.log" 2>&1
echo "== exchange launch shapes, round 2 rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error" "$out/exchange_tiles.log" | head -n 40
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 50 \
  tests/test_router_gpu.py > "$out/gpu_router.log" 2>&1
echo "== router GPU tests rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_router.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_router.log" | cut -c1-300 | head -n 8
for rk in 0 1 0 1; do
  CUDA_VISIBLE_DEVICES=0 TLX_DIST_ROUTER_KERNEL=$rk timeout 45 python3 bench/moe_layer.py \
    --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite --tokens 4096,16384 --latency-tokens "" --reps 9 \
    --providers fused,torchtitan --json "$out/moe_layer_rk$rk.json" > "$out/moe_layer_rk$rk.log" 2>&1
  echo "-- router kernel $rk rc=$?"; grep -E "^\| [a-z]" "$out/moe_layer_rk$rk.log"
done
