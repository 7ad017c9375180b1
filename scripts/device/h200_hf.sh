#!/usr/bin/env bash
# Issue 17's GPU half (bf16 HF blocks with the TLX path + bench/hf_block.py). The device image has
# transformers 5.17 (too old: tests/test_hf.py needs >= 5.24) and fbtriton (51 MB) + the transformers
# 5.24 / huggingface-hub 2.x wheels exceed one call's 64 MiB carry, so it takes two calls back to back
# (the machine keeps /tmp for 30 s between calls):
#   1. run(carry=[".carry"]):  source .carry/setup.sh && <any GPU work>       (unpacks fbtriton to /tmp/fbt)
#   2. run(carry=[".whl"]):    bash scripts/device/h200_hf.sh                  (within 30 s)
# where .whl/ holds `pip download --no-deps transformers==5.24.0 "huggingface-hub>=1.5,<3"` wheels.
set -u
out=${OUT:-/tmp/hf}; mkdir -p "$out"
[ -f /tmp/fbt/triton/__init__.py ] || { echo "no /tmp/fbt: run step 1 first (the machine went cold)"; exit 3; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -ge 2 ]; then  # a second GPU idles otherwise: issue 12's GPU tests run on it meanwhile
  ( t0=$(date +%s); CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/fbt:/tmp/nvs:$PWD timeout 280 python3 -m pytest -m gpu -q \
      -p no:cacheprovider --timeout 150 tests/test_grouped_gemm_gpu.py tests/test_grouped_gemm_opcheck.py \
      tests/test_moe_gpu.py tests/test_train_profiling.py > "$out/gpu12.log" 2>&1
    echo "rc=$? [$(( $(date +%s)-t0 ))s]" >> "$out/gpu12.log" ) &
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tfm .whl/*.whl
export PYTHONPATH=/tmp/tfm:/tmp/fbt:/tmp/nvs:$PWD${PYTHONPATH:+:$PYTHONPATH}
export CUDA_VISIBLE_DEVICES=0
python3 -c "import transformers, triton; print('transformers', transformers.__version__, 'triton', triton.__version__)"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_hf_gpu.py > "$out/hf_gpu.log" 2>&1
echo "== HF GPU tests rc=$? $(tail -n 1 "$out/hf_gpu.log")"
timeout 150 python3 bench/hf_block.py > "$out/hf_block.log" 2>&1
echo "== bench/hf_block.py rc=$?"; tail -n 15 "$out/hf_block.log"
wait
[ -f "$out/gpu12.log" ] && echo "== issue 12 GPU tests (GPU 1): $(tail -n 2 "$out/gpu12.log" | tr '\n' ' ')" && grep -E "^(FAILED|ERROR)" "$out/gpu12.log" | head
