#!/usr/bin/env bash
# Session 6, one GPU (< 10 min, <= 8 files in $OUT):
#   source .carry/setup.sh && bash scripts/device/h200_s7.sh 1
# 1: fused forms kernel by kernel (bench/fused_forms.py) with the landed dW kernel (index load in the
#    producer's critical path, copied to scripts/device/_old_fused_moe.py) and with the index prefetch;
#    the fused GPU tier; then the one-GPU training recipe (tokens/s, MFU, per-category profile).
# (the 'wgrad:' rounds below ran before dW13 / dW2 got separate configs; 'wgrad' now sets both on
#  their own defaults, and some of these strings no longer fit shared memory there)
# 2: tile-config sweep of every fused form (TLX_DIST_FUSED_CONFIG rounds, each compile-checked on CPU
#    to fit 227 KB), then the training recipe with the fastest config of each form.
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
elif [ "$1" = 2 ]; then
  i=0
  for c in "" "swiglu:STAGES=3,LAG=1;scatter:STAGES=3;dswiglu:STAGES=4,LAG=2;wgrad:STAGES=4,LAG=2" \
      "swiglu:BK=32,STAGES=8,LAG=6;scatter:STAGES=5;dswiglu:STAGES=5,LAG=3,REGS=232;wgrad:BN=128,BK=64,STAGES=4,LAG=2" \
      "dswiglu:BK=32,STAGES=8,LAG=6;wgrad:BK=64,STAGES=3,LAG=1;scatter:BN=64,STAGES=6" \
      "dswiglu:GROUP_M=8;scatter:GROUP_M=8;swiglu:GROUP_M=8;wgrad:GROUP_M=8" \
      "dswiglu:BN=64,STAGES=8,LAG=6;scatter:BK=128,STAGES=2;wgrad:STAGES=5,LAG=2"; do
    TLX_DIST_FUSED_CONFIG="$c" timeout 90 python3 bench/fused_forms.py --shapes olmoe --rep 40 \
      --json "/tmp/sweep_$i.json" > "/tmp/sweep_$i.log" 2>&1
    echo "== round $i rc=$? [$c]"; grep -E "^\| olmoe" "/tmp/sweep_$i.log" | cut -d'|' -f4,5,9 | tr '\n' ' '; echo
    echo "$c" > "/tmp/sweep_$i.cfg"; i=$((i+1))
  done
  best=$(python3 scripts/device/pick_fused_config.py /tmp/sweep_*.json)
  echo "== best per form: [$best]"
  cp /tmp/sweep_*.json "$out/" 2>/dev/null
  t0=$(date +%s)
  TLX_DIST_FUSED_CONFIG="$best" timeout 170 torchrun --standalone --nproc-per-node=1 -m train.pretrain \
    --config configs/h200_1gpu.toml --override train.steps=40 --override metrics.out_dir=/tmp/run_s7b --profile 5 \
    > "$out/train_best.log" 2>&1
  echo "== train h200_1gpu (best configs) rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -A 14 "^step profile" "$out/train_best.log"; grep -E "^step +(20|40)/" "$out/train_best.log" | cut -c1-170
elif [ "$1" = 3 ]; then
  # 3: dSwiGLU with h prefetched by TMA (PREFETCH_H): the fused GPU tier under it (and the new dW13
  #    default), its tile configs, then 100 steps of the recipe on the fastest (loss vs RESULTS.md).
  t0=$(date +%s)
  TLX_DIST_FUSED_CONFIG="dswiglu:PREFETCH_H=1,STAGES=4,LAG=2" timeout 150 python3 -m pytest -m gpu -q -x \
    -p no:cacheprovider tests/test_fused_moe_gpu.py > "$out/fused_gpu_pre.log" 2>&1
  echo "== fused GPU tier, PREFETCH_H rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/fused_gpu_pre.log")"
  grep -E "^(FAILED|ERROR)" "$out/fused_gpu_pre.log" | head -n 5
  i=0
  for c in "" "dswiglu:PREFETCH_H=1,STAGES=4,LAG=2" "dswiglu:PREFETCH_H=1,BK=32,STAGES=8,LAG=6" \
      "dswiglu:PREFETCH_H=1,BN=64,STAGES=7,LAG=5"; do
    TLX_DIST_FUSED_CONFIG="$c" timeout 60 python3 bench/fused_forms.py --shapes olmoe --rep 40 \
      --forms dswiglu,wgrad_a,wgrad_b --json "/tmp/pre_$i.json" > "/tmp/pre_$i.log" 2>&1
    echo "== round $i rc=$? [$c]"; grep -E "^\| olmoe" "/tmp/pre_$i.log" | cut -d'|' -f4,5,9 | tr '\n' ' '; echo
    echo "$c" > "/tmp/pre_$i.cfg"; i=$((i+1))
  done
  cp /tmp/pre_0.log "$out/forms_s7_3.log"
  best=$(python3 scripts/device/pick_fused_config.py /tmp/pre_*.json)
  echo "== best per form: [$best]"
  t0=$(date +%s)
  TLX_DIST_FUSED_CONFIG="$best" timeout 200 torchrun --standalone --nproc-per-node=1 -m train.pretrain \
    --config configs/h200_1gpu.toml --override train.steps=100 --override train.log_every=20 \
    --override metrics.progress=false --override metrics.out_dir=/tmp/run_s7c --profile 3 > "$out/train_100.log" 2>&1
  echo "== train h200_1gpu 100 steps rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -A 14 "^step profile" "$out/train_100.log"; grep -E "^step +[0-9]+/" "$out/train_100.log" | cut -c1-170
fi
