#!/usr/bin/env bash
# Kill-and-resume of EP=2 training on NCCL (all_to_all dispatcher): SIGKILL one rank's worker after the
# step-40 checkpoint, relaunch the same command, and compare the resumed losses with an uninterrupted
# run's ($out/losses_all_to_all.json from x2_train.sh, or the path in $REF).
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"; ck=/tmp/x2_ck; rm -rf $ck
cmd=(torchrun --nproc-per-node=2 -m train.pretrain --config configs/h200_2gpu_ep2.toml
  --override train.steps=80 --override train.log_every=20 --override parallel.dispatcher=all_to_all
  --override checkpoint.every=20 --override checkpoint.dir=$ck --override metrics.out_dir=$out/run_kr)
t0=$(date +%s)
"${cmd[@]}" > "$out/kr_first.log" 2>&1 &
tr=$!
for i in $(seq 1 240); do
  sleep 1
  grep -q "^step 60/80" "$out/kr_first.log" 2>/dev/null && break
  kill -0 $tr 2>/dev/null || break
done
sleep 2
victim=$(pgrep -f "train.pretrain" | while read p; do tr '\0' ' ' < /proc/$p/environ 2>/dev/null | grep -q "LOCAL_RANK=1 " && echo $p; done | head -n 1)
echo "killing rank-1 worker pid=$victim after: $(grep -E '^step' "$out/kr_first.log" | tail -n 1 | cut -c1-60)"
kill -9 $victim; wait $tr; echo "first run rc=$? [$(( $(date +%s)-t0 ))s]; checkpoints: $(ls $ck | tr '\n' ' ')"
t0=$(date +%s)
timeout 240 "${cmd[@]}" --losses-out $out/losses_kr.json > "$out/kr_resume.log" 2>&1
echo "resume rc=$? [$(( $(date +%s)-t0 ))s]"; grep -E "resumed|^step|error" "$out/kr_resume.log" | tail -n 5
python3 - "$out/losses_kr.json" "${REF:-$out/losses_all_to_all.json}" <<'PY'
import json, sys, os
a = json.load(open(sys.argv[1]))
if not os.path.exists(sys.argv[2]):
    print("no reference losses"); sys.exit()
b = json.load(open(sys.argv[2]))
a = a.get("losses", a) if isinstance(a, dict) else a
b = b.get("losses", b) if isinstance(b, dict) else b
print("resumed run: %d losses; reference: %d" % (len(a), len(b)))
n = min(len(a), 20)
for i in range(1, n + 1):
    if i in (1, 5, 10, 20) or i == n:
        print(f"last-{i:2d}: resumed {a[-i]:.4f}  uninterrupted {b[-i]:.4f}  diff {a[-i]-b[-i]:+.4f}")
PY
