#!/usr/bin/env bash
# Written at the end of session 12 (not yet run), two GPUs, two calls (each < 7 min):
#   source .carry/setup.sh && bash scripts/device/x2_s25.sh 1
#   source .carry/setup.sh && bash scripts/device/x2_s25.sh 2
# What session 12 changed after its last device call: the overlapped forward inside a backward
# (activation checkpointing's recompute) starts no combine op and joins the rows' stream itself, and the
# overlapped forward checks its call before launching; x2_s23's one-GPU tier on GPU 1 ran out of its
# 220 s box after 24 passes. So: the fused-EP / layer / exchange tiers, each on its own GPU with room;
# T5 (call 1); EP=2 training with the overlap under activation_checkpoint = "moe" (the recompute path) and
# the W=2 dispatch grid with the 32-token route blocks now the default for T <= 1024 (call 2; issue 8's
# T=128 cells, 36.0 us in the sweep that chose them).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
if [ "${1:-1}" = 1 ]; then
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 250 \
  tests/test_fused_ep_gpu.py tests/test_moe_gpu.py > "$out/gpu_ep.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 250 \
  tests/test_symm_gpu.py -k "not (random-8 or zero_token_experts-8 or heavy_imbalance-8 or one_expert-8)" \
  > "$out/gpu_symm.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "== GPU fused EP + layer rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_ep.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_ep.log" | cut -c1-300 | head -n 8
echo "== GPU exchange rc=$r2 $(tail -n 1 "$out/gpu_symm.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_symm.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 120 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
  tests/test_symm_multigpu.py > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
exit 0
fi
t0=$(date +%s)
timeout 120 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
  --override train.steps=20 --override train.log_every=10 --override parallel.ep_overlap=true \
  --override parallel.capacity_factor=2.0 --override train.activation_checkpoint=moe \
  --override train.comm_timeout_s=60 --override metrics.progress=false \
  --override metrics.out_dir=/tmp/run_ep2_overlap_ckpt > "$out/train_ep2_overlap_ckpt.log" 2>&1
echo "== EP=2 training, ep_overlap + activation_checkpoint=moe rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^step|stopped" "$out/train_ep2_overlap_ckpt.log" | cut -c1-220 | tail -n 3
dispatch_w2
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/fused_forms.py --shapes mixtral,deepseek-v2-lite,olmoe --tokens 16384 \
  --rep 40 > "$out/fused_forms.log" 2>&1
echo "== fused forms rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\|" "$out/fused_forms.log" | head -n 24
