#!/usr/bin/env bash
# Session 16, two GPUs, last call (< 6 min):  source .carry/setup.sh && bash scripts/device/x2_s38.sh
# At the new defaults (one-launch combine of the row form, 4 summing x 2 sending programs an SM):
# 1. issue 8's exchange targets, W=2, D=7168, E=64, K=8, graph-replayed, T = 128 / 4096 / 16384, the
#    two-launch combine beside it, twice;  2. bench/dispatch.py (NCCL anchor at W=2, eager / graph / steady
#    state) at D=7168, E=64;  3. T5 on peer pointers.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 128,4096,16384 \
  --configs "default;comb:after;default" --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error|mismatch" "$out/exchange.log" | head -n 16
timeout 150 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 64 --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch.py rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E -A 24 "medians|Error" "$out/dispatch.log" | head -n 40
timeout 170 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  -rfE tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 peer pointers rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:" "$out/t5.log" | cut -c1-400 | head -n 10
exit 0
