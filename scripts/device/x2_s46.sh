#!/usr/bin/env bash
# Session 18, two GPUs, third call (< 5 min):  source .carry/setup.sh && bash scripts/device/x2_s46.sh
# 1. the copy-engine combine at T=16384: summing programs per SM (ce_sum), the last copy cut down
#    (ce_tail), the summing tile -- twice, in turn (x2_s45's timeline: 8 copies of ~78 us with ~2.5 us
#    gaps, then ~70 us from the last signal to the end of the sum);
# 2. the copy-engine vs SM row-form test in a cold process again, with the barrier after each rep's
#    counter check (x2_s45: rank 1 read a count rank 0's next dispatch had already added).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
C="ce:on;ce:on,ce_sum:8;ce:on,ce_tail:256;ce:on,ce_sum:8,ce_tail:256;ce:on,ce_sum:8,ce_tail:512"
C="$C;ce:on,reduce_recv:16x512w4;ce:on,ce_sum:8,ce_tail:256,reduce_recv:16x512w4;ce:on,ce_sum:8,ce_tail:256,ce_chunk:1024"
timeout 240 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 16384 \
  --configs "$C;$C" --timeline --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 24
grep -E -A 1 "combine timeline" "$out/exchange.log" | grep spans | head -n 16
rm -rf ~/.triton/cache
timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 130 -x \
  -rfE -k copy_engine_row_form_matches tests/test_symm_multigpu.py > "$out/cold_rows.log" 2>&1
echo "== cold_rows rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/cold_rows.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/cold_rows.log" | cut -c1-300 | head -n 8
exit 0
