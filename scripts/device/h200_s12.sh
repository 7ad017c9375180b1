#!/usr/bin/env bash
# Next one-GPU call (written in session 8, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/h200_s12.sh
# Issue 9: the layer table regenerated with the current code (fused, separate, torchtitan-style;
# T = 4096, 16384; all five shapes) with the graph-replayed latency, and every fused form against
# the plain grouped GEMM of the same FLOPs (where the fused layer still loses time); first, where the
# host spends an eager fwd+bwd at T=1024 (eager 4.02 ms against 1.29 ms replayed, session 8).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 120 python3 bench/moe_layer.py --shapes olmoe --tokens 1024 --latency-tokens "" --reps 3 --host-profile \
  --json "$out/host.json" > "$out/host_profile.log" 2>&1
echo "== host profile rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 14 "host side" "$out/host_profile.log" | cut -c1-140
t0=$(date +%s)
timeout 330 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens 1024,4096 --reps 5 \
  --json "$out/moe_layer.json" > "$out/moe_layer.log" 2>&1
echo "== moe_layer rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_layer.log"
t0=$(date +%s)
timeout 150 python3 bench/fused_forms.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite,mixtral,deepseek-v3-rank \
  --json "$out/forms_all.json" > "$out/forms_all.log" 2>&1
echo "== fused forms rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\||median|err" "$out/forms_all.log"
