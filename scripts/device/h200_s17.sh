#!/usr/bin/env bash
# Session 14, one GPU, two calls (each < 9 min):
#   source .carry/setup.sh && bash scripts/device/h200_s17.sh 1     # tests + forms
#   source .carry/setup.sh && bash scripts/device/h200_s17.sh 2     # the new defaults: tests, layer
# 1: TLX_DIST_FUSED_X=copy (x's rows copied expert-major, SwiGLU by TMA, dW13 the plain grouped dW) and
#    the dout-copy dSwiGLU form's own config (dswiglu_copy: EPI_WG 1 / 2, PINGPONG): GPU tests, then the
#    forms in interleaved rounds (variants of one form timed in turn, medians of 3 rounds).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
W2="EPI_WG=2,REGS=104,EPI_REGS=120,STAGES=4,LAG=2,EPI_COLS=16"
W2B="EPI_WG=2,REGS=96,EPI_REGS=128,STAGES=4,LAG=2,EPI_COLS=16"
W2C="EPI_WG=2,REGS=96,EPI_REGS=128,STAGES=4,LAG=2,EPI_COLS=32"
W1="EPI_WG=1,REGS=136,EPI_REGS=184,STAGES=4,LAG=2,EPI_COLS=32"
PP="EPI_WG=0,PINGPONG=1,REGS=232,EPI_COLS=32"
if [ "${1:-1}" = 1 ]; then
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/test_fused_moe_gpu.py \
  -k "xcopy or epilogue_warp_group" > "$out/gpu_tests.log" 2>&1
echo "== GPU: x + dout copied vs separate vs fp64; EPI_WG 1 / 2 (incl. dswiglu_copy) vs inline rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_tests.log" | cut -c1-300 | head -n 8
timeout 130 python3 bench/fused_forms.py --shapes mixtral,deepseek-v2-lite,deepseek-v3-rank,olmoe,qwen3-30b-a3b \
  --tokens 16384 --forms swiglu,swiglu_copy,wgrad_a,wgrad_a_copy --rep 30 --rounds 3 --json "$out/forms_x.json" \
  > "$out/forms_x.log" 2>&1
echo "== forms: x gathered vs copied (index_select timed with the copy forms) [$(( $(date +%s)-t0 ))s]"
grep -hE "^\| [a-z]|Error" "$out/forms_x.log"
v() { echo "--variant base= --variant w2=dswiglu_copy:$1$W2 --variant w2b=dswiglu_copy:$1$W2B --variant w2c=dswiglu_copy:$1$W2C --variant w1=dswiglu_copy:$1$W1 --variant pp=dswiglu_copy:$1$PP"; }
timeout 110 python3 bench/fused_forms.py --shapes deepseek-v2-lite,olmoe,qwen3-30b-a3b,deepseek-v3-rank --tokens 16384 \
  --forms dswiglu_copy --rep 30 --rounds 3 $(v "") --json "$out/forms_dcopy.json" > "$out/forms_dcopy.log" 2>&1
timeout 70 python3 bench/fused_forms.py --shapes mixtral --tokens 16384 --forms dswiglu_copy --rep 60 --rounds 3 \
  $(v "GROUP_M=8,") --json "$out/forms_dcopy_mixtral.json" > "$out/forms_dcopy_mixtral.log" 2>&1
echo "== dswiglu_copy: inline vs EPI_WG 2 / 1 vs PINGPONG [$(( $(date +%s)-t0 ))s]"
grep -hE "^\| [a-z]|Error" "$out/forms_dcopy.log" "$out/forms_dcopy_mixtral.log" | cut -d'|' -f2-11
timeout 60 python3 bench/fused_forms.py --shapes deepseek-v2-lite,olmoe --tokens 16384 --forms dswiglu --rep 30 --rounds 3 \
  --variant base= --variant r232=dswiglu:REGS=232 > "$out/forms_dgather.log" 2>&1
echo "== dswiglu gathered: REGS 216 vs 232 [$(( $(date +%s)-t0 ))s]"
grep -hE "^\| [a-z]|Error" "$out/forms_dgather.log" | cut -d'|' -f2-11
exit 0
fi
# 2 (after 1, at the new defaults: x copied from F 4096, dswiglu REGS 232, dswiglu_copy EPI_WG=2 / PINGPONG
#    from D 4096): GPU tests of the copy paths, DeepSeek-V3's PINGPONG with / without GROUP_M 8, then the
#    layer table on every shape, and OLMoE / Qwen3 with the dout copy forced.
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 tests/test_fused_moe_gpu.py \
  -k "(fused_vs_separate and copy and not pingpong) or primitives_vs_fp64" > "$out/gpu_tests2.log" 2>&1
echo "== GPU: dout copy / x + dout copy vs separate vs fp64, primitives vs fp64 rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tests2.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_tests2.log" | cut -c1-300 | head -n 8
timeout 60 python3 bench/fused_forms.py --shapes deepseek-v3-rank --tokens 16384 --forms dswiglu_copy --rep 40 --rounds 3 \
  --variant "deep_g8=" --variant "deep_g1=dswiglu_copy:EPI_WG=0,PINGPONG=1,REGS=232,EPI_COLS=32,STAGES=6,LAG=4" \
  > "$out/forms_deep.log" 2>&1
timeout 40 python3 bench/fused_forms.py --shapes qwen3-30b-a3b --tokens 16384 --forms dswiglu --rep 30 --rounds 3 \
  --variant "r232=" --variant "r216=dswiglu:REGS=216" > "$out/forms_q.log" 2>&1
echo "== forms [$(( $(date +%s)-t0 ))s]"
grep -hE "^\| [a-z]|Error" "$out/forms_deep.log" "$out/forms_q.log" | cut -d'|' -f2-11
timeout 290 python3 bench/moe_layer.py --tokens 4096,16384 --latency-tokens "" --reps 5 --providers fused,torchtitan \
  --json "$out/layer.json" > "$out/layer.log" 2>&1
echo "== layer, new defaults rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]|median" "$out/layer.log" | head -n 14 || true
grep -qE "^\| [a-z]" "$out/layer.log" || grep -E "TF/s|failed" "$out/layer.log"  # cut short: the per-row lines
TLX_DIST_FUSED_DOUT=copy timeout 80 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b --tokens 16384 \
  --latency-tokens "" --reps 5 --providers fused,torchtitan --json "$out/layer_dcopy.json" > "$out/layer_dcopy.log" 2>&1
echo "== layer, OLMoE / Qwen3 with the dout copy rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]|median" "$out/layer_dcopy.log" | head -n 6
exit 0
