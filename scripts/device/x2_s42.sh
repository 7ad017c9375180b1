#!/usr/bin/env bash
# Session 17, two GPUs, fourth call (< 6 min):  source .carry/setup.sh && bash scripts/device/x2_s42.sh
# 1. T5 whole (x2_s41 ran only its copy-engine cases, first in a cold process: the first failed, the
#    second hung -- compile skew of the fused kernels past the 30 s wait, or a bug: this tells);
# 2. the combine's chunks at the new default (1024-2048 rows, ~1/8), SM vs CE, three rounds;
# 3. bench/dispatch.py at the final defaults (NCCL anchor at W=2).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
  -rfE tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/t5.log" | cut -c1-300 | head -n 16
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "ce:on;ce:off;ce:on;ce:on;ce:off;ce:on" --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 16
timeout 150 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64 --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch.py rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E -A 30 "medians|Error:" "$out/dispatch.log" | head -n 44
exit 0
