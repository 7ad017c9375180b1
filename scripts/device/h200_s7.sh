#!/usr/bin/env bash
# Session 6, one GPU (< 10 min, <= 8 files in $OUT):
#   source .carry/setup.sh && bash scripts/device/h200_s7.sh 1
# 1: fused forms kernel by kernel (bench/fused_forms.py) with the landed dW kernel (index load in the
#    producer's critical path, copied to scripts/device/_old_fused_moe.py) and with the index prefetch;
#    the fused GPU tier; then the one-GPU training recipe (tokens/s, MFU, per-category profile).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
if [ "${1:-1}" = 1 ]; then
  cp tlx/hopper/fused_moe.py /tmp/new_fused_moe.py
  if [ -f scripts/device/_old_fused_moe.py ]; then
    cp scripts/device/_old_fused_moe.py tlx/hopper/fused_moe.py
    timeout 100 python3 bench/fused_forms.py --shapes olmoe --json "$out/forms_old.json" > "$out/forms_old.log" 2>&1
    echo "== forms (landed dW) rc=$?"; grep -E "^\||err|median" "$out/forms_old.log"
    cp /tmp/new_fused_moe.py tlx/hopper/fused_moe.py
  fi
  timeout 140 python3 bench/fused_forms.py --shapes olmoe,qwen3-30b-a3b --json "$out/forms_new.json" > "$out/forms_new.log" 2>&1
  echo "== forms (dW index prefetch) rc=$?"; grep -E "^\||err|median" "$out/forms_new.log"; tail -n 3 "$out/forms_new.log"
  t0=$(date +%s)
  timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_fused_moe_gpu.py > "$out/fused_gpu.log" 2>&1
  echo "== fused GPU tier rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/fused_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$out/fused_gpu.log" | head -n 5
  t0=$(date +%s)
  timeout 170 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
    --override train.steps=30 --override metrics.out_dir=/tmp/run_s7 --profile 5 \
    > "$out/train.log" 2>&1
  echo "== train h200_1gpu rc=$? [$(( $(date +%s)-t0 ))s]"; grep -v "^\s*$" "$out/train.log" | tail -n 40 | cut -c1-160
fi
