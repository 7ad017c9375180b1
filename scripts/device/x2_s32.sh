#!/usr/bin/env bash
# Written at the end of session 14 (not yet run). Two GPUs if lent (< 8 min); on one GPU run part 1 only:
#   source .carry/setup.sh && bash scripts/device/x2_s32.sh 1      # one GPU
#   source .carry/setup.sh && bash scripts/device/x2_s32.sh 2      # two GPUs
# 1. What changed after session 14's last device call (review fixes): the ping-pong dSwiGLU GPU test with
#    its corrected spec, the deep-reduction defaults (D 4096: DSWIGLU_COPY_DEEP, GROUP_M 8) vs fp64, every
#    fused_vs_separate case, the fused EP tiers with the bulk send asserted; then where DeepSeek-V2-Lite's
#    T=4096 layer (1.37x of 1.4x) spends its time: GPU idle gaps and the per-kernel profile.
# 2. Two ranks: T5 on peer pointers with TLX_DIST_EXCHANGE_BULK=6 (test_symm_multigpu.py only: the NVSHMEM
#    file needs one process per node), and the SM-kernel ceiling of the link (bench/p2p_copy.py --sm):
#    whether 350 GB/s per direction is reachable when both GPUs send.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
t0=$(date +%s)
if [ "${1:-1}" = 1 ]; then
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_fused_moe_gpu.py \
  tests/test_fused_ep_gpu.py -k "fused_vs_separate or deep_reduction or overlapped_rows" > "$out/gpu_tests.log" 2>&1
echo "== GPU: fused vs separate vs fp64 (all modes), deep defaults, overlapped EP (+ bulk) rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|Timeout" "$out/gpu_tests.log" | cut -c1-300 | head -n 8
timeout 120 python3 bench/moe_layer.py --shapes deepseek-v2-lite,olmoe --tokens 4096 --latency-tokens "" --reps 5 \
  --providers fused,torchtitan --gaps --profile --host-profile --json "$out/layer_gaps.json" > "$out/layer_gaps.log" 2>&1
echo "== DeepSeek-V2-Lite / OLMoE T=4096: gaps and kernels rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]|idle|gaps" "$out/layer_gaps.log" | head -n 20
exit 0
fi
TLX_DIST_EXCHANGE_BULK=6 timeout 150 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q \
  -p no:cacheprovider --timeout 120 tests/test_symm_multigpu.py > "$out/t5_bulk.log" 2>&1
echo "== T5 peer pointers, bulk send rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_bulk.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$out/t5_bulk.log" | cut -c1-300 | head -n 6
timeout 120 python3 bench/p2p_copy.py --mb 64,235 --sm --programs 4 > "$out/p2p.log" 2>&1
timeout 60 python3 bench/p2p_copy.py --mb 235 --sm --programs 8 >> "$out/p2p.log" 2>&1
echo "== link ceilings: copy engines and SM kernels, one way / both ways [$(( $(date +%s)-t0 ))s]"
grep -E "^\||SM kernels|Error" "$out/p2p.log"
exit 0
