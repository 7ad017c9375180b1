#!/usr/bin/env bash
# Session 10, two GPUs, one call (~7 min):  source .carry/setup.sh && bash scripts/device/x2_s16.sh
# The row form's overlapped receive copy, landed behind a size switch (tlx_dist/comm/symm.py
# _recv_mode: real ranks over peer pointers with T_max >= RECV_OVERLAP_MIN_TOKENS = 8192, or forced by
# TLX_DIST_RECV_OVERLAP=0|1): the E=64 grid with it off and on (T=8192 is the open point), T5 on peer
# pointers (the row-form test runs both modes), the EP=2 layer at T=16384 (auto: overlap), and the
# GPU tiers (emulated world: the block-by-block expand copy) beside memcheck.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
for ov in 0 1; do  # (T=4096 and 16384 off were measured this session at 274 / 862 us; 4096 on at 310)
  t0=$(date +%s); toks=8192; [ $ov = 1 ] && toks=8192,16384
  TLX_DIST_RECV_OVERLAP=$ov timeout 80 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens $toks \
    --dims 7168 --experts 64 --json "$out/dispatch_ov$ov.json" > "$out/dispatch_ov$ov.log" 2>&1
  echo "== dispatch W=2 E=64, TLX_DIST_RECV_OVERLAP=$ov rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -A 20 "^W=2" "$out/dispatch_ov$ov.log" | grep -E "^(provider|rows_graph)"
done
t5_peer
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 80 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== EP=2 layer (auto: overlap at T=16384) rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_layer_w2.log" | head -n 1
tiers_memcheck 215 "$NO_W8"
