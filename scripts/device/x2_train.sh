#!/usr/bin/env bash
# EP=2 training on two H200s (configs/h200_2gpu_ep2.toml): all-to-all, then the symmetric exchange.
# Usage (project root, after `source .carry/setup.sh`): bash scripts/device/x2_train.sh [steps]
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
steps=${1:-80}
for d in ${DISPATCHERS:-all_to_all symm}; do
  t0=$(date +%s)
  timeout ${TRAIN_S:-260} torchrun --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
    --override train.steps=$steps --override train.log_every=20 --override parallel.dispatcher=$d \
    --override metrics.out_dir=$out/run_$d --losses-out $out/losses_$d.json > "$out/train_$d.log" 2>&1
  echo "== $d rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^step|error|Error" "$out/train_$d.log" | tail -n 6
done
