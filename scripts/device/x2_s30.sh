#!/usr/bin/env bash
# Session 13, last call (< 4 min):  source .carry/setup.sh && bash scripts/device/x2_s30.sh
# TLX_DIST_FUSED_DOUT=copy: the backward copies dout's rows expert-major once, then dSwiGLU reads them in
# place by TMA and dW2 is the plain grouped dW. GPU 1: its GPU tests (fused vs separate vs fp64, both dout
# modes) then the layer against the torchtitan-style layer with copy; GPU 0: the same layer table with the
# default (gather), side by side.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
SH=deepseek-v2-lite,olmoe,qwen3-30b-a3b,mixtral
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/moe_layer.py --shapes $SH --tokens 16384 --latency-tokens "" --reps 5 \
  --providers fused,torchtitan --json "$out/layer_gather.json" > "$out/layer_gather.log" 2>&1 &
p1=$!
( CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 \
    tests/test_fused_moe_gpu.py -k "fused_vs_separate" > "$out/gpu_dout.log" 2>&1
  echo $? > "$out/gpu_dout.rc"
  CUDA_VISIBLE_DEVICES=1 TLX_DIST_FUSED_DOUT=copy timeout 200 python3 bench/moe_layer.py --shapes $SH --tokens 16384 \
    --latency-tokens "" --reps 5 --providers fused,torchtitan --json "$out/layer_copy.json" > "$out/layer_copy.log" 2>&1 ) &
p2=$!
wait $p1; wait $p2
echo "== GPU fused vs separate vs fp64, dout gather + copy rc=$(cat "$out/gpu_dout.rc") [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_dout.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_dout.log" | cut -c1-300 | head -n 10
echo "== layer, dout gather (GPU 0)"
grep -E "^\| [a-z]|median" "$out/layer_gather.log" | head -n 8
echo "== layer, dout copy (GPU 1)"
grep -E "^\| [a-z]|median" "$out/layer_copy.log" | head -n 8
exit 0
