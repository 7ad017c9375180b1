#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: a short pretraining run of the debug MoE model
# on the CPU, or the one-GPU recipe on an H200 (see train/run.sh). Extra arguments go to
# train.pretrain, e.g.  bash scripts/main.sh --override train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec bash train/run.sh "$@"
