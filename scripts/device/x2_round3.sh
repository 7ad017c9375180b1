#!/usr/bin/env bash
# Session 5, call A on nvidia-h200-x2 (carry .carry): the NVSHMEM-route T5 after its counters test was
# brought to the readiness-ahead protocol and its skip test got a matched op first. pytest-timeout
# dumps the stacks of a test that hangs. Leaves /tmp/fbt for call B (scripts/device/h200_hf.sh).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r GROUP_RANK=$r \
    timeout 170 python3 -m pytest -m multigpu -v -p no:cacheprovider --timeout 60 tests/test_symm_nvshmem_multigpu.py \
    > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
echo "== T5 NVSHMEM [$(( $(date +%s)-t0 ))s]"; grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$out/t5_nvshmem_rank0.log" | head -n 20
grep -E "PASSED|FAILED|passed|failed|Timeout" "$out/t5_nvshmem_rank1.log" | tail -n 3
