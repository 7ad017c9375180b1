#!/usr/bin/env bash
# Next one-GPU call (written in session 5, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/h200_s6.sh
# Where the fused pipeline's backward loses to the separate one (issue 9: experts.bwd 146.6 ms fused vs
# 100.9 separate in h200_1gpu training): per-kernel GPU time of one fwd+bwd per provider.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 400 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b --tokens 16384 --latency-tokens "" --reps 5 \
  --profile --json "$out/moe_layer_prof.json" > "$out/moe_layer_prof.log" 2>&1
echo "== moe_layer profile rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 18 "per-kernel" "$out/moe_layer_prof.log" | cut -c1-130
tail -n 8 "$out/moe_layer_prof.log"
