#!/usr/bin/env bash
# Session 11, two GPUs, one call (< 8 min):  source .carry/setup.sh && bash scripts/device/x2_s18.sh
# 1. Issue 8's bandwidth target (>= 350 GB/s per direction at T=16384) is missed by the send (681 us,
#    345 GB/s alone) and the combine's kernels (reduce_send 699 + reduce_recv 193 us): all launch
#    4 programs per SM of 4 warps over 8 x 512 tiles, so at most 16 warps per SM move rows. Sweep
#    their launch shapes (tile, warps, programs per SM) with bench/exchange_tiles.py, graph-replayed,
#    ranks aligned, each shape checked against the all-to-all anchor first.
# 2. One GPU: the defaults flipped after h200_s15.sh (the one-launch layout on, dSwiGLU EARLY_H on):
#    the fused + layer GPU tests with nothing forced, and the layer table at every shape (incl.
#    Mixtral and DeepSeek-V3 per rank) against the torchtitan-style layer, eager.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --json "$out/exchange_tiles.json" > "$out/exchange_tiles.log" 2>&1
echo "== exchange launch shapes rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error" "$out/exchange_tiles.log" | head -n 40
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 160 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 \
  tests/test_fused_moe_gpu.py tests/test_moe_gpu.py > "$out/gpu_tiers_fused.log" 2>&1
echo "== fused + layer GPU tests, defaults rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers_fused.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tiers_fused.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 110 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens "" --reps 7 \
  --providers fused,torchtitan --json "$out/moe_layer.json" > "$out/moe_layer.log" 2>&1
echo "== moe_layer, every shape rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]|median" "$out/moe_layer.log"
