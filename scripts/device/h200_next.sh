#!/usr/bin/env bash
# Next one-GPU calls (written in session 4, not yet run). Each part < 10 min, <= 8 files in $OUT:
#   source .carry/setup.sh && bash scripts/device/h200_next.sh 1   # the exchange + fused EP kernels changed on CPU
#   source .carry/setup.sh && bash scripts/device/h200_next.sh 2   # issue 12's GPU tests, issue 10's profile
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
part=${1:-1}
if [ "$part" = 1 ]; then
  t0=$(date +%s)
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_symm_gpu.py \
    tests/test_fused_ep_gpu.py > "$out/exchange_gpu.log" 2>&1
  echo "== exchange + fused EP GPU tier rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/exchange_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$out/exchange_gpu.log" | head -n 10
  t0=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1
  echo "== memcheck exchange rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
  t0=$(date +%s)
  timeout 60 python3 bench/dispatch.py --tokens 128,4096 --dims 7168 --experts 256 --profile \
    --json "$out/dispatch_w1.json" > "$out/dispatch_w1.log" 2>&1
  echo "== dispatch W=1 rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 8 "^W=1" "$out/dispatch_w1.log"
else
  t0=$(date +%s)
  timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/test_grouped_gemm_gpu.py \
    tests/test_grouped_gemm_opcheck.py tests/test_moe_gpu.py tests/test_train_profiling.py > "$out/gpu12.log" 2>&1
  echo "== issue 12 GPU tests rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu12.log")"
  t0=$(date +%s)
  timeout 200 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
    --override train.steps=12 --override metrics.out_dir=/tmp/run_prof --profile 5 > "$out/profile.log" 2>&1
  echo "== profile rc=$? [$(( $(date +%s)-t0 ))s]"; tail -n 30 "$out/profile.log"
fi
