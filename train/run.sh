#!/usr/bin/env bash
# Main job: a short pretraining run. On an H200: configs/h200_1gpu.toml (200 steps); elsewhere
# configs/debug_cpu.toml on the CPU (~1 minute, loss 6.2 -> ~2.3). Extra arguments go to
# train.pretrain, e.g.  bash train/run.sh --override train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() and 'H200' in torch.cuda.get_device_name(0) else 1)"; then
  exec "$PY" -m train.pretrain --config configs/h200_1gpu.toml --override train.steps=200 "$@"
fi
"$PY" -m train.pretrain --config configs/debug_cpu.toml "$@"
"$PY" -m train.plot runs/debug_cpu/metrics.jsonl 2>/dev/null || echo "(matplotlib not installed: no plots)"
