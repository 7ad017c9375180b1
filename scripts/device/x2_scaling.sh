#!/usr/bin/env bash
# Weak-scaling points of bench/scaling.py on the h200_1gpu recipe: N=2 (EP=2) then N=1.
set -u
out=${OUT:-/tmp/x2}; mkdir -p "$out"
for n in ${NS:-2 1}; do
  t0=$(date +%s)
  timeout ${SCALE_S:-170} torchrun --nproc-per-node=$n bench/scaling.py --config configs/h200_1gpu.toml \
    --override parallel.ep=$n --mode step --paths fast,reference --steps 5 --rounds 2 --warmup 3 \
    --json "$out/scaling_n$n.json" > "$out/scaling_n$n.log" 2>&1
  echo "== scaling N=$n rc=$? [$(( $(date +%s)-t0 ))s]"; tail -n 14 "$out/scaling_n$n.log"
done
