"""Tools as the policy reads them: each tool's JSON schema from its type hints and docstring (the OpenAI /
transformers form), the system turn that describes them for a chat template without a tool section of its own, and
the `<tool_call>` block a call is written as. Text only: running tools is rollout/tools.py's.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(hint) -> dict:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X], X | None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    return {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}


def _docstring_parts(fn) -> tuple[str, dict[str, str]]:
    """(description: the docstring's first paragraph, {argument: its line under Args:})."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    args, inside = {}, False
    for line in doc.splitlines():
        if line.strip().lower() in ("args:", "arguments:", "parameters:"):
            inside = True
            continue
        if inside:
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
            if m:
                args[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                inside = False
    return description, args


def tool_schema(fn) -> dict:
    """The tool's schema in the OpenAI / transformers form {"type": "function", "function": {name, description,
    parameters}}: parameters from the type hints (required: those without a default), descriptions from the
    docstring's first paragraph and its Args: section."""
    hints = typing.get_type_hints(fn)
    description, arg_docs = _docstring_parts(fn)
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or name == "self":  # an environment's method
            continue
        prop = _json_type(hints.get(name, str))
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def tools_system_text(schemas: list[dict]) -> str:
    """The tools described in a system turn, for a chat template with no tool section of its own (SmolLM2's plain
    ChatML): the schemas as JSON lines and the call format."""
    lines = "\n".join(json.dumps(s["function"]) for s in schemas)
    return ("You can call these tools:\n" + lines + "\nTo call one, reply with <tool_call>{\"name\": NAME, "
            "\"arguments\": {...}}</tool_call>; its result comes back in a tool message.")


def tool_call_text(name: str, arguments: dict) -> str:
    """A call as the policy writes it (and as demonstrations show it): <tool_call>{"name": ..., "arguments": ...}."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tools_prompt(prompt, schemas: list[dict]) -> list[dict]:
    """The prompt as chat messages for an episode (a text prompt becomes one user turn), the tools described in a
    system turn (tools_system_text, merged into the prompt's own system turn where it has one)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if not schemas:
        return messages
    text = tools_system_text(schemas)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + text
        return messages
    return [{"role": "system", "content": text}] + messages

