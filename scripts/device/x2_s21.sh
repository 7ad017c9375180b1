#!/usr/bin/env bash
# Session 12, two GPUs, one call (< 9 min):  source .carry/setup.sh && bash scripts/device/x2_s21.sh
# The arrival-driven overlap (issue 9 item 3, SymmDispatcher(overlap=True)) on real GPUs for the first time:
# 1. GPU 0: the fused EP tier (the overlapped form in the emulated world W=2/4 against the plain one, the
#    phased gate/up GEMM bit for bit against one launch) and the exchange tier (route blocks of 32 tokens
#    for T <= 1024 now); GPU 1 meanwhile: the layer GPU tests (router kernel on by default now).
# 2. T5 on peer pointers: the overlapped layer against all-to-all, three steps + a CUDA-graph replay, and
#    the other fused-EP / row-form tests.
# 3. bench/moe_layer.py (torchrun): regions + static capacity without / with the overlap, SM budget 16 / 32.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 250 \
  tests/test_fused_ep_gpu.py tests/test_symm_gpu.py \
  -k "not (random-8 or zero_token_experts-8 or heavy_imbalance-8 or one_expert-8)" > "$out/gpu_tiers.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 250 \
  tests/test_moe_gpu.py tests/test_router_gpu.py > "$out/gpu_layer.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "== GPU tiers (fused EP + exchange) rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
echo "== GPU layer + router rc=$r2 $(tail -n 1 "$out/gpu_layer.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_layer.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  tests/test_symm_multigpu.py -k "overlapped or fused_ep or row_form" > "$out/t5_peer.log" 2>&1
echo "== T5 peer (overlap, fused EP, row form) rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error" "$out/t5_peer.log" | cut -c1-300 | head -n 8
for sms in 32 16; do
  t0=$(date +%s)
  TLX_DIST_EP_OVERLAP_SMS=$sms timeout 110 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py \
    --shapes olmoe,deepseek-v3 --tokens 4096,16384 --reps 9 \
    --providers fused_ep_regions,fused_ep_static,fused_ep_overlap,all_to_all \
    --json "$out/moe_ep_overlap_$sms.json" > "$out/moe_ep_overlap_$sms.log" 2>&1
  echo "== EP layer, overlap SMs=$sms rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^\||failed" "$out/moe_ep_overlap_$sms.log" | head -n 12
done
