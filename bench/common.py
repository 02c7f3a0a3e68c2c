"""Shared by the benchmarks: the machine, process memory, child processes, and writing the results.

Benchmarks run as modules from the repository root (`python -m bench.NAME`). Each writes its measurements into its
details page, docs/benchmarks/<page>.md, between `<!-- name:start -->` and `<!-- name:end -->` (write_section), and
its headline figure into its row of BENCHMARKS.md's table (write_headline)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from rlfuse.metrics.tracker import peak_rss_mb, reset_peak_rss  # one definition, re-exported

__all__ = ["ROOT", "WORK", "SHARED_DATA", "PAGES", "INDEX", "machine", "machine_short", "today", "warm_up",
           "reset_cuda_peak", "cuda_peaks_mb", "rss_mb", "peak_rss_mb", "reset_peak_rss", "run_child", "write_section",
           "write_headline", "md_table"]
ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / ".work"
SHARED_DATA = ROOT.parent / "shared" / "data"
PAGES = ROOT / "docs" / "benchmarks"
"""The details pages: one per benchmark script, docs/benchmarks/<page>.md."""
INDEX = ROOT / "BENCHMARKS.md"
"""The one-screen summary: a table of headline figures, one row per benchmark."""


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


def machine_short(load: float | None = None) -> str:
    """The machine for a headline row: 'AMD EPYC, 2 cores, no GPU' (and the 1-minute load average where given)."""
    m = machine()
    out = f"{m['cpu'] or 'CPU'}, {m['cores']} cores, {m['gpu'] or 'no GPU'}"
    return out + (f"; load {load:.1f}" if load is not None else "")


def today() -> str:
    """The UTC date, as the headline table gives it."""
    return time.strftime("%Y-%m-%d", time.gmtime())


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


def run_child(module: str, args: list[str], timeout: int = 1800) -> dict:
    """Run one measurement in a fresh process, `python -m module args...` from the repository root (its peak RSS is
    its own), and return the JSON it prints on its last line of stdout."""
    if not module.startswith("bench."):
        raise ValueError(f"run_child: a module under bench/ (bench.NAME), not {module!r}")
    env = os.environ | {"CI": "true", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_section(name: str, text: str, page: str) -> Path:
    """Replace the text between <!-- name:start --> and <!-- name:end --> in docs/benchmarks/<page>.md with `text` and
    a last line giving the date and time it was written (appended if absent; the page is created, with a title and a
    link back to BENCHMARKS.md, if missing). Returns the page."""
    path = PAGES / f"{page}.md"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if path.exists():
        body = path.read_text()
    else:
        body = f"# Benchmark: {page}\n\n[All benchmarks](../../BENCHMARKS.md). Command: `python -m bench.{page}`.\n"
    block = f"{start}\n{text.rstrip()}\n\nDate: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC.\n{end}"
    if start in body:
        body = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, body, flags=re.S)
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


HEADLINES_START, HEADLINES_END = "<!-- headlines:start -->", "<!-- headlines:end -->"
HEADLINE_HEADER = ["what", "figure", "peer", "command", "machine", "date"]


def _cell(value: str) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def write_headline(name: str, figure: str, peer: str, command: str, machine: str, date: str | None = None, *,
                   what: str | None = None, page: str | None = None) -> None:
    """Set one row of BENCHMARKS.md's headline table, the row marked `<!-- headline:name -->` in its first cell (the
    markers sit inside the cells: a comment on a line of its own would end a markdown table). A row already there
    keeps its first cell (what, and its link to the details page) unless `what` is given; a new row is added at the
    end of the table, linking to docs/benchmarks/<page>.md. date: today (UTC) unless given."""
    marker = f"<!-- headline:{name} -->"
    body = INDEX.read_text() if INDEX.exists() else "# Benchmarks\n"
    if HEADLINES_START not in body:
        body = (body.rstrip() + f"\n\n{HEADLINES_START}\n| " + " | ".join(HEADLINE_HEADER) + " |\n|"
                + "---|" * len(HEADLINE_HEADER) + f"\n{HEADLINES_END}\n")
    head, rest = body.split(HEADLINES_START, 1)
    table, tail = rest.split(HEADLINES_END, 1)
    lines = table.strip("\n").splitlines()
    at = next((i for i, line in enumerate(lines) if marker in line), None)
    if what is not None or at is None:
        label = what or name
        first = f"[{_cell(label)}](docs/benchmarks/{page or name}.md) {marker}"
    else:
        first = lines[at].strip().strip("|").split(" | ")[0].strip()
    cells = [first, _cell(figure), _cell(peer), f"`{_cell(command)}`", _cell(machine), _cell(date or today())]
    row = "| " + " | ".join(cells) + " |"
    if at is None:
        lines.append(row)
    else:
        lines[at] = row
    INDEX.write_text(head + HEADLINES_START + "\n" + "\n".join(lines) + "\n" + HEADLINES_END + tail)


def md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
