#!/usr/bin/env bash
# Session 14, two GPUs, one call (< 7 min):  source .carry/setup.sh && bash scripts/device/x2_s31.sh
# 1. (in parallel) GPU 0: the bulk-copy send in the emulated world (rows bit for bit the register path's,
#    the copying form vs the reference) and the fused EP tiers (the dout copy now on at every F, also in
#    the EP backward; the overlapped form with the bulk send); fused vs separate vs fp64 with the new
#    defaults. GPU 1: the layer table at the new defaults (dout copied at every F), and OLMoE / Qwen3
#    with the dout gathered, both T.
# 2. Two ranks: T5 on peer pointers with TLX_DIST_EXCHANGE_BULK=6 (every send that can takes the bulk
#    path), then the send's launch shapes with and without bulk copies (bench/exchange_tiles.py, each
#    checked against the all-to-all anchor first; issue 8's >= 350 GB/s per direction at T=16384).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 \
    tests/test_symm_gpu.py tests/test_fused_ep_gpu.py tests/test_fused_moe_gpu.py \
    -k "bulk or rows_world_fwd_bwd or overlapped_rows or (fused_vs_separate and not pingpong and not xcopy)" \
    > "$out/gpu_tests.log" 2>&1; echo $? > "$out/gpu_tests.rc" ) &
p1=$!
( CUDA_VISIBLE_DEVICES=1 timeout 120 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens "" --reps 5 \
    --providers fused,torchtitan --json "$out/layer.json" > "$out/layer.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 TLX_DIST_FUSED_DOUT=gather timeout 60 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b \
    --tokens 4096,16384 --latency-tokens "" --reps 5 --providers fused,torchtitan --json "$out/layer_gather.json" \
    > "$out/layer_gather.log" 2>&1 ) &
p2=$!
wait $p1; wait $p2
echo "== GPU 0: bulk send (emulated), fused EP, fused vs separate vs fp64 rc=$(cat "$out/gpu_tests.rc") [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_tests.log" | cut -c1-300 | head -n 8
echo "== GPU 1: layer, new defaults (dout copied at every F)"
grep -E "^\| [a-z]|median" "$out/layer.log" | head -n 13
grep -qE "^\| [a-z]" "$out/layer.log" || grep -E "TF/s|failed" "$out/layer.log"
echo "== GPU 1: OLMoE / Qwen3 with the dout gathered"
grep -E "^\| [a-z]|median" "$out/layer_gather.log" | head -n 6
if grep -qE "(FAILED|ERROR).*bulk|Timeout" "$out/gpu_tests.log"; then
  echo "== the bulk send failed in the emulated world: no bulk runs on two GPUs"; exit 0
fi
t0=$(date +%s)
TLX_DIST_EXCHANGE_BULK=6 timeout 150 torchrun --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider \
  > "$out/t5_bulk.log" 2>&1
echo "== T5 peer pointers, bulk send rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed|error' "$out/t5_bulk.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$out/t5_bulk.log" | cut -c1-300 | head -n 6
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "default;send:4x1024w4p4B3;send:4x1024w4p2B6;send:4x1024w4p1B10;send:4x1024w4p2;send:16x1024w4p2B6" \
  --json "$out/exchange_tiles.json" > "$out/exchange_tiles.log" 2>&1
echo "== exchange: the send with / without bulk copies rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error|mismatch" "$out/exchange_tiles.log" | head -n 20
exit 0
