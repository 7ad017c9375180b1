#!/usr/bin/env bash
# Sets up what the tests need (scripts/setup.sh test) and runs them on any machine (CPU, no GPU):
#
#   bash scripts/test.sh             the fast tier: tiers T0-T2 less the `release` marker
#   bash scripts/test.sh --release   the release tier: the heavy soaks and compile matrices
#   bash scripts/test.sh -k router   extra arguments go to pytest (e.g. -m gpu on a GPU machine)
#
# Progress is verbose: each test with its time as it ends, a heartbeat line while one runs long
# (tests/conftest.py), and the 10 slowest at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [[ "${1:-}" == "--release" ]]; then
  shift
  select=(-m "release and not gpu and not multigpu")
fi
bash scripts/setup.sh test
# unbuffered: CI's log is a pipe, and a block-buffered progress line would arrive minutes late
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m pytest -v --durations=10 "${select[@]}" "$@"
