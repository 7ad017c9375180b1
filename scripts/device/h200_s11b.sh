#!/usr/bin/env bash
# Session 8, one GPU, after MoELayer.forward stopped keeping the last step's graph:
#   source .carry/setup.sh && bash scripts/device/h200_s11b.sh
# The OLMoE layer's eager and CUDA-graph-replayed fwd+bwd latency at T = 1024 and 4096 (issue 9 item 4).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 250 python3 bench/moe_layer.py --shapes olmoe --tokens "" --latency-tokens 1024,4096 \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1
echo "== layer latency rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| (olmoe|shape)|failed" "$out/moe_latency.log" | cut -c1-300 | tail -n 4
python3 - "$out/moe_latency.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    for k, v in r.items():
        if k.endswith("_error"):
            print(r["T"], k, " ".join(v.split())[-400:])
PY
