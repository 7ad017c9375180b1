#!/usr/bin/env bash
# Next two-GPU call (written in session 9, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s14.sh
# Validates and times session 9's static-capacity dispatch (the send waits only for readiness and
# sends raw slot codes; the expand kernel waits for the counts, computes the layout, decodes):
# GPU 0 the exchange + fused-EP GPU tiers (no W=8 cases), GPU 1 memcheck of every exchange kernel;
# then T5 on peer pointers (exact-capacity dispatch keeps the old flow: both are covered), the W=2
# grid (symm_graph / rows_graph are the static-capacity ops: targets T=128 <= 40 us, T=4096 <= 250),
# and the NVSHMEM route's dispatch tests (staged META carries the raw codes there too).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_fused_ep_gpu.py \
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
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
dispatch_w2
t5_nvshmem "matches_all_to_all" 150
exit 0
