#!/usr/bin/env bash
# Session 7, first call, on nvidia-h200-x2 (carry .carry):  source .carry/setup.sh && bash scripts/device/x2_s9.sh
# Validates the route kernel changed on CPU in session 6 (sorted per-expert ranking, ~1024-slot
# blocks): the one-GPU exchange tiers on GPU 0 and 1 in parallel (+ memcheck), T5 on peer pointers,
# T5 on the NVSHMEM route (two one-GPU "nodes"), and the W=2 dispatch grid with per-kernel profiles.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
( CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
    tests/test_fused_ep_gpu.py > "$out/gpu1.log" 2>&1; echo "pytest rc=$?" >> "$out/gpu1.log"
  CUDA_VISIBLE_DEVICES=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck \
    --error-exitcode 1 python3 scripts/memcheck_exchange.py >> "$out/gpu1.log" 2>&1; echo "memcheck rc=$?" >> "$out/gpu1.log" ) &
CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_symm_gpu.py \
  > "$out/gpu0.log" 2>&1
echo "== test_symm_gpu (GPU 0) rc=$? $(tail -n 1 "$out/gpu0.log")"; grep -E "^(FAILED|ERROR)" "$out/gpu0.log" | cut -c1-200 | head
wait
echo "== GPU 1 [$(( $(date +%s)-t0 ))s]: $(grep -E 'passed|failed|rc=|ERROR SUMMARY|all ok' "$out/gpu1.log" | tr '\n' ' ')"
grep -E "^(FAILED|ERROR)" "$out/gpu1.log" | cut -c1-200 | head
t0=$(date +%s)
timeout 120 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_multigpu.py \
  > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
t0=$(date +%s)
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r \
    GROUP_RANK=$r timeout 130 python3 -m pytest -m multigpu -q -p no:cacheprovider --timeout 45 --timeout-method=thread \
    tests/test_symm_nvshmem_multigpu.py > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
echo "== T5 NVSHMEM [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_nvshmem_rank0.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$out/t5_nvshmem_rank0.log" | cut -c1-200 | head -n 5
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64,256 --profile --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1
echo "== dispatch W=2 rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 20 "^W=2" "$out/dispatch_w2.log" | grep -E "^(provider|nccl|symm|rows)"
grep -E "route|expand|reduce|send" "$out/dispatch_w2.log" | head -n 24
