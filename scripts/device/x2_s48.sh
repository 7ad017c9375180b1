#!/usr/bin/env bash
# Session 18, two GPUs, fifth call (< 4 min):  source .carry/setup.sh && bash scripts/device/x2_s48.sh
# The copy-engine combine's copy sizes with the ranks aligned (x2_s46's timeline at the default: the
# copies are the critical path, 8 x ~78 us + 7 gaps of ~2.3 us + ~11 us lead + ~12 us last signal, and
# the sum ends < 1 us after the last signal): fewer, larger copies with the last one cut down; twice.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
C="ce:on;ce:on,ce_chunk:4096;ce:on,ce_chunk:4096,ce_tail:1024;ce:on,ce_chunk:4096,ce_tail:512;ce:on,ce_chunk:3072"
timeout 200 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "$C;$C" --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 24
exit 0
