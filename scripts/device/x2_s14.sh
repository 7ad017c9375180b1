#!/usr/bin/env bash
# Next two-GPU call (written in session 9, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/x2_s14.sh
# Validates and times session 9's static-capacity dispatch (the send waits only for readiness and
# sends raw slot codes; the expand kernel waits for the counts, computes the layout, decodes):
# GPU 0 the exchange + fused-EP GPU tiers (no W=8 cases), GPU 1 memcheck of every exchange kernel;
# then T5 on peer pointers (exact-capacity dispatch keeps the old flow: both are covered), the W=2
# grid (symm_graph / rows_graph are the static-capacity ops: targets T=128 <= 40 us, T=4096 <= 250),
# and the NVSHMEM route's dispatch tests (staged META carries the raw codes there too).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
tiers_memcheck 280 "$NO_W8"
t5_peer
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
dispatch_w2
t5_nvshmem "matches_all_to_all" 220
exit 0
