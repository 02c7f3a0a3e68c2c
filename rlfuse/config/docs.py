"""The config fields' own attribute docstrings, read from the source once: `rlfuse --help` prints them and an unknown
field's error quotes the closest one."""

from __future__ import annotations

import ast
import functools
import inspect
import typing

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


def field_summary(cls, name: str) -> str:
    """The first sentence of a field's docstring, on one line ("" without one)."""
    doc = " ".join(field_docs(cls).get(name, "").split())
    end = doc.find(". ")
    return doc if end < 0 else doc[: end + 1]


def section_class(section: str):
    """The dataclass of a config section, e.g. section_class("rl") is RLConfig."""
    return typing.get_type_hints(Config)[section]
