#!/usr/bin/env bash
# Written in session 10 after its last device call (not yet run), one GPU (~5 min):
#   source .carry/setup.sh && bash scripts/device/h200_s15.sh
# The one-launch expert-major layout (tlx/common/routing.py; fused_experts takes it with
# TLX_DIST_ROUTING_KERNEL=1, default off on GPUs until this passes): its GPU test, the fused GPU
# tests through it, memcheck of the fused kernels (the layout section forces it on), then the
# T=4096 / 16384 layer table and the GPU idle gaps with it off and on. If the tests pass and the
# gaps shrink, flip ``auto`` to on for CUDA in tlx_dist/fused/api.py::_routing_kernel_runs.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
TLX_DIST_ROUTING_KERNEL=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 \
  tests/test_fused_moe_gpu.py tests/test_moe_gpu.py > "$out/gpu_tiers.log" 2>&1
echo "== fused + layer GPU tests, layout kernel on rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/memcheck_fused.py > "$out/memcheck_fused.log" 2>&1
echo "== memcheck fused rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok|FAILED' "$out/memcheck_fused.log" | tr '\n' ' ')"
for rk in 0 1; do
  t0=$(date +%s)
  TLX_DIST_ROUTING_KERNEL=$rk timeout 80 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite \
    --tokens 4096,16384 --latency-tokens "" --reps 7 --gaps --providers fused,torchtitan \
    --json "$out/moe_layer_rk$rk.json" > "$out/moe_layer_rk$rk.log" 2>&1
  echo "== moe_layer + gaps, TLX_DIST_ROUTING_KERNEL=$rk rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^\| [a-z]" "$out/moe_layer_rk$rk.log"
  grep -A 4 "fused: GPU idle" "$out/moe_layer_rk$rk.log" | grep -E "idle|step:|^ +[0-9]" | cut -c1-200 | head -n 30
done
