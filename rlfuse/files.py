"""Atomic writes: a file or folder is written under a temporary name beside its place and renamed over it in one
step, so a run killed at any moment leaves the old version or the new one, never half of one. Every file rlfuse
writes that a later step or a resumed run reads goes through here (configs, checkpoints, metrics rewritten on
resume, saved models, reports, the cached default task). Imports nothing of rlfuse: the bottom of the house."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp", keep_existing: bool = False) -> Iterator[Path]:
    """A temporary sibling of `path` to write a file or a folder into; when the block ends it replaces `path` in one
    rename. A rename cannot replace a non-empty folder, so an old folder is first renamed aside (`path` + suffix +
    ".old") and removed after: a crash between the two renames leaves both copies on disk, `path` absent. If the
    block raises, the temporary is removed and `path` is left as it was.

    keep_existing (a folder several processes may build at once, e.g. a shared cache): a `path` that exists by the
    end stands and ours is dropped, also when another writer's rename lands first (ours then fails: the folder is
    not empty); give each writer a suffix of its own (the process id)."""
    path = Path(path)
    tmp, old = path.with_name(path.name + suffix), path.with_name(path.name + suffix + ".old")
    remove_path(tmp)
    try:
        yield tmp
        if keep_existing:
            if not path.exists():
                os.replace(tmp, path)
            return
        if tmp.is_dir() and path.is_dir():
            remove_path(old)
            os.replace(path, old)
        os.replace(tmp, path)
        remove_path(old)
    except OSError as e:
        if not (keep_existing and path.exists()):  # keep_existing: another writer's copy landed first and stands
            if e.filename == str(tmp):
                e.filename = str(path)  # the file the user knows, not our temporary
            raise
    finally:
        remove_path(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`path` holds `text` (UTF-8), written atomically; its folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


DIGEST_SAMPLES, DIGEST_CHUNK = 16, 1 << 16


def weights_digest(name_or_path: str | os.PathLike) -> str:
    """What a model folder holds, in 16 hex digits, read in a few milliseconds whatever its size: the name and size of
    each weights file transformers loads (the safetensors where there are any, else the .bin files, else a .gguf)
    and DIGEST_SAMPLES chunks spread through each (a model trained again differs in most tensors, so in some chunk;
    a copy of the folder digests the same, which a file time would not; another format written beside the loaded
    one, a llama.cpp export say, does not change it). Not a folder (a hub id): the name itself."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return str(name_or_path)
    h = hashlib.sha256()
    weights = next((found for suffix in (".safetensors", ".bin", ".gguf")
                    if (found := sorted(p for p in folder.iterdir() if p.suffix == suffix and p.is_file()))), [])
    for f in weights:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for i in range(DIGEST_SAMPLES):
                fh.seek(size * i // DIGEST_SAMPLES)
                h.update(fh.read(DIGEST_CHUNK))
    return h.hexdigest()[:16]


def remove_path(p: Path) -> None:
    """A file, link or folder gone (a folder with what it holds); nothing if it is not there."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()
