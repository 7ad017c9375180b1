#!/usr/bin/env bash
# Next two-GPU call (written in session 6, not yet run), < 10 min, <= 8 files in $OUT:
#   source .carry/setup.sh && bash scripts/device/x2_s8.sh
# After session 6's dW fix (fused dW kernels 1.4x faster on one H200), what it does under expert
# parallelism: the fused EP layer against the separate symm layer and all-to-all (before: 14.14 vs
# 13.19 ms), and EP=2 training with moe_pipeline=fused and =separate (before: 38.7% vs 42.8% MFU).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
# (run scripts/device/h200_s8.sh 0 first: the route kernel changed after the last GPU runs)
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_multigpu.py \
  > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64,256 --profile --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1
echo "== dispatch rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 20 "^W=2" "$out/dispatch_w2.log" | grep -E "^(provider|nccl|rows_graph)"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 4096,16384 --profile \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== moe_layer EP rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_layer_w2.log"
grep -A 6 "fused_ep W=2: per-kernel" "$out/moe_layer_w2.log" | cut -c1-120
for p in fused separate; do
  t0=$(date +%s)
  timeout 180 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
    --override train.steps=60 --override train.log_every=20 --override parallel.moe_pipeline=$p \
    --override metrics.progress=false --override metrics.out_dir=/tmp/run_ep2_$p > "$out/train_ep2_$p.log" 2>&1
  echo "== EP=2 training, moe_pipeline=$p rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^step" "$out/train_ep2_$p.log" | cut -c1-160 | tail -n 3
done
