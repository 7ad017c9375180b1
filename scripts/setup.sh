#!/usr/bin/env bash
# Installs tlx_dist and what its tests need into the current Python environment.
#   - torch: kept if already importable; else torch==2.13.0 (a CPU build where a local wheel is
#     provided, the default CUDA build from PyPI elsewhere).
#   - fbtriton (the `tlx` extra): Meta's Triton with TLX. It provides the `triton` module itself,
#     so a stock `triton` is uninstalled first. Skip with TLX_DIST_NO_TLX=1.
#   - transformers (the `hf` extra): for tlx_dist.integrations.hf and its tests.
#   - NVSHMEM's device bitcode (the `nvshmem-bitcode` extra) for the compile check of the
#     cross-node kernels, unless an nvidia-nvshmem wheel is there already (CUDA torch brings its
#     own, whose version must match torch's). Skip with TLX_DIST_NO_NVSHMEM=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
say() { echo "setup: $*" >&2; }
SECONDS=0

say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if tv=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  say "torch $tv already installed (kept)"
else
  say "installing torch==2.13.0 (a large download: this can take a few minutes) ..."
  pipq "torch==2.13.0"
  say "torch installed (${SECONDS}s)"
fi
extras="test,train,hf"
if [[ "${TLX_DIST_NO_TLX:-0}" != "1" ]]; then
  if "$PY" -m pip show -q triton >/dev/null 2>&1; then
    say "replacing stock triton with fbtriton (TLX provides the triton module)"
    "$PY" -m pip uninstall -y -q triton
  fi
  extras="$extras,tlx"
else
  say "TLX_DIST_NO_TLX=1: skipping fbtriton"
fi
if [[ "${TLX_DIST_NO_NVSHMEM:-0}" != "1" ]]; then
  if "$PY" -m pip list 2>/dev/null | grep -i '^nvidia-nvshmem-cu1' >/dev/null; then
    say "an nvidia-nvshmem wheel is installed (kept): its device bitcode serves the compile check"
  else
    extras="$extras,nvshmem-bitcode"
  fi
fi
say "installing tlx_dist in editable mode with extras [$extras] (pip: about a minute on a fresh machine) ..."
pipq -e ".[$extras]"
say "pip done (${SECONDS}s); checking the install ..."
"$PY" -c "import tlx, tlx_dist; print('setup: tlx_dist', tlx_dist.__version__, '|', tlx.describe())"
say "done (${SECONDS}s)"
