#!/usr/bin/env bash
# Release check for issue 16: runs the short 2-process gloo training job N times (default 50) and
# counts runs that did not exit 0 (an abort at exit shows as SIGABRT / exitcode -6).
#   bash scripts/stress_exit.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-50}; bad=0
for i in $(seq 1 "$n"); do
  log=$(OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore timeout 300 "${PYTHON:-python3}" -m torch.distributed.run \
    --standalone --nproc-per-node=2 -m train.pretrain --config configs/debug_cpu.toml \
    --override model.dim=64 --override model.n_layers=2 --override model.n_heads=2 \
    --override model.dense_inter_dim=128 --override model.moe.moe_inter_dim=64 \
    --override model.moe.num_experts=4 --override data.seq_len=32 --override data.batch_size=4 \
    --override parallel.ep=2 --override train.steps=3 --override "metrics.out_dir=''" \
    --override metrics.progress=false 2>&1)
  rc=$?
  if [ $rc -ne 0 ] || grep -q "terminate called\|SIGABRT" <<<"$log"; then
    bad=$((bad + 1)); echo "run $i: exit $rc"; grep -m3 "terminate called\|exitcode" <<<"$log"
  fi
done
echo "stress_exit: $n runs, $bad failed"
[ "$bad" -eq 0 ]
