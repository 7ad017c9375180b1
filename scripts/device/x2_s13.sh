#!/usr/bin/env bash
# Session 9, two GPUs, one call:  source .carry/setup.sh && bash scripts/device/x2_s13.sh
# After the row form's block-by-block receive copy (RBLK counters; on real ranks the send kernel's
# last programs copy rows out as they land): GPU 0 runs the exchange + fused-EP GPU tiers (the
# emulated world's "blocks" mode) while GPU 1 runs memcheck over every exchange kernel; then T5 on
# peer pointers (the "overlap" mode, incl. the new row-form test), the W=2 dispatch grid, and the
# EP=2 layer bench.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
tiers_memcheck 250 "$NO_W8"
t5_peer
grep -E "^(FAILED|ERROR)|Error|assert" "$out/t5_peer.log" | cut -c1-300 | head -n 8
dispatch_w2
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/moe_layer.py --shapes olmoe --tokens 16384 \
  --json "$out/moe_layer_w2.json" > "$out/moe_layer_w2.log" 2>&1
echo "== EP=2 layer rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_layer_w2.log" | head -n 1
exit 0
