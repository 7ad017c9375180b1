#!/usr/bin/env bash
# Next two-GPU call (written in session 5, not yet run), < 10 min, <= 8 files in $OUT (after
# scripts/device/h200_s6.sh 1 has passed on either kind):
#   source .carry/setup.sh && bash scripts/device/x2_s6.sh
# 0. T5 on peer pointers (the exchange kernels changed on CPU after session 5's two-GPU runs);
# 1. the row-form exchange (rows_graph: what the fused EP pipeline pays for the exchange) against
#    NCCL and the copying form, with per-kernel profiles -- issue 8's targets;
# 2. where the fused EP pipeline loses its backward (per-kernel profile of one fwd+bwd per provider)
#    -- issue 9.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider tests/test_symm_multigpu.py \
  > "$out/t5_peer.log" 2>&1
echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
t0=$(date +%s)
timeout 240 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64,256 --profile --json "$out/dispatch_rows_w2.json" > "$out/dispatch_rows_w2.log" 2>&1
echo "== dispatch rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 20 "^W=2" "$out/dispatch_rows_w2.log"
for T in 128 4096 16384; do grep -A 8 "rows_graph E=64 D=7168 T=$T " "$out/dispatch_rows_w2.log"; done
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 --profile \
  --json "$out/moe_layer_prof_w2.json" > "$out/moe_layer_prof_w2.log" 2>&1
echo "== moe_layer EP profile rc=$? [$(( $(date +%s)-t0 ))s]"; grep -v "^W1" "$out/moe_layer_prof_w2.log" | grep -A 18 "per-kernel\|^W=2" | cut -c1-130
