#!/usr/bin/env bash
# Main job: a short pretraining run. On an H200: configs/h200_1gpu.toml (200 steps); elsewhere
# the debug MoE model of configs/debug_cpu.toml on the CPU. Extra arguments go to train.pretrain,
# e.g.  bash train/run.sh --override train.steps=50
# Plots go to the run's metrics.out_dir (whatever the recipe or an override sets it to): rank 0
# writes them after training (--plot); a missing matplotlib and a failed plot are reported as such.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() and 'H200' in torch.cuda.get_device_name(0) else 1)"; then
  exec "$PY" -m train.pretrain --config configs/h200_1gpu.toml --override train.steps=200 --plot "$@"
fi
exec "$PY" -m train.pretrain --config configs/debug_cpu.toml --plot "$@"
