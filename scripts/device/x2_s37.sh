#!/usr/bin/env bash
# Session 16, two GPUs, after x2_s36 (one-launch combine only in the row form; per-row adds for tall tiles)
# (< 9.5 min):  source .carry/setup.sh && bash scripts/device/x2_s37.sh
# 1. T5 on peer pointers with the one-launch combine, incl. its new tests.
# 2. The exchange at W=2, D=7168, E=64, K=8, graph-replayed: the two-launch combine vs the one-launch one at
#    its default and other summing x sending programs per SM.
# 3. bench/dispatch.py at T=16384, D=7168, E=64 with --profile: each kernel's GPU time (where the dispatch's
#    time goes besides the transfer).
# 4. GPU 0: the emulated world's tier at W = 2 / 4 (the per-block counters, "blocks"), graph capture, W = 1.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  -rfE tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 peer pointers rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:" "$out/t5.log" | cut -c1-400 | head -n 10
timeout 200 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "comb:after;default;comb_recv:4x2;comb_recv:4x3;comb_recv:3x4;comb_recv:4x6" \
  --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error|mismatch" "$out/exchange.log" | head -n 16
timeout 120 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 16384 --dims 7168 --experts 64 \
  --profile --json "$out/dispatch.json" > "$out/dispatch.log" 2>&1
echo "== dispatch T=16384 profile rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||kernel|Error" "$out/dispatch.log" | head -n 40
CUDA_VISIBLE_DEVICES=0 timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
  tests/test_symm_gpu.py -k "odd_shapes or capture or world_size_one or launches or bounded or random-4" \
  > "$out/emu.log" 2>&1
echo "== GPU 0: emulated world / world size 1 rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/emu.log")"
grep -E "^(FAILED|ERROR)" "$out/emu.log" | cut -c1-300 | head -n 6
exit 0
