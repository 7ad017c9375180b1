#!/usr/bin/env bash
# Session 11, two GPUs, one call (< 5 min):  source .carry/setup.sh && bash scripts/device/x2_s18.sh
# Issue 8's bandwidth target (>= 350 GB/s per direction at T=16384) is missed by the send (681 us,
# 345 GB/s alone) and the combine's kernels (reduce_send 699 + reduce_recv 193 us): all launch
# 4 programs per SM of 4 warps over 8 x 512 tiles, so at most 16 warps per SM move rows. This sweeps
# their launch shapes (tile, warps, programs per SM) with bench/exchange_tiles.py, graph-replayed,
# ranks aligned, each shape checked against the all-to-all anchor first.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 280 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --json "$out/exchange_tiles.json" > "$out/exchange_tiles.log" 2>&1
echo "== exchange launch shapes rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error" "$out/exchange_tiles.log" | head -n 40
