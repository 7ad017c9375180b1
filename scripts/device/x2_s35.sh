#!/usr/bin/env bash
# Session 16, two GPUs (< 9 min):  source .carry/setup.sh && bash scripts/device/x2_s35.sh
# 1. T5 on peer pointers with the one-launch combine (symm._comb_mode "overlap"), incl. its new tests
#    (bit-equal to the ARRIVE path, counters zeroed, one kernel; a rank that skips a combine).
# 2. The exchange at W=2, D=7168, E=64, K=8, graph-replayed: the combine's two-launch path vs the one-launch
#    combine at its default and other summing / sending program counts.
# 3. The link's ceilings: copy engines by cuMemcpyPeerAsync on dedicated streams, SM push variants.
# 4. GPU 0: the emulated world's tiers (symm, fused EP), which run the per-block counters ("blocks").
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 170 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 120 \
  tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 peer pointers rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:" "$out/t5.log" | cut -c1-300 | head -n 8
timeout 170 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "comb:after;default;comb_recv:1x4;comb_recv:4x4;comb_recv:2x8;comb_recv:2x2" \
  --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error|error|mismatch" "$out/exchange.log" | head -n 16
timeout 90 python3 bench/p2p_copy.py --mb 235,1024 --reps 9 --sm --programs 8 --ce-raw --sm-variants \
  > "$out/p2p.log" 2>&1
echo "== link ceilings rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||SM |Copy|Error" "$out/p2p.log" | head -n 30
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 \
  tests/test_symm_gpu.py > "$out/emu.log" 2>&1
echo "== GPU 0: emulated world / world size 1 rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/emu.log")"
grep -E "^(FAILED|ERROR)" "$out/emu.log" | cut -c1-300 | head -n 6
exit 0
