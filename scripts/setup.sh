#!/usr/bin/env bash
# Installs tlx_dist into the current Python environment, with what one of two jobs needs:
#
#   bash scripts/setup.sh main   the main job (scripts/main.sh): torch, tlx_dist and the `train` extra
#                                (TensorBoard, matplotlib); fbtriton (the `tlx` extra) only where a CUDA
#                                GPU is visible, since the CPU run never imports it
#   bash scripts/setup.sh test   the test suite (scripts/test.sh): `main` plus pytest, fbtriton (the
#                                TLX compile tests run on CPU), transformers (the `hf` extra) and
#                                NVSHMEM's device bitcode (the cross-node kernels' compile check)
#
#   - torch: kept if already importable; else torch==2.13.0 (a CPU build where a local wheel is
#     provided, the default CUDA build from PyPI elsewhere).
#   - fbtriton: Meta's Triton with TLX. It provides the `triton` module itself, so a stock `triton` is
#     uninstalled first. Skip with TLX_DIST_NO_TLX=1.
#   - NVSHMEM's bitcode (`nvshmem-bitcode` extra, test only): skipped where an nvidia-nvshmem wheel is
#     there already (CUDA torch brings its own, whose version must match torch's) or with
#     TLX_DIST_NO_NVSHMEM=1.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}
case "$profile" in
  main|test) ;;
  *) echo "usage: bash scripts/setup.sh [main|test]   (got '$profile')" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
say() { echo "setup ($profile): $*" >&2; }
SECONDS=0

say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if tv=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  say "torch $tv already installed (kept)"
else
  say "installing torch==2.13.0 (a large download: this can take a few minutes) ..."
  pipq "torch==2.13.0"
  say "torch installed (${SECONDS}s)"
fi
extras="train"
want_tlx=0
if [[ "$profile" == "test" ]]; then
  extras="$extras,test,hf"
  want_tlx=1
elif "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  want_tlx=1  # the GPU recipe runs the fused TLX pipeline
else
  say "no CUDA GPU: the CPU run needs neither fbtriton nor NVSHMEM (not installed)"
fi
if [[ "$want_tlx" == "1" && "${TLX_DIST_NO_TLX:-0}" != "1" ]]; then
  if "$PY" -m pip show -q triton >/dev/null 2>&1; then
    say "replacing stock triton with fbtriton (TLX provides the triton module)"
    "$PY" -m pip uninstall -y -q triton
  fi
  extras="$extras,tlx"
elif [[ "$want_tlx" == "1" ]]; then
  say "TLX_DIST_NO_TLX=1: skipping fbtriton"
fi
if [[ "$profile" == "test" && "${TLX_DIST_NO_NVSHMEM:-0}" != "1" ]]; then
  if "$PY" -m pip list 2>/dev/null | grep -i '^nvidia-nvshmem-cu1' >/dev/null; then
    say "an nvidia-nvshmem wheel is installed (kept): its device bitcode serves the compile check"
  else
    extras="$extras,nvshmem-bitcode"
  fi
fi
say "installing tlx_dist in editable mode with extras [$extras] ..."
pipq -e ".[$extras]"
say "pip done (${SECONDS}s); checking the install ..."
"$PY" -c "import tlx, tlx_dist; print('setup: tlx_dist', tlx_dist.__version__, '|', tlx.describe())"
say "done (${SECONDS}s)"
