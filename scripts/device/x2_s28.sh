#!/usr/bin/env bash
# Session 13: the epilogue warp group (config EPI_WG: the scatter and dSwiGLU epilogues in a fourth warp
# group, reading the consumers' fp32 accumulators from shared memory while they run the next tile).
# Two GPUs (< 8 min):  source .carry/setup.sh && bash scripts/device/x2_s28.sh
# GPU 0: the fused GPU tests with and without EPI_WG (fp64 reference, inline vs handed-off epilogue);
# GPU 1: the forms it applies to, default vs three EPI_WG configs, one process per shape group.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
E1="dswiglu:EPI_WG=1,REGS=136,EPI_REGS=184,STAGES=4,LAG=2,EPI_COLS=32;scatter:EPI_WG=1,REGS=152,EPI_REGS=152,EPI_COLS=32"
E2="dswiglu:EPI_WG=1,REGS=152,EPI_REGS=152,STAGES=4,LAG=2,EPI_COLS=32;scatter:EPI_WG=1,REGS=152,EPI_REGS=152"
E3="dswiglu:EPI_WG=1,REGS=120,EPI_REGS=200,STAGES=4,LAG=2,EPI_COLS=32;scatter:EPI_WG=1,REGS=152,EPI_REGS=152,STAGES=5,EPI_COLS=32"
g8() { echo "$1" | sed 's/EPI_WG=1/EPI_WG=1,GROUP_M=8/g'; }
t0=$(date +%s)
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 180 \
    tests/test_fused_moe_gpu.py -k "primitives or epilogue_warp_group" > "$out/gpu_epi.log" 2>&1
  echo $? > "$out/gpu_epi.rc"
  # x2_s27's two sweep winners on the other shapes: SwiGLU at LAG 1 (DeepSeek-V2-Lite 0.80 -> 0.89x)
  # and dW13 at GROUP_M 8 (Mixtral 0.78 -> 0.93x; the others have <= 16 column tiles)
  CUDA_VISIBLE_DEVICES=0 timeout 110 python3 bench/fused_forms.py --shapes qwen3-30b-a3b,deepseek-v3-rank,olmoe,deepseek-v2-lite \
    --tokens 16384 --forms swiglu,wgrad_a --rep 40 --variant "base=" --variant "lag1=swiglu:STAGES=4,LAG=1;wgrad_a:GROUP_M=8" \
    --json "$out/forms_lag1.json" > "$out/forms_lag1.log" 2>&1 ) &
p1=$!
( CUDA_VISIBLE_DEVICES=1 timeout 170 python3 bench/fused_forms.py --shapes olmoe,deepseek-v2-lite,qwen3-30b-a3b \
    --tokens 16384 --forms scatter,dswiglu,scatter_dx --rep 40 --variant "base=" --variant "e1=$E1" \
    --variant "e2=$E2" --variant "e3=$E3" --json "$out/forms_epi.json" > "$out/forms_epi.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 130 python3 bench/fused_forms.py --shapes mixtral,deepseek-v3-rank --tokens 16384 \
    --forms scatter,dswiglu,scatter_dx --rep 60 --variant "base=" --variant "e1=$(g8 "$E1")" \
    --variant "e3=$(g8 "$E3")" --json "$out/forms_epi_big.json" > "$out/forms_epi_big.log" 2>&1 ) &
p2=$!
wait $p1; wait $p2
echo "== GPU fused tests, default + EPI_WG rc=$(cat "$out/gpu_epi.rc") [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_epi.log")"
grep -E "^(FAILED|ERROR)|Timeout|Error" "$out/gpu_epi.log" | cut -c1-300 | head -n 10
echo "== forms, default vs EPI_WG"
grep -hE "^\| [a-z]|^median" "$out/forms_epi.log" "$out/forms_epi_big.log"
grep -hE "Error|error" "$out/forms_epi.log" "$out/forms_epi_big.log" | head -n 5
echo "== forms, SwiGLU LAG 1 + dW13 GROUP_M 8"
grep -hE "^\| [a-z]|^median|Error" "$out/forms_lag1.log"
exit 0
