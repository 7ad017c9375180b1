#!/usr/bin/env bash
# Session 13, two GPUs (< 10 min): source .carry/setup.sh && bash scripts/device/x2_s27.sh
# A. tile-config sweeps of the fused forms in one process each (bench/fused_forms.py --variant):
#    GPU 0 DeepSeek-V2-Lite + OLMoE, GPU 1 Mixtral (whose non-dW forms keep GROUP_M=8, the auto rule an
#    explicit override turns off).
# B. T5 on peer pointers: the overlapped layer's CUDA-graph capture after the plan stopped holding the
#    router's gates (x2_s25 call 1 failed there).
# C. the W=2 T=128 cells with the steady-state per-op columns (disp ss / comb ss).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/_x2_steps.sh"
V1="dswiglu:BN=64,STAGES=8,LAG=6;scatter:STAGES=5;wgrad_b:BN=128,BK=64,STAGES=4,LAG=2;swiglu:BK=32,STAGES=8,LAG=6;wgrad_a:BK=32,STAGES=6,LAG=4"
V2="dswiglu:GROUP_M=8;scatter:GROUP_M=8;wgrad_b:GROUP_M=8;swiglu:GROUP_M=8;wgrad_a:GROUP_M=8"
V3="dswiglu:STAGES=4,LAG=2,REGS=232;scatter:BN=64,STAGES=6;wgrad_b:BN=128,BK=32,STAGES=8,LAG=6;swiglu:STAGES=4,LAG=1;wgrad_a:BN=128,BK=64,STAGES=4,LAG=2"
M1="dswiglu:BN=64,STAGES=8,LAG=6,GROUP_M=8;wgrad_b:BN=128,BK=64,STAGES=4,LAG=2;swiglu:BK=32,STAGES=8,LAG=6,GROUP_M=8;wgrad_a:BK=32,STAGES=6,LAG=4"
M2="dswiglu:GROUP_M=16;swiglu:GROUP_M=16;wgrad_b:GROUP_M=8;wgrad_a:GROUP_M=8"
M3="dswiglu:STAGES=4,LAG=2,REGS=232,GROUP_M=8;wgrad_b:BN=128,BK=32,STAGES=8,LAG=6;swiglu:STAGES=4,LAG=1,GROUP_M=8;wgrad_a:BN=128,BK=64,STAGES=4,LAG=2"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 bench/fused_forms.py --shapes deepseek-v2-lite,olmoe --tokens 16384 \
  --forms swiglu,scatter,dswiglu,scatter_dx,wgrad_b --rep 30 --variant "base=" --variant "v1=$V1" --variant "v2=$V2" \
  --variant "v3=$V3" --json "$out/sweep_small.json" > "$out/sweep_small.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout 250 python3 bench/fused_forms.py --shapes mixtral --tokens 16384 \
  --forms swiglu,dswiglu,wgrad_a,wgrad_b --rep 60 --variant "base=" --variant "m1=$M1" --variant "m2=$M2" \
  --variant "m3=$M3" --json "$out/sweep_mixtral.json" > "$out/sweep_mixtral.log" 2>&1 &
p2=$!
wait $p1; r1=$?; wait $p2; r2=$?
echo "== sweeps rc=$r1/$r2 [$(( $(date +%s)-t0 ))s]"
grep -E "^\| [a-z]" "$out/sweep_small.log" "$out/sweep_mixtral.log" | sed 's/^[^:]*://'
grep -hE "^median|Error|error" "$out/sweep_small.log" "$out/sweep_mixtral.log" | head -n 30
t5_peer
grep -E "^(FAILED|ERROR)" "$out/t5_peer.log" | cut -c1-300 | head -n 8
t0=$(date +%s)
timeout 90 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128 --dims 7168 --experts 64,256 \
  --json "$out/dispatch_t128.json" > "$out/dispatch_t128.log" 2>&1
echo "== dispatch W=2 T=128 rc=$? [$(( $(date +%s)-t0 ))s]"
grep -A 14 "^W=2" "$out/dispatch_t128.log" | grep -E "^(provider|nccl|symm|rows|regions)"
exit 0
