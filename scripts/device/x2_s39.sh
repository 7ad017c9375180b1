#!/usr/bin/env bash
# Session 17, two GPUs, first call (< 8 min):  source .carry/setup.sh && bash scripts/device/x2_s39.sh
# The copy-engine row form (symm._ce_mode: dense layout, cuMemcpyAsync rows / partial rows):
# 1. the CE tests of T5 first (fail fast), then the whole T5 file;
# 2. bench/exchange_tiles.py: SM vs CE at T = 4096 / 16384 (W=2, D=7168, E=64, K=8, graph-replayed),
#    CE combine chunk sizes.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  -rfE tests/test_symm_multigpu.py -k "copy_engine" > "$out/t5_ce.log" 2>&1
echo "== T5 copy engine rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_ce.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:|Error |assert" "$out/t5_ce.log" | cut -c1-400 | head -n 12
timeout 170 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "ce:off;ce:on;ce:on,ce_chunk:512;ce:on,ce_chunk:2048;ce:on" --json "$out/exchange.json" \
  > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error|mismatch" "$out/exchange.log" | head -n 16
timeout 170 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  -rfE tests/test_symm_multigpu.py -k "not copy_engine" > "$out/t5.log" 2>&1
echo "== T5 rest rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:" "$out/t5.log" | cut -c1-400 | head -n 10
exit 0
