#!/usr/bin/env bash
# Session 14, one GPU (< 9 min):  source .carry/setup.sh && bash scripts/device/h200_s17.sh
# TLX_DIST_FUSED_X=copy: the forward copies x's rows expert-major (index_select), SwiGLU reads them by
# TMA, dW13 is the plain grouped dW (the copy remade in the backward). Its GPU tests (fused vs separate
# vs fp64 with both copies), the forms it replaces (copy timed with them) on every shape, then the
# layer against the torchtitan-style layer with x gathered and with x copied (one process each).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 tests/test_fused_moe_gpu.py \
  -k "fused_vs_separate and xcopy" > "$out/gpu_xcopy.log" 2>&1
echo "== GPU fused vs separate vs fp64, x + dout copied rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_xcopy.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_xcopy.log" | cut -c1-300 | head -n 8
timeout 150 python3 bench/fused_forms.py --shapes mixtral,deepseek-v2-lite,deepseek-v3-rank,olmoe,qwen3-30b-a3b \
  --tokens 16384 --forms swiglu,swiglu_copy,wgrad_a,wgrad_a_copy --rep 40 --json "$out/forms_x.json" > "$out/forms_x.log" 2>&1
echo "== forms: x gathered vs copied (the index_select timed with the copy forms) [$(( $(date +%s)-t0 ))s]"
grep -hE "^\| [a-z]|^median|Error" "$out/forms_x.log"
SH=mixtral,deepseek-v2-lite,deepseek-v3-rank
for mode in gather copy; do
  TLX_DIST_FUSED_X=$mode timeout 150 python3 bench/moe_layer.py --shapes $SH --tokens 4096,16384 --latency-tokens "" \
    --reps 5 --providers fused,torchtitan --json "$out/layer_x_$mode.json" > "$out/layer_x_$mode.log" 2>&1
  echo "== layer, x $mode rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^\| [a-z]|median" "$out/layer_x_$mode.log" | head -n 8
done
exit 0
