#!/usr/bin/env bash
# Set up mfgserve in a virtual environment (default .venv in the repository root).
#
# Idempotent: re-running only installs what is missing. On a machine without an NVIDIA
# driver, torch is pinned to the CPU build 2.13.0 first, so that no multi-GB CUDA wheels are
# pulled; with a GPU, any torch >= 2.0 already installed in the venv is kept.
#   MFGSERVE_VENV=path   where to create the environment
#   PYTHON=python3.11    interpreter used to create it (>= 3.10)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MFGSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "install: creating $VENV with $("$PY" --version)" >&2
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "install: NVIDIA driver found; installing torch with CUDA" >&2
    "$VPY" -m pip install -q "torch>=2.0"
  else
    echo "install: no GPU; installing the CPU build torch==2.13.0" >&2
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
if ! "$VPY" -c "import common.dgl_compat, zmq, msgpack, ogb, matplotlib, pytest_timeout, hypothesis, mypy, ruff" >/dev/null 2>&1 \
   || ! "$VENV/bin/worker-mode" --help >/dev/null 2>&1 || [ ! -e "$VENV/bin/mfgserve-plot" ]; then
  echo "install: installing mfgserve and its dependencies into $VENV" >&2
  "$VPY" -m pip install -q -e ".[test]"
fi
# the native kernels (common/native.c) are built once per machine; without a C compiler the
# numpy paths run instead, slower, and this says why
"$VPY" -m common.native || echo "install: continuing without native kernels" >&2
"$VPY" -c "from common.dgl_compat import import_dgl; import torch; d = import_dgl(); \
print(f'install: ok (torch {torch.__version__}, dgl {d.__version__})')" >&2
