#!/usr/bin/env bash
# Session 13: the DIRECT epilogues (tlx/common/moe_epilogues.py: column pairs straight from the wgmma
# accumulator layout, no shared-memory conversion). Any machine with >= 1 H200 (uses GPUs 0 and 1 when
# there are two):  source .carry/setup.sh && bash scripts/device/x2_s26.sh
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l); g2=$(( ngpu > 1 ? 1 : 0 ))
D="swiglu:DIRECT=1;scatter:DIRECT=1;dswiglu:DIRECT=1"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
  tests/test_fused_moe_gpu.py -k "primitives or direct" > "$out/gpu_direct.log" 2>&1 &
p1=$!
[ "$g2" = 0 ] && wait $p1
CUDA_VISIBLE_DEVICES=$g2 timeout 300 python3 bench/fused_forms.py --shapes olmoe,deepseek-v2-lite,mixtral \
  --tokens 16384 --forms swiglu,scatter,dswiglu,scatter_dx --rep 40 --variant "conv=" --variant "direct=$D" --variant "direct_s6=$D;scatter:STAGES=6" \
  --json "$out/forms_direct.json" > "$out/forms_direct.log" 2>&1
r2=$?
wait $p1; r1=$?
echo "== GPU fused primitives + DIRECT rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_direct.log")"
grep -E "^(FAILED|ERROR)|Error" "$out/gpu_direct.log" | cut -c1-300 | head -n 8
echo "== fused forms conv vs direct rc=$r2"
grep -E "^\||^median" "$out/forms_direct.log"
tail -n 3 "$out/forms_direct.log" | grep -i error
exit 0
