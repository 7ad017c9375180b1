#!/usr/bin/env bash
# Next one-GPU call (written in session 7, not yet run), < 10 min:
#   source .carry/setup.sh && bash scripts/device/h200_s10.sh 0   # FIRST: session 7 changed the exchange
#        kernels on CPU (kernel-side offsets cap, row-form gather index): GPU tiers + memcheck + launches
#   source .carry/setup.sh && bash scripts/device/h200_s10.sh 1
# 0. pytest -m gpu test_symm_gpu (incl. the new launches-per-op test) and test_fused_ep_gpu, memcheck;
# 1. Why bench/moe_layer.py's graph capture fails for every provider (issue 9 item 4: the layer's
#    graph-replayed latency at T=1024/4096 has never been reported): scripts/device/graph_bisect.py
#    captures each piece in its own process, in global and relaxed capture modes;
# 2. the latency bench again (relaxed mode if only that captures);
# 3. every fused form against its grouped GEMM on all five shapes (where the fused layer loses).
set -u
out=${OUT:-/tmp/h200}; mkdir -p "$out"
if [ "${1:-1}" = 0 ]; then
  t0=$(date +%s)
  timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 tests/test_symm_gpu.py \
    tests/test_fused_ep_gpu.py > "$out/exchange_gpu.log" 2>&1
  echo "== exchange GPU tiers rc=$? [$(( $(date +%s)-t0 ))s] $(tail -n 1 "$out/exchange_gpu.log")"
  grep -E "^(FAILED|ERROR)|launched" "$out/exchange_gpu.log" | cut -c1-300 | head -n 10
  t0=$(date +%s)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python3 scripts/memcheck_exchange.py > "$out/memcheck_exchange.log" 2>&1
  echo "== memcheck exchange rc=$? [$(( $(date +%s)-t0 ))s] $(grep -E 'ERROR SUMMARY|all ok' "$out/memcheck_exchange.log" | tr '\n' ' ')"
  exit 0
fi
for m in global relaxed; do
  t0=$(date +%s)
  timeout 200 python3 scripts/device/graph_bisect.py --T 1024 --mode $m > "$out/bisect_$m.log" 2>&1
  echo "== graph bisect mode=$m rc=$? [$(( $(date +%s)-t0 ))s]"; cat "$out/bisect_$m.log" | cut -c1-250
done
mode=global; grep -q "fused_fwd_bwd  *captured" "$out/bisect_global.log" || mode=relaxed
t0=$(date +%s)
timeout 150 python3 bench/moe_layer.py --shapes olmoe --tokens "" --latency-tokens 1024,4096 --capture-mode $mode \
  --json "$out/moe_latency.json" > "$out/moe_latency.log" 2>&1
echo "== layer latency (capture $mode) rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\| olmoe" "$out/moe_latency.log" | tail -n 2
t0=$(date +%s)
timeout 120 python3 bench/fused_forms.py --shapes olmoe,qwen3-30b-a3b,deepseek-v2-lite,mixtral,deepseek-v3-rank \
  --json "$out/forms_all.json" > "$out/forms_all.log" 2>&1
echo "== fused forms rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "^\||median|err" "$out/forms_all.log"
