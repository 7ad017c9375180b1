#!/usr/bin/env bash
# Session 12, two GPUs, short (< 2.5 min):  source .carry/setup.sh && bash scripts/device/x2_s24.sh
# EP=2 training through the recipe key parallel.ep_overlap (x2_s23's run at capacity_factor 1.25 stopped at
# step 1, as designed, with the overflow error naming parallel.capacity_factor: the untrained router sends
# up to 3x the mean load to an expert). Capacity 2.0, 30 steps; a failing rank ends the job within 60 s.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 140 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
  --override train.steps=30 --override train.log_every=10 --override parallel.ep_overlap=true \
  --override parallel.capacity_factor=2.0 --override train.comm_timeout_s=60 --override metrics.progress=false \
  --override metrics.out_dir=/tmp/run_ep2_overlap > "$out/train_ep2_overlap.log" 2>&1
echo "== EP=2 training, ep_overlap + capacity_factor 2.0 rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^step|stopped" "$out/train_ep2_overlap.log" | cut -c1-220 | tail -n 4
