"""Data sources -> plain records for each stage.

One loader for local files (csv, jsonl, jsonl.gz, parquet) and hub data sets (through `datasets`), with the column
names of IMDb (Kaggle CSV: review,sentiment; hub stanfordnlp/imdb: text,label), Anthropic hh-rlhf (chosen,rejected)
or a mapping given in the config. Bad input gives a DataError naming the file and the fix; rows with empty text are
skipped and counted.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from rlfuse.config import Config
from rlfuse.data.formats import is_empty
from rlfuse.errors import DataError

IMDB_HUB = "stanfordnlp/imdb"
HH_HUB = "Anthropic/hh-rlhf"
HH_ASSISTANT = "\n\nAssistant:"


@dataclass(frozen=True)
class TextExample:
    """SFT example: the loss covers `response` (completion-only) or `prompt + response` (full text). Each is a
    string, or a message list (conversational, rendered with the chat template: data/chat.py)."""
    prompt: str | list
    response: str | list


@dataclass(frozen=True)
class PreferencePair:
    """Strings, or message lists (conversational); an empty prompt: the prompt is inside chosen and rejected."""
    prompt: str | list
    chosen: str | list
    rejected: str | list


# ------------------------------------------------------------------------------------------ raw records


def read_records(path: str | Path) -> list[dict]:
    """Rows of a local csv / jsonl / jsonl.gz / parquet file as dicts. DataError on unreadable input."""
    p = Path(path)
    if not p.is_file():
        raise DataError(str(p), "file not found", "set data.path to an existing file")
    if p.stat().st_size == 0:
        raise DataError(str(p), "file is empty", "point data.path at a file with rows")
    name = p.name.lower()
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # pyarrow: only for .parquet files

            return pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(str(p), f"not a readable parquet file ({type(e).__name__})", "re-export it as parquet") from None
    raw = p.read_bytes()
    if name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):
            raise DataError(str(p), "not a valid gzip file", "decompress it or re-create the .gz") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(str(p), f"not UTF-8 (byte 0x{raw[e.start]:02x} at line {line})",
                        "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise DataError(str(p), "file has no rows", "point data.path at a file with rows")
    if ".jsonl" in name or name.endswith(".json"):
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(str(p), f"line {i} is not valid JSON", "fix or remove that line") from None
            if not isinstance(row, dict):
                raise DataError(str(p), f"line {i} is not a JSON object", "write one object per line")
            rows.append(row)
        return rows
    if name.endswith((".csv", ".csv.gz", ".tsv")):
        csv.field_size_limit(1 << 30)
        reader = csv.DictReader(io.StringIO(text), delimiter="\t" if ".tsv" in name else ",")
        return list(reader)
    raise DataError(str(p), "unknown file type", "use .csv, .jsonl, .jsonl.gz or .parquet")


def load_hub(name: str, subset: str | None = None, split: str = "train") -> list[dict]:
    """A hub data set through `datasets` (needs network or a local datasets cache): configuration `subset`, `split`."""
    try:
        from datasets import load_dataset  # datasets: only for hub data sets

        return list(load_dataset(name, subset, split=split))
    except Exception as e:  # offline, unknown name, gated, missing config: all end the same way for the user
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise DataError(name, f"could not load this hub data set (subset {subset!r}, split {split!r}: "
                        f"{type(e).__name__}{': ' + detail if detail else ''})",
                        "check the name, data.subset, data.split and the network, or set data.path to a local file") from None


def require_columns(rows: list[dict], source: str, columns: dict[str, str]) -> None:
    """columns: config field -> column name. DataError naming the missing one and the columns found; a column that
    only some rows have (a JSONL file mixing schemas) is named with how many rows lack it, since those rows would
    otherwise be dropped as empty."""
    found = list(rows[0].keys()) if rows else []
    for field, col in columns.items():
        if col not in found:
            raise DataError(source, f"missing column {col!r} (found: {', '.join(map(str, found)) or 'none'})",
                            f"set {field}=<column> to the right one")
    for field, col in columns.items():
        lacking = [i for i, r in enumerate(rows, 1) if col not in r]
        if lacking:
            other = ", ".join(map(str, rows[lacking[0] - 1].keys())) or "none"
            raise DataError(source, f"column {col!r} is missing from {len(lacking)} of {len(rows)} rows (first: row "
                            f"{lacking[0]}, whose columns are {other})",
                            f"give every row a {col!r} column (one format per file), or set {field} to a column "
                            "every row has")


def _clean(text) -> str:
    if text is None:
        return ""
    return re.sub(r"<br\s*/?>", " ", str(text)).strip()


class SkipCounter:
    """Counts rows skipped for empty text, so the stage can report them instead of crashing later."""

    def __init__(self, source: str):
        self.source, self.skipped = source, 0

    def keep(self, *values) -> bool:
        """values: strings or message lists; a row is kept when none is empty."""
        ok = not any(is_empty(v) for v in values)
        self.skipped += not ok
        return ok

    def finish(self, kept: int, log) -> None:
        if kept == 0:
            raise DataError(self.source, f"no usable rows ({self.skipped} with empty text, the rest unusable: unknown "
                            "labels or identical chosen and rejected)", "check the file and the column mapping")
        if self.skipped:
            log(f"[data] {self.source}: skipped {self.skipped} rows with empty text, kept {kept}")


# ------------------------------------------------------------------------------------------ per kind


def _rows(cfg: Config, default_hub: str | None) -> tuple[list[dict], str]:
    path = cfg.data.path or default_hub
    if path is None:
        raise DataError(cfg.data.kind, "no data.path given", "set data.path to a file")
    rows = read_records(path) if Path(path).exists() else load_hub(path, cfg.data.subset, cfg.data.split)
    if not rows:
        raise DataError(path, "no rows", "point data.path at a file with rows")
    if cfg.data.max_examples:
        rows = rows[: cfg.data.max_examples * 2]  # headroom for skipped rows; trimmed after skipping
    return rows, path


def sentiment_label(value) -> int | None:
    s = str(value).strip().lower()
    if s in ("positive", "pos", "1", "true"):
        return 1
    if s in ("negative", "neg", "0", "false"):
        return 0
    return None


def imdb_reviews(cfg: Config, log=print) -> list[tuple[str, int]]:
    """(review, 1 positive / 0 negative) from the Kaggle CSV (review,sentiment) or the hub (text,label)."""
    rows, src = _rows(cfg, IMDB_HUB)
    text_col = cfg.data.text_column or ("review" if "review" in rows[0] else "text")
    label_col = cfg.data.label_column or ("sentiment" if "sentiment" in rows[0] else "label")
    require_columns(rows, src, {"data.text_column": text_col, "data.label_column": label_col})
    skip, out = SkipCounter(src), []
    for r in rows:
        text, label = _clean(r.get(text_col)), sentiment_label(r.get(label_col))
        if skip.keep(text) and label is not None:
            out.append((text, label))
    out = out[: cfg.data.max_examples] if cfg.data.max_examples else out
    skip.finish(len(out), log)
    return out


def hh_messages(transcript: str) -> list[dict]:
    """An hh-rlhf transcript ("\n\nHuman: ... \n\nAssistant: ...") as TRL's message list, Human turns as the user's
    and Assistant turns as the assistant's (an empty trailing "Assistant:", the prompt's end, leaves no turn)."""
    parts = re.split(r"\n\n(Human|Assistant):", "\n\n" + transcript.strip())
    turns = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
             for who, text in zip(parts[1::2], parts[2::2])]
    return [t for t in turns if t["content"] or t["role"] == "user"]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def split_hh(conversation: str) -> tuple[str, str]:
    """hh-rlhf text -> (prompt ending in 'Assistant:', final assistant response)."""
    i = conversation.rfind(HH_ASSISTANT)
    if i < 0:
        return "", conversation.strip()
    return conversation[: i + len(HH_ASSISTANT)], conversation[i + len(HH_ASSISTANT):].strip()


def hh_pairs(cfg: Config, log=print) -> list[PreferencePair]:
    rows, src = _rows(cfg, HH_HUB)
    chosen_col, rejected_col = cfg.data.chosen_column or "chosen", cfg.data.rejected_column or "rejected"
    require_columns(rows, src, {"data.chosen_column": chosen_col, "data.rejected_column": rejected_col})
    skip, out = SkipCounter(src), []
    for r in rows:
        prompt, chosen = split_hh(_clean(r.get(chosen_col)))
        prompt_r, rejected = split_hh(_clean(r.get(rejected_col)))
        if skip.keep(chosen, rejected) and chosen != rejected:
            if cfg.data.conversational:  # the chat format: the turns before the last reply, each reply its own turn
                out.append(PreferencePair(hh_messages(prompt or prompt_r), assistant(chosen), assistant(rejected)))
            else:
                out.append(PreferencePair(prompt or prompt_r, chosen, rejected))
    out = out[: cfg.data.max_examples] if cfg.data.max_examples else out
    skip.finish(len(out), log)
    return out


def generic_rows(cfg: Config) -> tuple[list[dict], str]:
    return _rows(cfg, None)


def split_holdout(items: list, fraction: float, seed: int, source: str = "data", what: str = "rows") -> tuple[list, list]:
    """Deterministic shuffle, then (train, held out); at least one item in each. DataError (naming `source`) when
    there are fewer than two usable items."""
    items = list(items)
    if len(items) < 2:
        raise DataError(source, f"{len(items)} usable {what}; at least 2 are needed (one held out for validation, "
                        "one to train on)", "use a file with more usable rows (non-empty text, known labels)")
    random.Random(seed).shuffle(items)
    n_eval = min(len(items) - 1, max(1, int(len(items) * fraction)))
    return items[n_eval:], items[:n_eval]
