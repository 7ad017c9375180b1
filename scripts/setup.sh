#!/usr/bin/env bash
# Installs tlx_dist and what its tests need into the current Python environment.
#   - torch: kept if already importable; else torch==2.13.0 (a CPU build where a local wheel is
#     provided, the default CUDA build from PyPI elsewhere).
#   - fbtriton (the `tlx` extra): Meta's Triton with TLX. It provides the `triton` module itself,
#     so a stock `triton` is uninstalled first. Skip with TLX_DIST_NO_TLX=1.
#   - transformers (the `hf` extra): for tlx_dist.integrations.hf and its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

"$PY" -c "import torch" 2>/dev/null || pipq "torch==2.13.0"
extras="test,train,hf"
if [[ "${TLX_DIST_NO_TLX:-0}" != "1" ]]; then
  if "$PY" -m pip show -q triton >/dev/null 2>&1; then
    echo "setup: replacing stock triton with fbtriton (TLX provides the triton module)" >&2
    "$PY" -m pip uninstall -y -q triton
  fi
  extras="$extras,tlx"
fi
pipq -e ".[$extras]"
"$PY" -c "import tlx, tlx_dist; print('setup: tlx_dist', tlx_dist.__version__, '|', tlx.describe())"
