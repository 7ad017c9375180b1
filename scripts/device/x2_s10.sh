#!/usr/bin/env bash
# Two-GPU calls written in session 7 (step 1 ran in session 8; step 2 has not run yet), < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s10.sh 1
#   source .carry/setup.sh && bash scripts/device/x2_s10.sh 2
# 1. T5 on peer pointers, the W=2 dispatch grid, T5 on the NVSHMEM route (with --durations);
# 2. EP=2 training, moe_pipeline fused vs separate (before: 38.7% vs 42.8% MFU, session 5).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
if [ "${1:-1}" = 1 ]; then
  t5_peer; dispatch_w2; t5_nvshmem "" 290
  exit 0
fi
for p in fused separate; do train_ep2 "$p"; done
