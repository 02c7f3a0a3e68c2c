"""Reward callables handed to the Python API that cannot be imported by name (a lambda, a function defined in a
notebook, a script run as __main__ or inside another function): kept here for this process and named in the run's
config as `rlfuse.live_rewards:NAME`, so rl.reward stays a `module:function` string everywhere else. Another process
(a run resumed from the command line, a Ray worker) cannot find them and says how to pass them again."""

from __future__ import annotations

import importlib
import re

from rlfuse.errors import UserError

_LIVE: dict = {}


def reward_spec(fn, field: str = "rl.reward") -> str:
    """rl.reward (or rl.tools, rl.environment: `field`) for a callable: its own `module:name` when that imports back
    to the same object in any process, else `rlfuse.live_rewards:<its name>`, registered for this process."""
    if not callable(fn):
        raise UserError(f"config error: {field}: {fn!r} is not callable; pass a function (a class for "
                        "rl.environment), or a 'module:function' string")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module and module != "__main__" and qualname and re.fullmatch(r"\w+", qualname):
        try:
            if getattr(importlib.import_module(module), qualname) is fn:
                return f"{module}:{qualname}"
        except (ImportError, AttributeError):
            pass
    name = re.sub(r"\W", "_", getattr(fn, "__name__", type(fn).__name__)).strip("_") or "reward"
    _LIVE[name] = fn
    return f"{__name__}:{name}"


def is_live(spec: str) -> bool:
    return spec.startswith(f"{__name__}:")


def __getattr__(name: str):
    if name in _LIVE:
        return _LIVE[name]
    if name.startswith("__"):  # import machinery probing for __path__ and the like
        raise AttributeError(name)
    raise UserError(f"config error: rl.reward: rlfuse.live_rewards:{name} was a Python callable passed to the API in "
                    "the process that started this run, and this process does not have it; pass it again "
                    "(rlfuse.train_rl(run_dir=RUN_DIR, resume=True, reward=your_function)), or define it in an "
                    "importable module and set rl.reward=module:function")
