#!/usr/bin/env bash
# Next one-GPU call (written in session 6, not yet run), < 10 min, <= 8 files in $OUT:
#   source .carry/setup.sh && bash scripts/device/h200_s8.sh 0   # FIRST: the route kernel changed on CPU
#        (sort-ranked slots, ~1024-slot blocks): exchange GPU tiers + memcheck + W=1 bench (E=64/256)
#   source .carry/setup.sh && bash scripts/device/h200_s8.sh 1
#   source .carry/setup.sh && bash scripts/device/h200_s8.sh 2   # issue 10: train.optimizer A/B
# 1. scripts/memcheck_fused.py under compute-sanitizer (issue 9 item 6: the fused kernels once under
#    memcheck; only its CPU dry run has run);
# 2. the fused layer's latency, eager and graph-replayed, at T = 1024 and 4096 (issue 9 item 4: never
#    reported yet), fused / separate / torchtitan;
# 3. every fused form against its grouped GEMM on all five shapes (where the fused layer loses).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
if [ "${1:-1}" = 0 ]; then
  t0=$(date +%s)
  timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_symm_gpu.py \
    tests/test_fused_ep_gpu.py > "$out/exchange_gpu.log" 2>&1
  echo "== exchange GPU tiers rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/exchange_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$out/exchange_gpu.log" | head -n 10
  t0=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1
  echo "== memcheck exchange rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
  t0=$(date +%s)
  timeout 90 python3 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 --experts 64,256 --profile \
    --json "$out/dispatch_w1.json" > "$out/dispatch_w1.log" 2>&1
  echo "== dispatch W=1 rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 14 "^W=1" "$out/dispatch_w1.log"
  grep -B1 -A1 "_route_kernel" "$out/dispatch_w1.log" | grep -E "E=|route" | head -n 12
  exit 0
fi
if [ "${1:-1}" = 2 ]; then
  # 2: h200_1gpu, 100 steps, torch's fused AdamW (fp32 grads, refreshed bf16 copies) against
  #    train.optimizer=adamw_bf16_grads (bf16 grads, copies written by the update; written in
  #    session 6 on CPU: interpreter and CPU training tests only). Same losses expected to ~1e-3.
  for o in adamw adamw_bf16_grads; do
    t0=$(date +%s)
    timeout 270 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
      --override train.steps=100 --override train.log_every=20 --override metrics.progress=false \
      --override train.optimizer=$o --override metrics.out_dir=/tmp/run_$o --profile 3 > "$out/train_$o.log" 2>&1
    echo "== train optimizer=$o rc=$? [$(( $(date +%s)-t0 ))s]"
    grep -A 12 "^step profile" "$out/train_$o.log"; grep -E "^step +[0-9]+/" "$out/train_$o.log" | cut -c1-170
  done
  exit 0
fi
t0=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/memcheck_fused.py > "$out/memcheck_fused.log" 2>&1
echo "== memcheck fused rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok|FAILED' "$out/memcheck_fused.log" | tr '\n' ' ')"
grep -A 8 "FAILED" "$out/memcheck_fused.log" | head -n 12
t0=$(date +%s)
timeout 200 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b --tokens "" --latency-tokens 1024,4096 \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1
echo "== layer latency rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_latency.log"; tail -n 3 "$out/moe_latency.log"
t0=$(date +%s)
timeout 150 python3 bench/fused_forms.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite,mixtral,deepseek-v3-rank \
  --json "$out/forms_all.json" > "$out/forms_all.log" 2>&1
echo "== fused forms rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\||median|err" "$out/forms_all.log"
