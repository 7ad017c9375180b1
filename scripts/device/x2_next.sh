#!/usr/bin/env bash
# Next two-GPU call (written in session 4, not yet run): the fused EP pipeline and the exchange fixes
# that landed after the session-4 measurements. Two calls of < 10 min each:
#   source .carry/setup.sh && bash scripts/device/x2_next.sh 1    # T5 on both routes, dispatch bench (full grid)
# (the one-GPU tier of the changed kernels is scripts/device/h200_next.sh 1: run it first, on either kind)
#   source .carry/setup.sh && bash scripts/device/x2_next.sh 2    # layer bench, EP=2 training, scaling point
# (each part leaves <= 8 files in $OUT: the device tool returns at most 8; keep checkpoints and
# metrics out of $OUT -- an EP=2 checkpoint is ~40 GB)
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
errs() { grep -hE "Error|error:|Exception" "$@" 2>/dev/null | grep -vE "elastic|ChildFailed|error_file|errors.html" \
  | sed 's/^\[rank[0-9]*\]: //' | sort | uniq -c | sort -rn | head -n 6; }
if [ "${1:-1}" = 1 ]; then
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_multigpu.py \
  > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"; errs "$out/t5_peer.log"
t0=$(date +%s)
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r GROUP_RANK=$r \
    timeout 150 python3 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_nvshmem_multigpu.py \
    > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
echo "== T5 NVSHMEM [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_nvshmem_rank0.log" | tail -n 1)"
t0=$(date +%s)
timeout 240 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --profile \
  --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1   # the full grid: T 128..16384, D 2048/7168, E 64/256
echo "== dispatch rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 30 "^W=2" "$out/dispatch_w2.log"; grep -A 6 "symm_graph E=256 D=7168 T=128 " "$out/dispatch_w2.log"
fi
[ "${1:-1}" = 1 ] && exit 0
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 4096,16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== moe_layer EP rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 6 "^W=2" "$out/moe_layer_w2.log"; errs "$out/moe_layer_w2.log"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
  --override train.steps=60 --override train.log_every=20 --override parallel.moe_pipeline=fused \
  --override metrics.out_dir=/tmp/run_fused_ep > "$out/train_fused_ep.log" 2>&1
echo "== EP=2 training, fused EP rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^step" "$out/train_fused_ep.log" | cut -c1-160 | tail -n 3
errs "$out/train_fused_ep.log"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/scaling.py --config configs/h200_1gpu.toml \
  --override parallel.ep=2 --mode step --paths fused_ep,fast,reference --steps 5 --rounds 2 --warmup 3 \
  --json "$out/scaling_n2.json" > "$out/scaling_n2.log" 2>&1
echo "== scaling N=2 rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A1 "^\[step\]" "$out/scaling_n2.log" | cut -c1-400
