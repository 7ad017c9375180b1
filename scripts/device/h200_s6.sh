#!/usr/bin/env bash
# Next one-GPU calls (written in session 5, not yet run), each < 10 min, <= 8 files in $OUT:
#   source .carry/setup.sh && bash scripts/device/h200_s6.sh 1   # the exchange kernels changed on CPU in
#        session 5 (16-byte row vectors, reduce_send/expand restructured): GPU tier + memcheck. FIRST.
#   source .carry/setup.sh && bash scripts/device/h200_s6.sh 2   # where the fused backward loses (issue 9)
#        and the training step profile (issue 10)
#   source .carry/setup.sh && bash scripts/device/h200_s6.sh 3   # fused tile configs of the backward forms
#        (TLX_DIST_FUSED_CONFIG), fused OLMoE layer fwd+bwd at T=16384 each; compile-checked on CPU first:
#        scatter at BN=256 does not fit 227 KB (278,720 B), dswiglu spills 288 B at its default
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
if [ "${1:-1}" = 1 ]; then
  t0=$(date +%s)
  # test_fused_moe_gpu: the Hopper fused kernel's gather pointers moved into tlx/common/gather.py
  timeout 390 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_symm_gpu.py \
    tests/test_fused_ep_gpu.py tests/test_fused_moe_gpu.py > "$out/exchange_gpu.log" 2>&1
  echo "== exchange + fused GPU tiers rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/exchange_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$out/exchange_gpu.log" | head -n 10
  t0=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1
  echo "== memcheck exchange rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
  t0=$(date +%s)
  timeout 60 python3 bench/dispatch.py --tokens 128,4096 --dims 7168 --experts 256 --profile \
    --json "$out/dispatch_w1.json" > "$out/dispatch_w1.log" 2>&1
  echo "== dispatch W=1 rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 10 "^W=1" "$out/dispatch_w1.log"
elif [ "$1" = 3 ]; then
  for c in "" "dswiglu:STAGES=4,LAG=2" "dswiglu:STAGES=5,LAG=3,REGS=232" "wgrad:BK=64,STAGES=3,LAG=1" \
           "wgrad:BN=128,BK=64,STAGES=4,LAG=2" "scatter:STAGES=3" "scatter:STAGES=5"; do
    TLX_DIST_FUSED_CONFIG="$c" timeout 70 python3 bench/moe_layer.py --shapes olmoe --tokens 16384 --latency-tokens "" \
      --providers fused --reps 5 --json /tmp/cfg.json 2>&1 | grep -E "^olmoe +T=" | sed "s|^|[$c] |"
  done
else
  t0=$(date +%s)
  timeout 330 python3 bench/moe_layer.py --shapes olmoe,qwen3-30b-a3b --tokens 16384 --latency-tokens "" --reps 5 \
    --profile --json "$out/moe_layer_prof.json" > "$out/moe_layer_prof.log" 2>&1
  echo "== moe_layer profile rc=$? [$(( $(date +%s)-t0 ))s]"; grep -A 18 "per-kernel" "$out/moe_layer_prof.log" | cut -c1-130
  tail -n 6 "$out/moe_layer_prof.log"
  t0=$(date +%s)
  timeout 200 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
    --override train.steps=12 --override metrics.out_dir=/tmp/run_prof --profile 5 > "$out/profile.log" 2>&1
  echo "== train profile rc=$? [$(( $(date +%s)-t0 ))s]"; tail -n 30 "$out/profile.log"
fi
