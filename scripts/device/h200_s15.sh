#!/usr/bin/env bash
# Written in session 10 after its last device call (not yet run), one GPU, two calls (each < 5 min):
#   source .carry/setup.sh && bash scripts/device/h200_s15.sh 1   # correctness
#   source .carry/setup.sh && bash scripts/device/h200_s15.sh 2   # measurements
# Session 10's CPU-only work: (a) the one-launch expert-major layout (tlx/common/routing.py;
# fused_experts takes it with TLX_DIST_ROUTING_KERNEL=1, off on GPUs until this passes) and (b) the
# dSwiGLU form's EARLY_H option (L2 prefetch of h before the main loop; TLX_DIST_FUSED_CONFIG).
# 1: the fused + layer GPU tests with the layout kernel on (incl. its own GPU test), the fused
#    primitives vs fp64 with EARLY_H, memcheck of the fused kernels (its layout section forces (a) on).
# 2: the layer table + GPU idle gaps with (a) off and on; the dSwiGLU form alone with (b) off and on.
# Then: flip ``auto`` to on for CUDA in tlx_dist/fused/api.py::_routing_kernel_runs if 1 passes and
# the gaps shrink; make EARLY_H the dswiglu default in tlx_dist/fused/tlx_backend.py FORMS if faster.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
if [ "${1:-1}" = 1 ]; then
  t0=$(date +%s)
  TLX_DIST_ROUTING_KERNEL=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 \
    tests/test_fused_moe_gpu.py tests/test_moe_gpu.py > "$out/gpu_tiers.log" 2>&1
  echo "== fused + layer GPU tests, layout kernel on rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
  t0=$(date +%s)
  TLX_DIST_FUSED_CONFIG="dswiglu:EARLY_H=1" timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_fused_moe_gpu.py -k "primitives_vs_fp64 or fused_vs_separate_vs_fp64" > "$out/gpu_early_h.log" 2>&1
  echo "== fused GPU tests with dswiglu:EARLY_H=1 rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_early_h.log")"
  t0=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 scripts/memcheck_fused.py > "$out/memcheck_fused.log" 2>&1
  echo "== memcheck fused rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok|FAILED' "$out/memcheck_fused.log" | tr '\n' ' ')"
  exit 0
fi
for rk in 0 1; do
  t0=$(date +%s)
  TLX_DIST_ROUTING_KERNEL=$rk timeout 80 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite \
    --tokens 4096,16384 --latency-tokens "" --reps 7 --gaps --providers fused,torchtitan \
    --json "$out/moe_layer_rk$rk.json" > "$out/moe_layer_rk$rk.log" 2>&1
  echo "== moe_layer + gaps, TLX_DIST_ROUTING_KERNEL=$rk rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^\| [a-z]" "$out/moe_layer_rk$rk.log"
  grep -A 4 "fused: GPU idle" "$out/moe_layer_rk$rk.log" | grep -E "step:|^ +[0-9]" | cut -c1-200 | head -n 20
done
for cfg in "" "dswiglu:EARLY_H=1"; do
  t0=$(date +%s)
  TLX_DIST_FUSED_CONFIG="$cfg" timeout 60 python3 bench/fused_forms.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite \
    --forms dswiglu --json "$out/forms_${cfg:+early}.json" > "$out/forms_${cfg:+early}.log" 2>&1
  echo "== dswiglu form, TLX_DIST_FUSED_CONFIG='$cfg' rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\|" "$out/forms_${cfg:+early}.log"
done
