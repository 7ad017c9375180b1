#!/usr/bin/env bash
# Session 7 one-GPU calls (carry .carry):  source .carry/setup.sh && bash scripts/device/h200_s9.sh A|B
#   A: the fused GPU tiers after the launcher fix (h=None), then h200_1gpu for 200 steps with torch's
#      fused AdamW against train.optimizer=adamw_bf16_grads (issue 10: 45% MFU, loss curve unchanged).
#   B: memcheck of the fused kernels, the recipe's step profile with the corrected device window
#      (30 steps, now on adamw_bf16_grads), OLMoE layer latency eager/graph at T=1024/4096.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
if [ "${1:-A}" = A ]; then
  t0=$(date +%s)
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/test_fused_ep_gpu.py \
    tests/test_fused_moe_gpu.py > "$out/fused_gpu.log" 2>&1
  echo "== fused GPU tiers rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/fused_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$out/fused_gpu.log" | cut -c1-200 | head
  for o in adamw_bf16_grads adamw; do
    t0=$(date +%s)
    prof=""; [ $o = adamw_bf16_grads ] && prof="--profile 3"
    timeout 190 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
      --override train.steps=200 --override train.log_every=20 --override metrics.progress=false \
      --override train.optimizer=$o --override metrics.out_dir=/tmp/run_$o $prof > "$out/train_$o.log" 2>&1
    echo "== train optimizer=$o rc=$? [$(( $(date +%s)-t0 ))s]"
    grep -A 12 "^step profile" "$out/train_$o.log"; grep -E "^step +[0-9]+/" "$out/train_$o.log" | cut -c1-150
    grep -E "Error|error" "$out/train_$o.log" | tail -n 3
  done
  exit 0
fi
t0=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/memcheck_fused.py > "$out/memcheck_fused.log" 2>&1
echo "== memcheck fused rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok|FAILED' "$out/memcheck_fused.log" | tr '\n' ' ')"
grep -A 8 "FAILED" "$out/memcheck_fused.log" | head -n 12
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
  --override train.steps=30 --override train.log_every=10 --override metrics.progress=false \
  --override metrics.out_dir=/tmp/run_prof --profile 3 > "$out/train_prof.log" 2>&1
echo "== train profile rc=$? [$(( $(date +%s)-t0 ))s]"
grep -A 16 "^step profile" "$out/train_prof.log"; grep -E "^step +[0-9]+/" "$out/train_prof.log" | cut -c1-150
t0=$(date +%s)
timeout 210 python3 bench/moe_layer.py --shapes olmoe --tokens "" --latency-tokens 1024,4096 \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1
echo "== layer latency rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_latency.log"; tail -n 3 "$out/moe_latency.log"
