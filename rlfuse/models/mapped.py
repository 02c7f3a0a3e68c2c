"""A frozen model's weights as a memory map of the safetensors files it was loaded from, resident only while used.

In full fine-tuning the reference is read once an iteration, by its scoring pass, and otherwise sits beside the
update, whose activations, gradients and optimiser states set the process's peak memory. As an ordinary copy it
holds the model's whole size through that peak; mapped from its folder's files (private and never written, so
the pages stay file-backed), its pages are handed back to the OS after each pass (madvise DONTNEED): they stay in
the page cache, which the OS may reclaim, and the next pass faults them back in, from the cache when they are
still there. The numbers are the same bits: a tensor is mapped only where it equals the loaded one.

CPU only (a GPU's reference lives in device memory). The folder's files must not be rewritten in place while a run
maps them (a file truncated under a mapping faults the reader); rlfuse's own stage folders are not, during RL. Ours: safetensors reads into memory or maps read-only through
its own handle, with no way to hand the pages back between passes.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class MappedSafetensors:
    """One .safetensors file, mapped copy-on-write (ACCESS_COPY: writable for torch, never written, so every page
    stays the file's)."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        size = struct.unpack("<Q", self.map[:8])[0]
        header = json.loads(self.map[8: 8 + size])
        self.data_start = 8 + size
        self.entries = {name: e for name, e in header.items() if name != "__metadata__"}

    def tensor(self, name: str) -> torch.Tensor | None:
        """The named tensor over the mapped bytes (no copy), or None for a dtype torch cannot view."""
        e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            return None
        start, end = e["data_offsets"]
        n = (end - start) // dtype.itemsize
        flat = torch.frombuffer(self.map, dtype=dtype, count=n, offset=self.data_start + start) if n else \
            torch.empty(0, dtype=dtype)
        return flat.view(e["shape"])

    def release(self) -> None:
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux and the BSDs; elsewhere the pages stay until the OS needs them
            self.map.madvise(mmap.MADV_DONTNEED)


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's weight files: model.safetensors, or the shards its index names; [] for anything else."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = folder / "model.safetensors"
    return [single] if single.exists() else []


def map_frozen_weights(model: torch.nn.Module, folder: str | Path) -> int:
    """Point every CPU parameter and buffer of `model` (frozen: no gradients) that equals, bit for bit, the tensor
    of the same name in `folder`'s safetensors files at the mapped bytes instead, freeing its own copy. -> bytes now
    mapped (0: nothing matched, e.g. an adapter folder whose merged weights are not in any file). release_mapped()
    hands the pages back; any later use maps them in again."""
    files = [MappedSafetensors(p) for p in safetensors_files(folder)]
    where = {name: f for f in files for name in f.entries}
    mapped, used = 0, set()
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        f = where.get(name)
        if f is None or id(value) in seen or value.device.type != "cpu" or value.requires_grad:
            continue
        seen.add(id(value))  # tied weights: one tensor under two names
        on_disk = f.tensor(name)
        if on_disk is None or on_disk.dtype != value.dtype or on_disk.shape != value.shape or \
                not torch.equal(on_disk, value):
            continue
        value.data = on_disk
        mapped += on_disk.numel() * on_disk.element_size()
        used.add(id(f))
    model._rlfuse_mapped = [f for f in files if id(f) in used]  # the maps live as long as the model
    return mapped


def release_mapped(model: torch.nn.Module | None) -> None:
    """Hand the mapped weights' pages of `model` back to the OS (they stay in the page cache); nothing for a model
    without mapped weights."""
    for f in getattr(model, "_rlfuse_mapped", ()):
        f.release()
