#!/usr/bin/env bash
# Written in session 10 after its last device call (not yet run), two GPUs, two calls (each < 8 min):
#   source .carry/setup.sh && bash scripts/device/x2_s17.sh 1
#   source .carry/setup.sh && bash scripts/device/x2_s17.sh 2
# 1: what session 10 could not finish or start on two GPUs -- the GPU tiers whose 215 s box ran out
#    (emulated world, block-by-block receive copy: 20 of 23 had passed) beside memcheck, and T5 on
#    peer pointers (now also the fused EP layer with per-layer receive regions, SymmDispatcher(row_regions=2)),
#    and the fused EP layer over the NVSHMEM route with regions asked for (that route reserves none).
# 2: EP=2 training on auto (configs/h200_2gpu_ep2.toml: T_max = 32768 per rank, so the overlapped
#    receive copy is on; session 10's training run predates it) and with parallel.ep_row_regions=true
#    (no receive copy at all); the W=2 grid with the rank-aligned per-op columns (bench/dispatch.py
#    "disp al." / "comb al.": a device barrier before each timed op; issue 8's T=128 cells have read
#    41-113 us across runs).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
if [ "${1:-1}" = 1 ]; then
  tiers_memcheck 300 "$NO_W8"
  t5_peer
  grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
  t5_nvshmem "fused_ep" 120  # the fused EP layer over NVSHMEM, regions asked for (none reserved there)
  exit 0
fi
train_ep2 auto
t0=$(date +%s)
timeout 120 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
  --override train.steps=40 --override train.log_every=20 --override parallel.ep_row_regions=true \
  --override metrics.progress=false --override metrics.out_dir=/tmp/run_ep2_regions > "$out/train_ep2_regions.log" 2>&1
echo "== EP=2 training, parallel.ep_row_regions=true rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^step" "$out/train_ep2_regions.log" | cut -c1-160 | tail -n 2
t0=$(date +%s)  # with the MoE FFNs recomputed in the backward (the recompute dispatches into the region again)
timeout 100 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
  --override train.steps=20 --override train.log_every=10 --override parallel.ep_row_regions=true \
  --override train.activation_checkpoint=moe --override metrics.progress=false \
  --override metrics.out_dir=/tmp/run_ep2_regions_ckpt > "$out/train_ep2_regions_ckpt.log" 2>&1
echo "== EP=2 training, ep_row_regions + activation_checkpoint=moe rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^step" "$out/train_ep2_regions_ckpt.log" | cut -c1-160 | tail -n 2
dispatch_w2
