#!/usr/bin/env bash
# Session 12's last two-GPU call (< 8 min):  source .carry/setup.sh && bash scripts/device/x2_s23.sh
# The final code (the scheduler's prep kernel and the Hopper fused kernel now take PHASE / VIRT, the router
# kernel is on by default, 32-token route blocks for small T, the overlap) through every one-GPU tier it
# touches, T5 on peer pointers, EP=2 training with parallel.ep_overlap (the recipe key), and the copy
# engines' peer bandwidth (the next exchange design's premise).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
  tests/test_grouped_gemm_gpu.py tests/test_fused_moe_gpu.py > "$out/gpu_gemm.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
  tests/test_fused_ep_gpu.py tests/test_moe_gpu.py tests/test_symm_gpu.py \
  -k "not (random-8 or zero_token_experts-8 or heavy_imbalance-8 or one_expert-8)" > "$out/gpu_ep.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "== GPU grouped GEMM + fused rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_gemm.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_gemm.log" | cut -c1-300 | head -n 8
echo "== GPU fused EP + layer + exchange rc=$r2 $(tail -n 1 "$out/gpu_ep.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_ep.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 120 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
  tests/test_symm_multigpu.py > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
  --override train.steps=30 --override train.log_every=10 --override parallel.ep_overlap=true \
  --override parallel.capacity_factor=1.25 --override metrics.progress=false \
  --override metrics.out_dir=/tmp/run_ep2_overlap > "$out/train_ep2_overlap.log" 2>&1
echo "== EP=2 training, ep_overlap + capacity_factor 1.25 rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^step|Error" "$out/train_ep2_overlap.log" | cut -c1-200 | tail -n 3
timeout 30 python3 bench/p2p_copy.py --mb 64,235 > "$out/p2p_copy.log" 2>&1
echo "== copy engines rc=$?"; cat "$out/p2p_copy.log" | tail -n 5
