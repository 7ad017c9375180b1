#!/usr/bin/env bash
# Session 18, two GPUs, sixth call (< 6 min):  source .carry/setup.sh && bash scripts/device/x2_s49.sh
# The new default copies of the copy-engine combine (4096-row chunks, the last cut down to 512; x2_s48):
# 1. T5 whole (its T <= 1000 ops now copy in cut-down chunks); 2. default vs SM stores at T = 128 / 4096
# / 16384, twice; 3. bench/dispatch.py at T = 4096 / 16384 (NCCL anchor at W = 2).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
  -rfE tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/t5.log" | cut -c1-300 | head -n 16
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 128,4096,16384 \
  --configs "default;ce:off;default;ce:off" --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 16
timeout 150 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 4096,16384 --dims 7168 \
  --experts 64 --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch.py rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E -A 16 "medians|Error:" "$out/dispatch.log" | head -n 20
exit 0
