#!/usr/bin/env bash
# Next one-GPU call (written in session 4, not yet run): the GPU tests issues 12 and 17 still need,
# and the profile issue 10 needs. `source .carry/setup.sh && bash scripts/device/h200_next.sh`
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/test_grouped_gemm_gpu.py \
  tests/test_grouped_gemm_opcheck.py tests/test_moe_gpu.py tests/test_train_profiling.py > "$out/gpu12.log" 2>&1
echo "== issue 12 GPU tests rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu12.log")"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
  --override train.steps=12 --profile 5 > "$out/profile.log" 2>&1
echo "== profile rc=$? [$(( $(date +%s)-t0 ))s]"; tail -n 30 "$out/profile.log"
