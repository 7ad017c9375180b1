#!/usr/bin/env bash
# Written at the end of session 13 (not yet run), one GPU (< 5 min):
#   source .carry/setup.sh && bash scripts/device/h200_s16.sh
# One epilogue warp group per consumer (EPI_WG=2, five warp groups), written after session 13's last
# device call: its GPU tests (against the inline epilogue, bf16 / fp16, adversarial routing) and the
# scatter / dSwiGLU forms against the defaults (scatter: EPI_WG=1; dSwiGLU: inline) in one process;
# memcheck of the fused kernels with the scatter default (EPI_WG=1, landed in session 13 after its last
# memcheck run), the dout copy forced, and with EPI_WG=2 (issue 9 item 6: new kernels once under memcheck).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
W2="dswiglu:EPI_WG=2,REGS=104,EPI_REGS=120,STAGES=4,LAG=2,EPI_COLS=16;scatter:EPI_WG=2,REGS=104,EPI_REGS=120,EPI_COLS=32"
W2B="dswiglu:EPI_WG=2,REGS=96,EPI_REGS=128,STAGES=4,LAG=2,EPI_COLS=16;scatter:EPI_WG=2,REGS=104,EPI_REGS=120,STAGES=5,EPI_COLS=32"
t0=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 180 tests/test_fused_moe_gpu.py \
  -k "epilogue_warp_group" > "$out/gpu_epi2.log" 2>&1
echo "== GPU EPI_WG 1 / 2 vs inline rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_epi2.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_epi2.log" | cut -c1-300 | head -n 8
g8() { echo "$1" | sed 's/EPI_WG=2/EPI_WG=2,GROUP_M=8/g'; }  # Mixtral's wide outputs keep the default raster
timeout 150 python3 bench/fused_forms.py --shapes olmoe,deepseek-v2-lite --tokens 16384 \
  --forms scatter,dswiglu,scatter_dx --rep 40 --variant "base=" --variant "w2=$W2" --variant "w2b=$W2B" \
  --json "$out/forms_epi2.json" > "$out/forms_epi2.log" 2>&1
timeout 120 python3 bench/fused_forms.py --shapes mixtral --tokens 16384 --forms scatter,dswiglu,scatter_dx --rep 60 \
  --variant "base=" --variant "w2=$(g8 "$W2")" --json "$out/forms_epi2_mixtral.json" > "$out/forms_epi2_mixtral.log" 2>&1
echo "== forms, defaults vs one epilogue warp group per consumer"
grep -hE "^\| [a-z]|^median|Error" "$out/forms_epi2.log" "$out/forms_epi2_mixtral.log"
t0=$(date +%s)
for cfg in "" "$W2"; do
  TLX_DIST_FUSED_CONFIG="$cfg" TLX_DIST_FUSED_DOUT=copy PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 \
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_fused.py > "$out/memcheck_fused.log" 2>&1
  echo "== memcheck fused (config '${cfg:-defaults}', dout copy) rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok|FAILED' "$out/memcheck_fused.log" | tr '\n' ' ')"
done
exit 0
