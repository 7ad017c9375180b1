#!/usr/bin/env bash
# Session 8, one GPU:  source .carry/setup.sh && bash scripts/device/h200_s11.sh 0
# 0. Where bench/moe_layer.py's CUDA-graph capture breaks (session 7: cudaErrorStreamCaptureImplicit for
#    every provider): every piece in global mode, the layer pieces again in relaxed mode; the first
#    error of each failed capture, with its frames, comes back in bisect/.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out" /tmp/bisect  # at most 8 files come back: failed logs only
if [ "${1:-0}" = 0 ]; then
  t0=$(date +%s)
  timeout 270 python3 scripts/device/graph_bisect.py --T 1024 --mode global --log-dir /tmp/bisect > "$out/bisect_global.log" 2>&1
  echo "== graph bisect global rc=$? [$(( $(date +%s)-t0 ))s]"; cut -c1-260 "$out/bisect_global.log"
  t0=$(date +%s)
  timeout 120 python3 scripts/device/graph_bisect.py --T 1024 --mode relaxed --pieces tt_fwd_bwd,fused_fwd_bwd \
    --log-dir /tmp/bisect > "$out/bisect_relaxed.log" 2>&1
  echo "== graph bisect relaxed rc=$? [$(( $(date +%s)-t0 ))s]"; cut -c1-260 "$out/bisect_relaxed.log"
  for f in $(grep -l "FIRST ERROR" /tmp/bisect/*.log | head -n 5); do cp "$f" "$out/"; done
  f=$(grep -l "FIRST ERROR" /tmp/bisect/*_global.log | head -n 1)
  [ -n "$f" ] && { echo "== first error in $f"; grep -A 40 "FIRST ERROR" "$f" | grep -vE "^\s*\^+\s*$" | cut -c1-200 | head -n 40; }
  exit 0
fi
