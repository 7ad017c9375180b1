#!/usr/bin/env bash
# Second two-GPU call: kill-and-resume, the weak-scaling points, the dispatch bench (pair timing and
# per-kernel profile) on both routes. Logs stay small; error lines are printed.
set -u
df -h /tmp | tail -n 1
out=${OUT:-/tmp/x2}; mkdir -p "$out"
errs() { grep -hE "Error|error:|Exception|Traceback" "$@" 2>/dev/null | grep -vE "elastic|ChildFailed|error_file|errors.html|Traceback \(most" \
  | sed 's/^\[rank[0-9]*\]: //' | sort | uniq -c | sort -rn | head -n 6; }
tb0() { grep -h "^\[rank0\]" "$1" | tail -n ${2:-14} | cut -c1-220; }
for n in ${NS:-2 1}; do
  t0=$(date +%s)
  timeout ${SCALE_S:-110} torchrun --standalone --nproc-per-node=$n bench/scaling.py --config configs/h200_1gpu.toml \
    --override parallel.ep=$n --mode step --paths fast,reference --steps 5 --rounds 2 --warmup 3 \
    --json "$out/scaling_n$n.json" > "$out/scaling_n$n.log" 2>&1
  echo "== scaling N=$n rc=$? [$(( $(date +%s)-t0 ))s]"; grep -v "^\[rank" "$out/scaling_n$n.log" | grep -vE "^W11|^\*\*|OMP_NUM" | tail -n 16; errs "$out/scaling_n$n.log"; tb0 "$out/scaling_n$n.log" 10
done
t0=$(date +%s)
timeout 100 torchrun --standalone --nproc-per-node=2 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 --experts 256 \
  --profile --json "$out/dispatch_w2.json" > "$out/dispatch_w2.log" 2>&1
echo "== dispatch peer rc=$? [$(( $(date +%s)-t0 ))s]"; grep -vE "^W11|^\*\*|OMP_NUM|^\s*$" "$out/dispatch_w2.log" | tail -n 60; errs "$out/dispatch_w2.log"
t0=$(date +%s)
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29541 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1
for r in 0 1; do RANK=$r LOCAL_RANK=$r GROUP_RANK=$r timeout 100 python3 bench/dispatch.py --tokens 128,4096,16384 --dims 7168 \
  --experts 256 --json "$out/dispatch_w2_nvshmem.json" > "$out/dispatch_nvs_rank$r.log" 2>&1 & done; wait
echo "== dispatch nvshmem [$(( $(date +%s)-t0 ))s]"; tail -n 12 "$out/dispatch_nvs_rank0.log"; errs "$out/dispatch_nvs_rank0.log"
ck=/tmp/x2_ck; rm -rf $ck
cmd=(torchrun --standalone --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml
  --override train.steps=80 --override train.log_every=20 --override parallel.dispatcher=all_to_all
  --override checkpoint.every=30 --override checkpoint.keep=1 --override checkpoint.dir=$ck --override metrics.out_dir=/tmp/run_kr)
if [ "${SKIP_RESUME:-0}" != 1 ]; then
t0=$(date +%s); "${cmd[@]}" > "$out/kr_first.log" 2>&1 & tr=$!
for i in $(seq 1 ${FIRST_S:-150}); do sleep 1; [ "$(cat $ck/latest 2>/dev/null)" = 30 ] && break; kill -0 $tr 2>/dev/null || break; done
victim=$(for p in $(pgrep -f "train.pretrain"); do tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "LOCAL_RANK=1" && echo $p; done | tail -n 1)
echo "kill -9 rank-1 worker $victim after: $(grep -E '^step' "$out/kr_first.log" | tail -n 1 | cut -c1-40)"
kill -9 $victim; wait $tr; echo "first run rc=$? [$(( $(date +%s)-t0 ))s] ckpts: $(ls $ck | tr '\n' ' ') latest=$(cat $ck/latest 2>/dev/null)"
t0=$(date +%s); timeout ${RESUME_S:-180} "${cmd[@]}" --losses-out $out/losses_kr.json > "$out/kr_resume.log" 2>&1
echo "resume rc=$? [$(( $(date +%s)-t0 ))s]"; grep -hE "resumed|^step" "$out/kr_resume.log" | cut -c1-150 | tail -n 4; errs "$out/kr_resume.log"; tb0 "$out/kr_resume.log"
[ -f $out/losses_kr.json ] && python3 -c "
import json; a=json.load(open('$out/losses_kr.json')); b=json.load(open('scripts/device/ref_losses_a2a.json'))
print('resumed', len(a), 'steps; last-k resumed vs uninterrupted:', [(k, round(a[-k],4), round(b[-k],4)) for k in (40,20,10,1) if k<=len(a)])"
fi
df -h /tmp | tail -n 1
