# The two-GPU steps the session scripts share (sourced; each step prints one "==" line + a table).
# $out: the folder that comes back. Each step is time-boxed.

tiers_memcheck() {  # GPU 0: exchange + fused-EP GPU tiers (pytest -k $2 if given), GPU 1: memcheck of every
  # exchange kernel, side by side; $1: the tiers' time box (s)
  local t0=$(date +%s) box=${1:-330} k=${2:-}
  CUDA_VISIBLE_DEVICES=0 timeout "$box" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
    tests/test_symm_gpu.py tests/test_fused_ep_gpu.py ${k:+-k "$k"} > "$out/gpu_tiers.log" 2>&1 &
  local p1=$!
  CUDA_VISIBLE_DEVICES=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck \
    --error-exitcode 1 python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1 &
  local p2=$!
  wait $p1; local r1=$?; wait $p2; local r2=$?
  echo "== GPU tiers rc=$r1 [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/gpu_tiers.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tiers.log" | cut -c1-300 | head -n 8
  echo "== memcheck exchange rc=$r2 $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
}

NO_W8="not (random-8 or zero_token_experts-8 or heavy_imbalance-8 or one_expert-8)"

t5_peer() {  # T5 on peer pointers (torchrun, 2 ranks)
  local t0=$(date +%s)
  timeout 130 torchrun --standalone --nproc-per-node=2 -m pytest -m multigpu -q -p no:cacheprovider --timeout 100 \
    tests/test_symm_multigpu.py > "$out/t5_peer.log" 2>&1
  echo "== T5 peer rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'passed|failed' "$out/t5_peer.log" | tail -n 1)"
}

dispatch_w2() {  # the W=2 dispatch + combine grid against NCCL, with rank 0's per-kernel profile
  local t0=$(date +%s)
  timeout 110 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
    --experts 64,256 --profile --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1
  echo "== dispatch W=2 rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -A 30 "^W=2" "$out/dispatch_w2.log" | grep -E "^(provider|nccl|symm|rows|regions|aligned)"
}

t5_nvshmem() {  # T5 on the NVSHMEM route, each GPU its own node; $1: pytest -k filter ("" = all), $2: box (s)
  local t0=$(date +%s) k=${1:-} box=${2:-290}
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 RANK=$r LOCAL_RANK=$r GROUP_RANK=$r \
      timeout "$box" python3 -m pytest -m multigpu -v -p no:cacheprovider --timeout 150 --timeout-method=thread \
      --durations=0 ${k:+-k "$k"} tests/test_symm_nvshmem_multigpu.py > "$out/t5_nvshmem_rank$r.log" 2>&1 &
  done; wait
  echo "== T5 NVSHMEM ${k:+(-k $k) }[$(( $(date +%s)-t0 ))s]"
  grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout|s call" "$out/t5_nvshmem_rank0.log" | cut -c1-150 | tail -n 18
}

train_ep2() {  # EP=2 training, 40 steps; $1: parallel.moe_pipeline (fused | separate)
  local t0=$(date +%s) p=$1
  timeout 120 torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml \
    --override train.steps=40 --override train.log_every=20 --override parallel.moe_pipeline="$p" \
    --override metrics.progress=false --override metrics.out_dir=/tmp/run_ep2_"$p" > "$out/train_ep2_$p.log" 2>&1
  echo "== EP=2 training, moe_pipeline=$p rc=$? [$(( $(date +%s)-t0 ))s]"
  grep -E "^step" "$out/train_ep2_$p.log" | cut -c1-160 | tail -n 2
}
