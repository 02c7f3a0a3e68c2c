"""Shared by the benchmarks: the machine, process memory, child processes, and writing BENCHMARKS.md sections."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlfuse.metrics.tracker import peak_rss_mb, reset_peak_rss  # noqa: E402  (one definition, re-exported)

__all__ = ["ROOT", "WORK", "SHARED_DATA", "machine", "warm_up", "reset_cuda_peak", "cuda_peaks_mb", "rss_mb", "peak_rss_mb", "reset_peak_rss", "run_child",
           "write_section", "md_table"]
WORK = ROOT / "bench" / ".work"
SHARED_DATA = ROOT.parent / "shared" / "data"


def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def warm_up(model=None) -> None:
    """Initialise the math libraries' per-thread state (thread pools, GEMM packing buffers) with a throwaway forward
    and backward, and run one 8-token forward of the model (transformers imports and sets up attention on the first
    call), so that each system's idle footprint includes these one-time costs whichever of them happened to pay
    them before its idle snapshot."""
    import torch

    x = torch.randn(512, 256, requires_grad=True)
    w1, w2 = torch.randn(256, 1024, requires_grad=True), torch.randn(1024, 256, requires_grad=True)
    torch.nn.functional.gelu(x @ w1).matmul(w2).log_softmax(-1).sum().backward()
    if model is not None:
        was_training = model.training
        with torch.no_grad():
            model.eval()(input_ids=torch.ones(1, 8, dtype=torch.long, device=next(model.parameters()).device))
        model.train(was_training)


def reset_cuda_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def cuda_peaks_mb() -> dict:
    """CUDA peak allocated and reserved since the last reset_cuda_peak(), in MiB; {} without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    return {"cuda_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
            "cuda_peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
            "cuda_idle_allocated_mb": torch.cuda.memory_allocated() / 2**20}


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20




def run_child(script: Path, args: list[str], timeout: int = 1800) -> dict:
    """Run one measurement in a fresh process (its peak RSS is its own) and return the JSON it prints last."""
    env = os.environ | {"CI": "true", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_section(name: str, text: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """Replace the text between <!-- name:start --> and <!-- name:end --> (appended if absent)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    body = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in body:
        body = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, body, flags=re.S)
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    path.write_text(body)


def md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
