#!/usr/bin/env bash
# Next two-GPU calls (written in session 8, not yet run), each < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s12.sh 1   # FIRST: validates the expanded form's own-rows change
#   source .carry/setup.sh && bash scripts/device/x2_s12.sh 2
# 1. GPU 0: the exchange + fused-EP GPU tiers (all 27); GPU 1: memcheck of every exchange kernel;
#    then T5 on peer pointers and the W=2 grid (symm_graph is the form that changed);
# 2. T5 on the NVSHMEM route (all 7), the EP=2 layer bench (fused EP vs separate over symm vs
#    all-to-all, OLMoE T=16384/rank), and EP=2 training, moe_pipeline fused vs separate (decides
#    whether pipeline="auto" should take the fused EP layer).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
if [ "${1:-1}" = 1 ]; then
  tiers_memcheck 330
  t5_peer
  dispatch_w2
  exit 0
fi
t5_nvshmem "" 200
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== EP=2 layer (fused EP vs symm vs all-to-all) rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_layer_w2.log"
for p in fused separate; do train_ep2 "$p"; done
