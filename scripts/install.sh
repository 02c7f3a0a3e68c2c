#!/usr/bin/env bash
# Installs rlfuse (editable) with optional extras: `bash scripts/install.sh` or `bash scripts/install.sh test`.
# torch first: a bare torch requirement with no torch installed would pull several GB of CUDA wheels;
# torch==2.13.0 resolves to the CPU build on machines that carry it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] no torch found: installing torch==2.13.0"
  "$PY" -m pip install --quiet torch==2.13.0
fi
extras=${1:-}
target="."
[ -n "$extras" ] && target=".[$extras]"
"$PY" -m pip install --quiet -e "$target"
echo "[install] rlfuse installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
