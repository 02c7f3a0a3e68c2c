"""rlfuse: fast, memory-lean RLHF with inter- and intra-stage fusion."""

__version__ = "0.1.0"

import os as _os

# rlfuse draws its own progress; transformers' per-file bars and advice lines would drown it
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
_os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging as _logging

# peft imports bitsandbytes wherever it is installed, and on CPUs with AVX512-BF16 bitsandbytes then warns at import
# that its optional hub kernel (package `kernels`) is missing: a line on every run, about a path rlfuse does not use
# (models/quantize.py keeps bitsandbytes' plain CPU layout)
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)

# The Python API (rlfuse/api.py), imported on first use (PEP 562): every `import rlfuse.<module>` runs this file first,
# so it imports none of its submodules; `rlfuse.train_rl` and the others load the API when first asked for
__all__ = ["Config", "load_config", "train_sft", "train_rm", "train_rl", "run_pipeline", "generate", "RLResult",
           "PipelineResult"]


def __getattr__(name: str):
    if name == "Config":
        from rlfuse.config import Config  # on first use (above)

        return Config
    if name in __all__:
        from rlfuse import api  # on first use (above)

        return getattr(api, name)
    raise AttributeError(f"module 'rlfuse' has no attribute {name!r}")
