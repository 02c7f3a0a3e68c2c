"""The config fields' own attribute docstrings, read from the source once: `rlfuse --help` prints them and an unknown
field's error quotes the closest one."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import typing

from rlfuse.config.algorithms import ALGORITHMS
from rlfuse.config.sections import Config


@functools.lru_cache(maxsize=None)  # inspect.getsource parses the whole module per class: once is enough
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a config section, for `rlfuse --help` and unknown-field errors."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant):
            docs[a.target.id] = b.value.value
    return docs


# full stops that do not end a sentence: "e.g. 8", "i.e. the", "vs. TRL", "1.5"
_NOT_AN_END = re.compile(r"\b(e\.g|i\.e|etc|vs|cf)\.$")


def field_summary(cls, name: str) -> str:
    """The first sentence of a field's docstring, on one line ("" without one)."""
    doc = " ".join(field_docs(cls).get(name, "").split())
    start = 0
    while (end := doc.find(". ", start)) >= 0:
        if not _NOT_AN_END.search(doc[: end + 1]):
            return doc[: end + 1]
        start = end + 2
    return doc


def section_class(section: str):
    """The dataclass of a config section, e.g. section_class("rl") is RLConfig."""
    return typing.get_type_hints(Config)[section]


COMMON_FIELDS = (
    ("model", ("model.name", "model.lora", "model.quantization")),
    ("data", ("data.kind", "data.path", "data.max_length")),
    ("algorithm", ("rl.algo", "rl.k", "rl.reward", "rl.iterations")),
    ("batch sizes", ("rl.prompts_per_iter", "rl.mini_batch_size", "rl.micro_batch_size", "sft.batch_size",
                     "sft.micro_batch_size", "rm.batch_size", "rm.micro_batch_size")),
    ("learning", ("sft.lr", "sft.steps", "rm.lr", "rm.steps", "rl.lr", "rl.epochs")),
    ("KL penalty", ("rl.kl_coef", "rl.kl_target")),
    ("sampling", ("rl.max_new_tokens", "rl.temperature", "rollout.engine")),
    ("output", ("run.dir", "run.seed", "run.report_to", "rl.eval_every")),
    ("hardware", ("run.device", "run.precision", "placement.strategy", "placement.workers")),
)
"""The settings most runs touch, by topic: what `rlfuse --help` and each command's --help list first."""


def field_default(section: str, name: str) -> str:
    """A field's default as --help shows it, with the algorithms' own where they preset it: '1 (rloo, grpo: 4)'."""
    f = next(f for f in dataclasses.fields(section_class(section)) if f.name == name)
    default = json.dumps(f.default if f.default is not dataclasses.MISSING else f.default_factory())
    if section != "rl":
        return default
    presets: dict = {}
    for algo in ALGORITHMS.values():
        if name in algo.preset and json.dumps(algo.preset[name]) != default:  # ppo's are the defaults
            presets.setdefault(json.dumps(algo.preset[name]), []).append(algo.name)
    shown = "; ".join(f"{', '.join(names)}: {value}" for value, names in presets.items())
    return f"{default} ({shown})" if shown else default
