#!/usr/bin/env bash
# Session 18, two GPUs, first call (< 8 min):  source .carry/setup.sh && bash scripts/device/x2_s44.sh
# 1. T5 whole at 6a849ae+ (the copy-engine code was tidied after its last two-GPU run);
# 2. the copy-engine cases alone in a cold process, with a 120 s wait (x2_s41: first failed, second hung);
# 3. SM vs CE at T=4096 / 16384, with each op's GPU timeline (where the CE combine's time goes);
# 4. a copy engine and SM stores on one direction at once: does the link carry more than either alone?
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 200 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
  -rfE tests/test_symm_multigpu.py > "$out/t5.log" 2>&1
echo "== T5 rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/t5.log" | cut -c1-300 | head -n 16
rm -rf ~/.triton/cache
TLX_DIST_EXCHANGE_TIMEOUT_S=120 timeout 200 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q \
  -p no:cacheprovider --timeout 150 -rfE -k copy_engine tests/test_symm_multigpu.py > "$out/t5_ce.log" 2>&1
echo "== T5 -k copy_engine, cold cache rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_ce.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/t5_ce.log" | cut -c1-300 | head -n 16
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "ce:on;ce:off" --timeline --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 16
grep -A 60 "ce:on T= 16384 combine timeline\|ce:on T=16384 combine timeline" "$out/exchange.log" | head -n 62
timeout 60 python bench/p2p_copy.py --mb 235 --ce-raw --mixed > "$out/p2p.log" 2>&1
echo "== p2p rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error" "$out/p2p.log" | head -n 30
exit 0
