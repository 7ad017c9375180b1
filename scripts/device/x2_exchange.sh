#!/usr/bin/env bash
# Two-GPU (nvidia-h200-x2) exchange checks in one device call: T5 on both routes, then the dispatch
# bench at W=2 against NCCL. Run from the project root after `source .carry/setup.sh`.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
nvidia-smi topo -m > "$out/topo.txt" 2>&1; head -4 "$out/topo.txt"
t0=$(date +%s)
timeout ${T5_S:-200} torchrun --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider \
  tests/test_symm_multigpu.py -x > "$out/t5_peer.log" 2>&1; echo "T5 peer rc=$? $(grep -E 'passed|failed|error' "$out/t5_peer.log" | tail -n 2 | tr '\n' ' ') [$(( $(date +%s)-t0 ))s]"
t0=$(date +%s)
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r GROUP_RANK=$r timeout ${NVS_S:-150} python3 -m pytest -m multigpu -q -p no:cacheprovider -x \
    tests/test_symm_nvshmem_multigpu.py > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
unset MASTER_ADDR MASTER_PORT WORLD_SIZE LOCAL_WORLD_SIZE
echo "T5 nvshmem: $(grep -E 'passed|failed|error' "$out/t5_nvshmem_rank0.log" | tail -n 2 | tr '\n' ' ') [$(( $(date +%s)-t0 ))s]"
t0=$(date +%s)
timeout ${DISP_S:-180} torchrun --nproc-per-node=2 bench/dispatch.py --tokens ${DISP_T:-128,4096,16384} --dims 7168 \
  --experts 256 --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1; echo "dispatch rc=$? [$(( $(date +%s)-t0 ))s]"
tail -n 25 "$out/dispatch_w2.log"
