#!/usr/bin/env bash
# Session 15, two GPUs, last call (< 2.5 min):  source .carry/setup.sh && bash scripts/device/x2_s34.sh
# The link's SM-copy ceiling with 16 programs per SM, then one more sample of issue 8's exchange targets
# (W=2, D=7168, E=64, K=8, graph-replayed, T=4096 / 16384) at the landed defaults.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 40 python3 bench/p2p_copy.py --mb 235 --sm --programs 16 > "$out/p2p16.log" 2>&1
echo "== link ceiling, 16 programs per SM [$(( $(date +%s)-t0 ))s]"
grep -E "^\||SM kernels|Error" "$out/p2p16.log"
timeout 90 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "default" --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error|mismatch" "$out/exchange.log" | head -n 6
exit 0
