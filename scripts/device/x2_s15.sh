#!/usr/bin/env bash
# Session 10, two GPUs, one call, with scripts/device/exp_recv_overlap.patch applied to the tree:
#   git apply scripts/device/exp_recv_overlap.patch && (device) source .carry/setup.sh && bash scripts/device/x2_s15.sh
# The overlapped receive copy, retried (one receiving program per SM, 64 x 256 copy tiles): the W=2
# grid first; only if the row form's T=4096 dispatch beats the landed 273-275 us, the correctness
# steps (T5 on peer pointers incl. the row-form test, GPU tiers beside memcheck).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
dispatch_w2
us=$(python3 - "$out/dispatch_w2.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
v = [r for r in rows if r.get("provider") == "rows_graph" and r.get("T") == 4096 and r.get("E") == 64]
print(int(v[0]["dispatch_us"]) if v else 9999)
PY
)
echo "== rows_graph T=4096 E=64 dispatch: $us us"
if [ "$us" -ge 265 ]; then echo "== not faster: stop"; exit 0; fi
t5_peer
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
tiers_memcheck 230 "$NO_W8"
