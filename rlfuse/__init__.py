"""rlfuse: fast, memory-lean RLHF with inter- and intra-stage fusion."""

__version__ = "0.1.0"

import os as _os

# rlfuse draws its own progress; transformers' per-file bars and advice lines would drown it
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
_os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
