#!/usr/bin/env bash
# Session 17, two GPUs, third call (< 6 min):  source .carry/setup.sh && bash scripts/device/x2_s41.sh
# The copy-engine combine's chunk schedule (symm._ce_chunks: ~1/8 of the rows, the last chunk split
# 1/2, 1/4, 1/4) against uniform chunks; T5's CE cases (fix-up kernel changed); bench/dispatch.py at the
# final defaults (NCC anchor at W=2).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "ce:on;ce:on,ce_chunk:1024;ce:on,ce_chunk:2048;ce:on,ce_chunk:4096;ce:off;ce:on;ce:on,ce_chunk:2048" \
  --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 20
timeout 120 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
  -rfE tests/test_symm_multigpu.py -k copy_engine > "$out/t5.log" 2>&1
echo "== T5 copy engine rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:" "$out/t5.log" | cut -c1-400 | head -n 10
timeout 200 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64 --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch.py rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E -A 30 "medians|Error:" "$out/dispatch.log" | head -n 44
exit 0
