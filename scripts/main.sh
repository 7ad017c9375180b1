#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job. Placeholder until the training loop lands.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q tests/test_ep_parity.py
