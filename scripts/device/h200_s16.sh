#!/usr/bin/env bash
# Written at the end of session 13 (not yet run), one GPU, two calls (each < 8 min):
#   source .carry/setup.sh && bash scripts/device/h200_s16.sh 1
#   source .carry/setup.sh && bash scripts/device/h200_s16.sh 2
# Written after session 13's last device call: one epilogue warp group per consumer (EPI_WG=2, five warp
# groups) and dSwiGLU's ping-pong consumers (PINGPONG, with the dout copy). Call 1: their GPU tests
# (against the inline epilogue and the fp64 reference) and their timing against the defaults in one
# process. Call 2: memcheck of the fused kernels with the defaults (the scatter's EPI_WG=1, landed in
# session 13 after the last memcheck) and the dout copy, with EPI_WG=2, and with PINGPONG (issue 9
# item 6: every new kernel once under memcheck).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
W2="dswiglu:EPI_WG=2,REGS=104,EPI_REGS=120,STAGES=4,LAG=2,EPI_COLS=16;scatter:EPI_WG=2,REGS=104,EPI_REGS=120,EPI_COLS=32"
W2B="dswiglu:EPI_WG=2,REGS=96,EPI_REGS=128,STAGES=4,LAG=2,EPI_COLS=16;scatter:EPI_WG=2,REGS=104,EPI_REGS=120,STAGES=5,EPI_COLS=32"
PP="dswiglu:PINGPONG=1,REGS=232,EPI_COLS=32"
PP2="dswiglu:PINGPONG=1,REGS=240"
if [ "${1:-1}" = 1 ]; then
t0=$(date +%s)
timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_fused_moe_gpu.py \
  -k "epilogue_warp_group or pingpong" > "$out/gpu_new.log" 2>&1
echo "== GPU EPI_WG 1 / 2 vs inline, dout copy + PINGPONG vs fp64 rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_new.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_new.log" | cut -c1-300 | head -n 8
g8() { echo "$1" | sed 's/EPI_WG=2/EPI_WG=2,GROUP_M=8/g; s/PINGPONG=1/PINGPONG=1,GROUP_M=8/g'; }  # Mixtral keeps its raster
timeout 140 python3 bench/fused_forms.py --shapes olmoe,deepseek-v2-lite --tokens 16384 \
  --forms scatter,dswiglu,dswiglu_copy,scatter_dx --rep 40 --variant "base=" --variant "w2=$W2" --variant "w2b=$W2B" \
  --variant "pp=$PP" --variant "pp2=$PP2" --json "$out/forms_new.json" > "$out/forms_new.log" 2>&1
timeout 110 python3 bench/fused_forms.py --shapes mixtral --tokens 16384 --forms scatter,dswiglu_copy,scatter_dx --rep 60 \
  --variant "base=" --variant "w2=$(g8 "$W2")" --variant "pp=$(g8 "$PP")" --json "$out/forms_new_mixtral.json" \
  > "$out/forms_new_mixtral.log" 2>&1
echo "== forms: defaults vs EPI_WG=2 vs PINGPONG (dswiglu_copy: dSwiGLU from the dout copy)"
grep -hE "^\| [a-z]|^median|Error" "$out/forms_new.log" "$out/forms_new_mixtral.log"
exit 0
fi
t0=$(date +%s)
for cfg in "" "$W2" "$PP"; do
  TLX_DIST_FUSED_CONFIG="$cfg" TLX_DIST_FUSED_DOUT=copy PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 140 \
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_fused.py > "$out/memcheck_fused.log" 2>&1
  echo "== memcheck fused (config '${cfg:-defaults}', dout copy) rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok|FAILED' "$out/memcheck_fused.log" | tr '\n' ' ')"
done
exit 0
