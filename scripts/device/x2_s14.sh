#!/usr/bin/env bash
# Next two-GPU calls (written in session 9, not yet run), each < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s14.sh 1
#   source .carry/setup.sh && bash scripts/device/x2_s14.sh 2
# Validates and times session 9's static-capacity dispatch (the send waits only for readiness and
# sends raw slot codes; the expand kernel waits for the counts, computes the layout, decodes):
# GPU 0 the exchange + fused-EP GPU tiers (no W=8 cases), GPU 1 memcheck of every exchange kernel;
# then T5 on peer pointers (exact-capacity dispatch keeps the old flow: both are covered), the W=2
# grid (symm_graph / rows_graph are the static-capacity ops: targets T=128 <= 40 us, T=4096 <= 250).
# 2: the NVSHMEM route's dispatch and layer tests (staged META carries the raw codes there too; the
# fused EP layer now runs there), the EP=2 layer bench, and EP=2 training with moe_pipeline=auto
# (now the fused EP layers).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
if [ "${1:-1}" = 1 ]; then
  tiers_memcheck 270 "$NO_W8"
  t5_peer
  grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
  dispatch_w2
  exit 0
fi
t5_nvshmem "matches_all_to_all" 220
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== EP=2 layer rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_layer_w2.log" | head -n 1
train_ep2 auto
