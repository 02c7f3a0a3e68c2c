"""The layered house (docs/architecture.md) holds: each layer imports only from the layers below it, no import cycle
among rlfuse's modules (imports inside functions count), config/, plan/ and schedule/ load neither torch nor Ray,
and an import inside a function only defers a heavy library, saying so in a comment."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "rlfuse"
HEAVY = {"torch", "transformers", "peft", "ray", "bitsandbytes", "trl", "datasets", "pyarrow", "huggingface_hub",
         "matplotlib", "tokenizers", "mlflow", "wandb", "trackio", "vllm", "gguf"}
"""Libraries worth deferring: seconds to import, or an optional install (`resource` is Unix only)."""


def test_import_contracts_hold():
    """import-linter's layers contract and the purity contract (pyproject.toml [tool.importlinter]): a broken one
    prints the offending import with its line."""
    pytest.importorskip("importlinter", reason="import-linter is not installed: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()", "--no-cache"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 kept, 0 broken" in out.stdout


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, inside_functions: bool | None = None) -> list[tuple[ast.AST, list[str]]]:
    """(import statement, modules it names) in `path`: all of them, or only those inside / outside functions."""
    tree = ast.parse(path.read_text())
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", 0):
            continue
        if inside_functions is not None and (id(node) in in_function) != inside_functions:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out.append((node, names))
    return out


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def rlfuse_module(name: str) -> str | None:
    """The rlfuse module a dotted name lands in (the longest prefix that is one), else None."""
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in MODULES), None)


def import_graph(inside_functions: bool | None = None) -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for _, names in imports_of(path, inside_functions):
            graph[m] |= {t for t in map(rlfuse_module, names) if t is not None and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycle_among_rlfuse_modules():
    assert cycles(import_graph()) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def run_clean(code: str) -> str:
    """`code` in a fresh interpreter at the repository root; its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


LOADED_HEAVY = "print(sorted(m for m in ('torch', 'ray', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules))"


def test_loading_every_shipped_config_imports_neither_torch_nor_ray():
    code = ("import sys, glob; from rlfuse.config import load_config; from rlfuse.errors import ConfigError\n"
            "for path in sorted(glob.glob('configs/*.yaml')):\n"
            "    try: load_config(path)\n"
            "    except ConfigError as e:  # a real-model config without its package or ../shared/data\n"
            "        if 'which is not installed' not in str(e) and 'shared/data' not in str(e): raise\n" + LOADED_HEAVY)
    assert run_clean(code) == "[]"


def test_plan_and_schedule_are_pure_at_any_depth():
    """Every module of plan/ and schedule/ imported, a config resolved and planned, schedules built and simulated:
    no torch, no Ray anywhere underneath."""
    names = sorted(m for m in MODULES if m.startswith(("rlfuse.plan", "rlfuse.schedule")))
    assert "rlfuse.plan.resolve" in names and "rlfuse.schedule.build" in names
    code = ("import sys\n" + "".join(f"import {m}\n" for m in names) +
            "from rlfuse.config import load_config\n"
            "from rlfuse.plan.planner import plan_config\n"
            "from rlfuse.plan.resolve import resolve\n"
            "from rlfuse.schedule.build import fused\n"
            "from rlfuse.schedule.model import Problem\n"
            "resolve(load_config(None, ['placement.strategy=auto', 'placement.workers=2']))\n"
            "plan_config(load_config(None, ['placement.workers=2']))\n"
            "fused(Problem.fused(4, 2, 4, 4, 5, 4, 2.0), time_limit=1)\n" + LOADED_HEAVY)
    assert run_clean(code) == "[]"


def heavy_at_import(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Per module, the heavy libraries importing it loads (its module-level imports, followed through rlfuse)."""
    direct = {m: {n.split(".")[0] for _, names in imports_of(p, inside_functions=False) for n in names} & HEAVY
              for m, p in MODULES.items()}
    for m in MODULES:  # importing a module runs its packages' __init__ files first
        parts = m.split(".")
        graph[m] |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)
    out: dict[str, set[str]] = {}
    in_progress: set[str] = set()

    def visit(m):
        if m in out:
            return out[m]
        in_progress.add(m)  # the module-level graph has no cycle (test above); this only guards the recursion
        got = set(direct[m])
        for d in graph[m] - in_progress:
            got |= visit(d)
        in_progress.discard(m)
        out[m] = got
        return got

    for m in MODULES:
        visit(m)
    return out


def test_imports_inside_functions_defer_a_heavy_library_and_say_so():
    """An import inside a function must load a heavy library (HEAVY, or an rlfuse module that does) that importing
    its own module does not, and carry a comment on its line or just above its run of imports: never a way round
    an import cycle."""
    heavy = heavy_at_import(import_graph(inside_functions=False))
    problems = []
    for m, path in MODULES.items():
        if m == "rlfuse":  # the package's __init__ runs before any of its modules: it may import none of them eagerly
            continue
        lines = path.read_text().splitlines()
        for node, names in imports_of(path, inside_functions=True):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            deferred = set()
            for n in names:
                target = rlfuse_module(n)
                deferred |= heavy[target] if target else ({n.split(".")[0]} & (HEAVY | {"resource"}))
            if not deferred - heavy[m]:
                problems.append(f"{where}: {names[0]} defers nothing heavy (already loaded: {sorted(heavy[m])}); "
                                f"import it at the top of the module")
            first = node.lineno - 1
            while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                first -= 1  # a run of imports shares the comment above it
            if "#" not in lines[node.lineno - 1] and "#" not in lines[first - 1]:
                problems.append(f"{where}: {names[0]} imported inside a function without a comment saying why")
    assert problems == [], "\n".join(problems)
