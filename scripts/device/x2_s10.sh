#!/usr/bin/env bash
# Next two-GPU call (written in session 7, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s10.sh 1   (after h200_s10.sh 0)
#   source .carry/setup.sh && bash scripts/device/x2_s10.sh 2
# 1. T5 on peer pointers and the W=2 dispatch grid after session 7's exchange change (kernel-side
#    offsets cap and row-form gather index: two torch kernels fewer per dispatch), then
#    T5 on the NVSHMEM route with a time box the first NVSHMEM compiles of the sorted route kernel
#    fit in (session 7: 5 of 7 passed, then the 130 s / 170 s boxes ran out inside the MoE-layer test);
# 2. EP=2 training, moe_pipeline fused vs separate, after session 6's dW fix and session 7's launcher
#    fix (before: 38.7% vs 42.8% MFU).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
if [ "${1:-1}" = 1 ]; then
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_multigpu.py \
  > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
t0=$(date +%s)
timeout 110 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64,256 --profile --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1
echo "== dispatch W=2 rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 30 "^W=2" "$out/dispatch_w2.log" | grep -E "^(provider|nccl|symm|rows)"
t0=$(date +%s)
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r \
    GROUP_RANK=$r timeout 290 python3 -m pytest -m multigpu -v -p no:cacheprovider --timeout 150 --timeout-method=thread \
    --durations=0 tests/test_symm_nvshmem_multigpu.py > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
echo "== T5 NVSHMEM [$(( $(date +%s)-t0 ))s]"; grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout|s call" "$out/t5_nvshmem_rank0.log" | cut -c1-150 | tail -n 18
exit 0
fi
for p in fused separate; do
  t0=$(date +%s)
  timeout 120 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
    --override train.steps=40 --override train.log_every=20 --override parallel.moe_pipeline=$p \
    --override metrics.progress=false --override metrics.out_dir=/tmp/run_ep2_$p > "$out/train_ep2_$p.log" 2>&1
  echo "== EP=2 training, moe_pipeline=$p rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^step" "$out/train_ep2_$p.log" | cut -c1-160 | tail -n 2
done
