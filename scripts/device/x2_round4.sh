#!/usr/bin/env bash
# Session 5, call C on nvidia-h200-x2, carry .hfc (fbtriton slim + transformers 5.24 + regex wheels;
# the image's huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8 satisfy transformers 5.24):
# the NVSHMEM T5 again (pytest-timeout's thread method dumps every thread's stack if a test hangs),
# then issue 17's HF GPU tests + bench on GPU 0 while issue 12's fixed GPU tests run on GPU 1.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
mkdir -p /tmp/fbt && tar -xJf .hfc/fbtriton-*-slim.tar.xz -C /tmp/fbt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tfm .hfc/*.whl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
for r in 0 1; do
  PYTHONPATH=/tmp/fbt:$PWD MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r \
    GROUP_RANK=$r timeout 140 python3 -m pytest -m multigpu -v -p no:cacheprovider --timeout 45 --timeout-method=thread \
    tests/test_symm_nvshmem_multigpu.py > "$out/t5_nvshmem_rank$r.log" 2>&1 &
done; wait
echo "== T5 NVSHMEM [$(( $(date +%s)-t0 ))s]"; grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" "$out/t5_nvshmem_rank0.log" | cut -c1-150 | tail -n 9
( t0=$(date +%s); CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/fbt:$PWD timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 150 tests/test_grouped_gemm_opcheck.py tests/test_moe_gpu.py > "$out/gpu12.log" 2>&1
  echo "rc=$? [$(( $(date +%s)-t0 ))s]" >> "$out/gpu12.log" ) &
export PYTHONPATH=/tmp/tfm:/tmp/fbt:$PWD CUDA_VISIBLE_DEVICES=0
python3 -c "import transformers, triton; print('transformers', transformers.__version__, 'triton', triton.__version__)" 2>&1 | tail -n 2
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_hf_gpu.py > "$out/hf_gpu.log" 2>&1
echo "== HF GPU tests rc=$? $(tail -n 1 "$out/hf_gpu.log")"; grep -E "^(FAILED|ERROR)" "$out/hf_gpu.log" | cut -c1-200 | head
timeout 120 python3 bench/hf_block.py > "$out/hf_block.log" 2>&1
echo "== bench/hf_block.py rc=$?"; tail -n 12 "$out/hf_block.log"
wait
echo "== issue 12 GPU tests (GPU 1): $(tail -n 2 "$out/gpu12.log" | tr '\n' ' ')"; grep -E "^(FAILED|ERROR)" "$out/gpu12.log" | cut -c1-200 | head
