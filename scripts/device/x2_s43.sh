#!/usr/bin/env bash
# Session 17, two GPUs, fifth call (< 3 min):  source .carry/setup.sh && bash scripts/device/x2_s43.sh
# The copy-engine combine's chunks on two copy streams in turn (ce_streams:2) against one, twice.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "ce:on;ce:on,ce_streams:2;ce:on,ce_streams:2,ce_chunk:1024;ce:on;ce:on,ce_streams:2;ce:on,ce_streams:2,ce_chunk:1024" \
  --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 16
exit 0
