#!/usr/bin/env bash
# Session 11, two GPUs, one call (< 6 min):  source .carry/setup.sh && bash scripts/device/x2_s19.sh
# A (two GPUs): the exchange's new launch shapes (symm._DEFAULT_SHAPES: send 4 x 1024 tiles, the
#   reductions 16 programs per SM; from x2_s18's sweep): T5 on peer pointers, then the W=2 grid.
# B (one GPU each, side by side): the one-launch router (tlx/portable/router.py, written this
#   session, not yet run on a GPU): GPU 0 its GPU tests, then the layer table with it off / on;
#   GPU 1 memcheck of its kernels, then the layer GPU tests with it forced on.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
t5_peer
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64,256 --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1
echo "== dispatch W=2 (new launch shapes) rc=$? [$(( $(date +%s)-t0 ))s]"
grep -A 30 "^W=2" "$out/dispatch_w2.log" | grep -E "^(provider|nccl|rows|regions)"
t0=$(date +%s)
(
  CUDA_VISIBLE_DEVICES=0 TLX_DIST_ROUTER_KERNEL=1 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 80 tests/test_router_gpu.py > "$out/gpu_router.log" 2>&1
  echo "== router GPU tests rc=$? $(tail -n 1 "$out/gpu_router.log")" > "$out/step_router.txt"
  for rk in 0 1; do
    CUDA_VISIBLE_DEVICES=0 TLX_DIST_ROUTER_KERNEL=$rk timeout 60 python3 bench/moe_layer.py \
      --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite --tokens 4096,16384 --latency-tokens "" --reps 7 \
      --providers fused,torchtitan --json "$out/moe_layer_router$rk.json" > "$out/moe_layer_router$rk.log" 2>&1
    echo "== moe_layer, TLX_DIST_ROUTER_KERNEL=$rk rc=$?" >> "$out/step_router.txt"
  done
) &
p0=$!
(
  CUDA_VISIBLE_DEVICES=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 80 compute-sanitizer --tool memcheck \
    --error-exitcode 1 python3 scripts/memcheck_router.py > "$out/memcheck_router.log" 2>&1
  echo "== memcheck router rc=$? $(grep -E 'ERROR SUMMARY|all ok|MISMATCH' "$out/memcheck_router.log" | tr '\n' ' ')" \
    > "$out/step_gpu1.txt"
  CUDA_VISIBLE_DEVICES=1 TLX_DIST_ROUTER_KERNEL=1 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 90 tests/test_moe_gpu.py > "$out/gpu_moe_router.log" 2>&1
  echo "== layer GPU tests, router kernel on rc=$? $(tail -n 1 "$out/gpu_moe_router.log")" >> "$out/step_gpu1.txt"
) &
wait $p0; wait
echo "== router steps [$(( $(date +%s)-t0 ))s]"
cat "$out/step_router.txt" "$out/step_gpu1.txt"
grep -E "^(FAILED|ERROR)" "$out/gpu_router.log" "$out/gpu_moe_router.log" | cut -c1-300 | head -n 8
for rk in 0 1; do echo "-- router kernel $rk"; grep -E "^\| [a-z]" "$out/moe_layer_router$rk.log"; done
