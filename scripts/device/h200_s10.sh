#!/usr/bin/env bash
# Next one-GPU call (written in session 7, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/h200_s10.sh
# 1. Why bench/moe_layer.py's graph capture fails for every provider (issue 9 item 4: the layer's
#    graph-replayed latency at T=1024/4096 has never been reported): scripts/device/graph_bisect.py
#    captures each piece in its own process, in global and relaxed capture modes;
# 2. the latency bench again (relaxed mode if only that captures);
# 3. every fused form against its grouped GEMM on all five shapes (where the fused layer loses).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
for m in global relaxed; do
  t0=$(date +%s)
  timeout 200 python3 scripts/device/graph_bisect.py --T 1024 --mode $m > "$out/bisect_$m.log" 2>&1
  echo "== graph bisect mode=$m rc=$? [$(( $(date +%s)-t0 ))s]"; cat "$out/bisect_$m.log" | cut -c1-250
done
mode=global; grep -q "fused_fwd_bwd  *captured" "$out/bisect_global.log" || mode=relaxed
t0=$(date +%s)
timeout 150 python3 bench/moe_layer.py --shapes olmoe --tokens "" --latency-tokens 1024,4096 --capture-mode $mode \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1
echo "== layer latency (capture $mode) rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_latency.log" | tail -n 2
t0=$(date +%s)
timeout 120 python3 bench/fused_forms.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite,mixtral,deepseek-v3-rank \
  --json "$out/forms_all.json" > "$out/forms_all.log" 2>&1
echo "== fused forms rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\||median|err" "$out/forms_all.log"
