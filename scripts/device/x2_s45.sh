#!/usr/bin/env bash
# Session 18, two GPUs, second call (< 10 min):  source .carry/setup.sh && bash scripts/device/x2_s45.sh
# (x2_s44 ran without .carry: stock triton, the project not on PYTHONPATH for torchrun's scripts)
# 1. SM vs CE at T=4096 / 16384 with each op's GPU timeline (where the CE combine's time goes);
# 2. the copy-engine cases in cold processes (empty Triton cache), one test each, the library's default
#    30 s wait: x2_s41 and x2_s44 saw the first fail and the second hang when they ran first and cold;
# 3. where the fused one fails: again with CUDA_MODULE_LOADING=EAGER (a spinning kernel vs a lazily
#    loaded one: loading may need a context sync).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 torchrun --standalone --nproc-per-node=2 bench/exchange_tiles.py --tokens 4096,16384 \
  --configs "ce:on;ce:off" --timeline --json "$out/exchange.json" > "$out/exchange.log" 2>&1
echo "== exchange rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\||Error:|mismatch" "$out/exchange.log" | head -n 16
grep -A 48 "ce:on T=16384 combine timeline" "$out/exchange.log" | head -n 50
cold() {  # name, env, -k expression, limit
  rm -rf ~/.triton/cache
  env $2 timeout $4 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider \
    --timeout $(( $4 - 20 )) -x -rfE --durations=5 -k "$3" tests/test_symm_multigpu.py > "$out/$1.log" 2>&1
  echo "== $1 ($2, -k $3) rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/$1.log" | tail -n 1)"
  grep -E "^(FAILED|ERROR)|Error:|^E  |RuntimeError|Timeout|s call " "$out/$1.log" | cut -c1-400 | head -n 14
}
cold cold_rows "X=1" "copy_engine_row_form_matches" 150
cold cold_fused "X=1" "overlapped_fused_ep and copy_engine" 200
if grep -q "1 passed" "$out/cold_fused.log"; then exit 0; fi
[ $(( $(date +%s)-t0 )) -lt 360 ] && cold cold_fused_eager "CUDA_MODULE_LOADING=EAGER" "overlapped_fused_ep and copy_engine" 200
exit 0
