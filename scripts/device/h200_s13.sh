#!/usr/bin/env bash
# Written in session 9, not yet run (no device time was left), one GPU, one call (~200 s):  source .carry/setup.sh && bash scripts/device/h200_s13.sh
# Issue 9 item 4 (host cost): fbtriton's C launch path (TRITON_ENABLE_C_CACHE=1: the kernel cache
# lookup and the launch of a cached kernel in C, TensorDescriptor arguments included) against the
# Python JIT launch -- the host side of one eager OLMoE T=1024 fwd+bwd both ways; the TLX
# primitives vs fp64, graph capture and the fused layer under it (also the first GPU run of session
# 9's eager autograd.Function path around the fused kernels); the T=4096 eager layer table.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
for cc in 0 1; do
  t0=$(date +%s)
  TRITON_ENABLE_C_CACHE=$cc timeout 50 python3 bench/moe_layer.py --shapes olmoe --tokens 1024 --latency-tokens "" \
    --reps 3 --host-profile --providers fused,torchtitan --json "$out/host_cc$cc.json" > "$out/host_cc$cc.log" 2>&1
  echo "== host profile TRITON_ENABLE_C_CACHE=$cc rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -A 80 "host side" "$out/host_cc$cc.log" | grep -v "^--" | cut -c1-130 | head -n 85
done
t0=$(date +%s)
TRITON_ENABLE_C_CACHE=1 timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_fused_moe_gpu.py \
  -k "primitives_vs_fp64 or graph_capture or fused_vs_separate_bf16" > "$out/gpu_ccache.log" 2>&1
echo "== fused GPU tests under TRITON_ENABLE_C_CACHE=1 rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_ccache.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_ccache.log" | cut -c1-300 | head -n 6
t0=$(date +%s)
TRITON_ENABLE_C_CACHE=1 timeout 70 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b --tokens 4096 \
  --latency-tokens "" --reps 5 --json "$out/moe_layer_cc.json" > "$out/moe_layer_cc.log" 2>&1
echo "== moe_layer T=4096 with the C launch path rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/moe_layer_cc.log"
