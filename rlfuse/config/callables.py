"""User code named in a config: `module:function` (an importable module, or a module file beside the working
directory) or `path/to/file.py:function` (a file anywhere, as veRL takes it). `check_callable` says what is wrong
before anything heavy loads, without running the user's code; `load_callable` imports it."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from rlfuse.errors import ConfigError, first_line


def split_spec(spec: str) -> tuple[str, str]:
    """'a.b:fn' -> ('a.b', 'fn'); 'dir/f.py:fn' -> ('dir/f.py', 'fn'). The last colon splits, so a Windows drive's
    stays in the path."""
    where, _, name = spec.strip().rpartition(":")
    return where, name


def is_file_spec(spec: str) -> bool:
    """A file path rather than a module name: it ends in .py or names a folder."""
    where, _ = split_spec(spec)
    return where.endswith(".py") or "/" in where or os.sep in where


def check_callable(spec: str, field: str) -> str:
    """The spec as a run should keep it (a file path made absolute, so a resumed run or a Ray worker started
    elsewhere finds the same file), or ConfigError naming what was tried. Runs no user code: a module is only
    looked up, a file only checked to exist."""
    where, name = split_spec(spec)
    if not where or not name or not name.isidentifier():
        raise ConfigError(field, f"{spec!r} is not module:function or path/to/file.py:function",
                          f"e.g. {field}=myrewards:score (myrewards.py beside the working directory) or "
                          f"{field}=./rewards/score.py:score")
    if is_file_spec(spec):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ConfigError(field, f"file {where} not found (looked in {path.resolve().parent})",
                              "give the path of a .py file holding the function, relative to the working directory "
                              "or absolute")
        return f"{path.resolve()}:{name}"
    if _find_module(where) is None:
        if not _beside_cwd(where):
            raise ConfigError(field, f"no module {where!r}: not importable, and no {where.replace('.', '/')}.py in "
                              f"the working directory {Path.cwd()}",
                              f"run from the folder that holds it, give its path ({field}=path/to/"
                              f"{where.split('.')[-1]}.py:{name}), or install it")
        module_file = Path.cwd() / f"{where}.py"
        if module_file.is_file():  # a file beside the working directory: kept as its path, found from anywhere
            return f"{module_file.resolve()}:{name}"
    return spec.strip()


def load_callable(spec: str, field: str):
    """The function a spec names (see check_callable), or ConfigError: the module or file that fails to import,
    or a name it does not define, said in one line."""
    where, name = split_spec(spec)
    try:
        module = _load_file(Path(where), field) if is_file_spec(spec) else _import(where, field)
    except ConfigError:
        raise
    except Exception as e:  # the user's module fails as it imports: theirs to fix, named as such
        raise ConfigError(field, f"importing {where} raised {type(e).__name__}: {first_line(e)}",
                          f"fix the module (`python {where}` or `python -c 'import {where}'` shows it)") from None
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(field, f"{where} has no {name!r}",
                          f"name one of its functions ({', '.join(defined[:8]) or 'it defines none'})")
    if not callable(fn):
        raise ConfigError(field, f"{where}:{name} is a {type(fn).__name__}, not a function",
                          "name a function, e.g. f(prompts, completions, **columns) -> list of floats")
    return fn


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name.split(".")[0])
    except (ImportError, ValueError):
        return None


def _beside_cwd(module: str) -> bool:
    top = Path.cwd() / module.split(".")[0]
    return Path.cwd().joinpath(*module.split(".")).with_suffix(".py").is_file() or (top / "__init__.py").is_file()


USER_PATH_ENV = "RLFUSE_USER_PATH"
"""The folder a run was started from, for its Ray workers: a package beside it imports there too."""


def _import(module: str, field: str):
    """import_module, the working directory (or the driver's, on a Ray worker) last on the path where the module is
    a package there: after the installed ones, so a file there called json.py shadows nothing."""
    for folder in (os.getcwd(), os.environ.get(USER_PATH_ENV)):
        if folder and _find_module(module) is None and folder not in sys.path:
            sys.path.append(folder)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.split(".")[0] == e.name.split(".")[0]:
            raise ConfigError(field, f"no module {module!r} (not importable, and no {module.split('.')[0]}.py "
                              f"in {Path.cwd()})", "give the file's path instead: path/to/file.py:function") from None
        raise


def _load_file(path: Path, field: str):
    """A module from a file, imported once per process under a name made from its path (two files called
    rewards.py stay apart) and registered in sys.modules, so its functions pickle and it imports its neighbours."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(field, f"file {path} not found", "give the path of the .py file holding the function")
    key = f"rlfuse_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    if str(path.parent) not in sys.path:  # `import helpers` next to the file works, as when run as a script
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module
