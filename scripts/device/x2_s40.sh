#!/usr/bin/env bash
# Session 17, two GPUs, second call (< 9 min):  source .carry/setup.sh && bash scripts/device/x2_s40.sh
# The copy-engine row form after x2_s39 (its combine deadlocked at T=16384: 16 summing programs an SM
# left no room for the chunk signals; now 4):
# 1. bench/exchange_tiles.py SM vs CE at T = 128 / 4096 / 16384, chunk sizes;
# 2. T5 (peer pointers), the CE cases first;  3. bench/dispatch.py (NCCL anchor at W=2).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 170 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 128,4096,16384 \
  --configs "ce:off;ce:on;ce:on,ce_chunk:512;ce:on,ce_chunk:2048;ce:off;ce:on" --json "$out/exchange.json" \
  > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 24
timeout 170 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  -rfE tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:" "$out/t5.log" | cut -c1-400 | head -n 10
timeout 200 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64 --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch.py rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E -A 30 "medians|Error:" "$out/dispatch.log" | head -n 44
exit 0
