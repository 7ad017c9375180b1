#!/usr/bin/env bash
# Session 7, second two-GPU call (carry .carry):  source .carry/setup.sh && bash scripts/device/x2_s9b.sh
# After the fused-launcher fix: T5 on peer pointers (its fused-EP layer test failed on the launcher
# bug), T5 on the NVSHMEM route with room for the first NVSHMEM compiles of the new route kernel (the
# first call's 130 s ran out after 5 passes), then the OLMoE layer latency, eager and graph-replayed.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 120 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_multigpu.py \
  > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-200 | head -n 5
t0=$(date +%s)
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r \
    GROUP_RANK=$r timeout 170 python3 -m pytest -m multigpu -v -p no:cacheprovider --timeout 60 --timeout-method=thread \
    tests/test_symm_nvshmem_multigpu.py > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
echo "== T5 NVSHMEM [$(( $(date +%s)-t0 ))s]"; grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$out/t5_nvshmem_rank0.log" | cut -c1-150 | tail -n 9
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/moe_layer.py --shapes olmoe --tokens "" --latency-tokens 1024,4096 \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1
echo "== layer latency rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_latency.log" | tail -n 2
python3 -c "
import json; rows=json.load(open('$out/moe_latency.json'))['rows']
for r in rows:
    for k, v in r.items():
        if k.endswith('graph_error'): print(r['T'], k, v[-700:])
" 2>&1 | head -n 40
