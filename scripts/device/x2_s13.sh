#!/usr/bin/env bash
# Session 9, two GPUs, one call:  source .carry/setup.sh && bash scripts/device/x2_s13.sh
# After the row form's block-by-block receive copy (RBLK counters; on real ranks the send kernel's
# last programs copy rows out as they land): GPU 0 runs the exchange + fused-EP GPU tiers (the
# emulated world's "blocks" mode) while GPU 1 runs memcheck over every exchange kernel; then T5 on
# peer pointers (the "overlap" mode, incl. the new row-form test), the W=2 dispatch grid, and the
# EP=2 layer bench.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_fused_ep_gpu.py \
  tests/test_symm_gpu.py -k "not (random-8 or zero_token_experts-8 or heavy_imbalance-8 or one_expert-8)" \
  > "$out/gpu_tiers.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck \
  --error-exitcode 1 python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "== GPU tiers rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
echo "== memcheck exchange rc=$r2 $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
t5_peer
grep -E "^(FAILED|ERROR)|Error|assert" "$out/t5_peer.log" | cut -c1-300 | head -n 8
dispatch_w2
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== EP=2 layer rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_layer_w2.log" | head -n 1
exit 0
