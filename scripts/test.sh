#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite: tiers T0-T2 on any machine (CPU, no GPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m gpu` on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
