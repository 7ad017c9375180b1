#!/usr/bin/env bash
# Written in session 10 after its last device call (not yet run), two GPUs, one call (~8 min):
#   source .carry/setup.sh && bash scripts/device/x2_s17.sh
# What session 10 could not finish on two GPUs: the GPU tiers whose 215 s box ran out (emulated
# world, block-by-block receive copy: 20 of 23 had passed), EP=2 training with the overlapped
# receive copy (configs/h200_2gpu_ep2.toml has T_max = 32768 per rank: auto turns it on; session
# 10's training run predates it), and the W=2 grid with the new rank-aligned per-op columns
# (bench/dispatch.py "disp al." / "comb al.": a device barrier before each timed op, so the ranks'
# host launch skew is not counted; issue 8's T=128 cells have read 41-113 us across runs).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
tiers_memcheck 300 "$NO_W8"
train_ep2 auto
dispatch_w2
