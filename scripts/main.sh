#!/usr/bin/env bash
# Sets up what the main job needs (scripts/setup.sh main: no GPU extras on a CPU machine) and runs
# it: a short pretraining run of the debug MoE model on the CPU, or the one-GPU recipe on an H200
# (see train/run.sh). Extra arguments go to train.pretrain, e.g.
#   bash scripts/main.sh --override train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh main
exec bash train/run.sh "$@"
