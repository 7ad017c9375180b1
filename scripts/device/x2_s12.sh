#!/usr/bin/env bash
# Next two-GPU calls (written in session 8, not yet run), each < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s12.sh 1   # FIRST: validates the expanded form's own-rows change
#   source .carry/setup.sh && bash scripts/device/x2_s12.sh 2
# 1. GPU 0: the exchange + fused-EP GPU tiers (all 27); GPU 1: memcheck of every exchange kernel;
#    then T5 on peer pointers and the W=2 grid (symm_graph is the form that changed);
# 2. T5 on the NVSHMEM route (all 7), the EP=2 layer bench (fused EP vs separate over symm vs
#    all-to-all, OLMoE T=16384/rank), and EP=2 training, moe_pipeline fused vs separate (decides
#    whether pipeline="auto" should take the fused EP layer).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
if [ "${1:-1}" = 1 ]; then
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
    tests/test_symm_gpu.py tests/test_fused_ep_gpu.py > "$out/gpu_tiers.log" 2>&1 &
  p1=$!
  CUDA_VISIBLE_DEVICES=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck \
    --error-exitcode 1 python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1 &
  p2=$!
  wait $p1; r1=$?; wait $p2; r2=$?
  echo "== GPU tiers rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
  echo "== memcheck exchange rc=$r2 $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
  t5_peer
  dispatch_w2
  exit 0
fi
t5_nvshmem "" 200
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== EP=2 layer (fused EP vs symm vs all-to-all) rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_layer_w2.log"
for p in fused separate; do train_ep2 "$p"; done
