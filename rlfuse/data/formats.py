"""TRL's dataset formats, detected per data set, and the cell types a column may hold.

Standard rows hold text: `text` (language modelling), `prompt` (prompt only), `prompt` + `completion`, `prompt` +
`chosen` + `rejected` (or `chosen` + `rejected` with the prompt inside them). Conversational rows hold message lists
(`[{"role": "user", "content": ...}, ...]`) in the same columns, or one `messages` column. A data set is one or the
other: the first usable row decides, and a later row of the other kind is a data error naming the row.

A cell is a string or a message list; anything else (a dict, a list of numbers, a list of dicts without role and
content) is a data error naming the column, never its Python repr passed on as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from rlfuse.errors import DataError

Messages = list[dict]
Cell = Union[str, Messages]
"""What a text column holds after checking: a string, or a message list (conversational)."""

ROLES = ("system", "user", "assistant", "tool", "developer")


def is_messages(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def cell(value, column: str, source: str, row: int) -> Cell:
    """The checked content of one cell: text as a string (None as ""), a message list as a list of
    {"role", "content"} dicts. DataError naming the column and row for any other type."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if is_messages(value):
        out = []
        for m in value:
            if not isinstance(m["content"], str) or str(m["role"]) not in ROLES:
                raise DataError(source, f"column {column!r}, row {row}: a message needs a role in {ROLES} and text "
                                f"content (got role {m['role']!r}, content of type {type(m['content']).__name__})",
                                "write each message as {\"role\": \"user\", \"content\": \"...\"}")
            out.append({"role": str(m["role"]), "content": m["content"]})
        return out
    raise DataError(source, f"column {column!r}, row {row}: a {type(value).__name__} is neither text nor a list of "
                    "messages", f"give {column!r} as text or as [{{\"role\": ..., \"content\": ...}}, ...], or map "
                    "another column with data.*_column")


def is_empty(value: Cell) -> bool:
    return not value.strip() if isinstance(value, str) else not any(m["content"].strip() for m in value)


@dataclass(frozen=True)
class DatasetFormat:
    columns: dict[str, str]
    """Role -> column: text, prompt, completion, chosen, rejected, messages (those present)."""
    conversational: bool

    @property
    def name(self) -> str:
        kind = ("preference" if "chosen" in self.columns else "prompt-completion" if "completion" in self.columns
                else "messages" if "messages" in self.columns else "prompt-only" if "prompt" in self.columns
                else "language modelling")
        return ("conversational " if self.conversational else "standard ") + kind


def detect(rows: list[dict], source: str, mapping: dict[str, str | None]) -> DatasetFormat:
    """The data set's format: each role's column (mapping: role -> a configured column, or None to use the TRL
    name when present), and whether its cells are message lists (the first row with any non-empty cell decides).
    Rows that do not all have the same role columns are refused (refuse_mixed_schemas)."""
    refuse_mixed_schemas(rows, source, [configured or role for role, configured in mapping.items()])
    found = set(rows[0].keys()) if rows else set()
    columns = {}
    for role, configured in mapping.items():
        col = configured or role
        if col in found:
            columns[role] = col
    conversational = None
    for i, r in enumerate(rows):
        kinds = {is_messages(r.get(c)) for c in columns.values() if r.get(c) not in (None, "", [])}
        if len(kinds) > 1:
            raise DataError(source, f"row {i + 1} mixes message lists and plain text across columns "
                            f"{', '.join(columns.values())}", "give every column as text, or every one as messages")
        if kinds:
            conversational = kinds.pop()
            break
    return DatasetFormat(columns, bool(conversational))


def refuse_mixed_schemas(rows: list[dict], source: str, role_columns: list[str]) -> None:
    """A DataError when the rows do not all have the same columns among `role_columns` (a JSONL file whose rows
    mix formats: `text` rows, `prompt` + `completion` rows, `chosen` + `rejected` rows). The first row decides the
    format, and the other rows' cells would read as missing: rows lost as "empty text". The message counts the rows
    of each set of columns and names the first row of each."""
    first: dict[tuple, int] = {}
    counts: dict[tuple, int] = {}
    for i, r in enumerate(rows, 1):
        schema = tuple(c for c in dict.fromkeys(role_columns) if c in r)
        counts[schema] = counts.get(schema, 0) + 1
        first.setdefault(schema, i)
    if len(counts) < 2:
        return
    ranked = sorted(counts, key=lambda k: -counts[k])
    parts = [f"{counts[k]} with {' + '.join(k) or 'none of them'} (first: row {first[k]})" for k in ranked[:4]]
    more = f", and {len(ranked) - 4} other sets" if len(ranked) > 4 else ""
    raise DataError(source, f"its rows do not all have the same columns among {', '.join(dict.fromkeys(role_columns))}"
                    f": {len(rows)} rows, {'; '.join(parts)}{more}",
                    "give every row the same columns (one format per file: split the file by format, or add the "
                    "missing columns with empty values)")


def conversation_prompt(messages: Messages) -> Messages:
    """What an RL prompt is in a conversation: everything before its last assistant turn when it ends with one
    (the reply the policy is to write), else the whole conversation."""
    return messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages


def split_last_turn(messages: Messages, source: str, row: int) -> tuple[Messages, Messages]:
    """A conversation -> (everything before the last assistant turn, that turn): the prompt and the completion of
    a `messages` row, for completion-only SFT and for RL prompts."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return messages[:i], messages[i:]
    raise DataError(source, f"row {row}: a conversation with no assistant turn", "end each conversation with the "
                    "assistant's reply, or give prompts in a `prompt` column")
