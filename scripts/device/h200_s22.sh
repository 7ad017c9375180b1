#!/usr/bin/env bash
# Session 15, one GPU (< 7 min):  source .carry/setup.sh && bash scripts/device/h200_s22.sh
# At the session's defaults (C dispatcher on): the layer / grouped GEMM / fused primitive GPU tiers incl.
# torch.compile fullgraph and graph capture, then the one-GPU recipe (compile on, fused layer) for 60
# steps: tokens/s and MFU beside session 5's 117.0k / 47.8%.
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
t0=$(date +%s)
timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 tests/test_moe_gpu.py tests/test_grouped_gemm_gpu.py \
  tests/test_fused_moe_gpu.py -k "not fused_vs_separate_vs_fp64" > "$out/gpu_tiers.log" 2>&1
echo "== GPU tiers at the defaults rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
grep -E "^(FAILED|ERROR)|Timeout|UserWarning: \[Triton\]" "$out/gpu_tiers.log" | cut -c1-300 | sort | uniq -c | head -n 10
timeout 200 torchrun --standalone --nproc-per-node=1 -m train.pretrain --config configs/h200_1gpu.toml \
  --override train.steps=60 --override train.log_every=20 --override metrics.progress=false \
  --override metrics.out_dir=/tmp/run_s22 > "$out/train.log" 2>&1
echo "== h200_1gpu, 60 steps rc=$? [$(( $(date +%s)-t0 ))s]"
grep -E "^world|^step|Error|error" "$out/train.log" | cut -c1-200 | tail -n 6
exit 0
