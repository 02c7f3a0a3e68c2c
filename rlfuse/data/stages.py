"""What each stage trains on, per data kind: SFT examples, preference pairs, RL prompts (each train / held out)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlfuse.config import Config
from rlfuse.data import guessing
from rlfuse.data.arithmetic import chat_rows, demonstration, problems, wrong_completion
from rlfuse.data.corpus import prompt_of
from rlfuse.data.formats import cell, conversation_prompt, detect, is_empty, split_last_turn
from rlfuse.data.gold import gold_score
from rlfuse.data.sources import (
    PreferencePair,
    SkipCounter,
    TextExample,
    generic_rows,
    hh_pairs,
    imdb_reviews,
    require_columns,
    sentiment_label,
    split_holdout,
)
from rlfuse.data.task import DefaultTask
from rlfuse.errors import DataError

ARITHMETIC_PROBLEMS = 4000
"""data.kind=arithmetic: problems generated when data.max_examples is not set."""


def sft_examples(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list[TextExample], list[TextExample]]:
    kind, split = cfg.data.kind, _splitter(cfg, log)
    if kind == "synthetic":
        train, held = synthetic_split(cfg, task)
        return [TextExample("", r) for r in train], [TextExample("", r) for r in held]
    if kind == "imdb":
        return split([TextExample("", t) for t, _ in imdb_reviews(cfg, log)], "SFT examples")
    if kind == "hh_rlhf":
        return split([TextExample(p.prompt, p.chosen) for p in hh_pairs(cfg, log)], "SFT examples")
    if kind == "guessing":
        return split([TextExample(*guessing.demonstration(r)) for r in guessing_rows(cfg)], "SFT examples")
    if kind == "arithmetic":
        tools = cfg.data.arithmetic_format == "calculator"
        return split([TextExample(*(demonstration(r, tools) if isinstance(r["prompt"], list) else
                                    (r["prompt"], r["completion"]))) for r in arithmetic_rows(cfg)], "SFT examples")
    rows, src, fmt = generic_format(cfg, log)
    col, skip, out = fmt.columns, SkipCounter(src), []
    if "prompt" in col and "completion" in col:
        for i, r in enumerate(rows, 1):
            prompt, completion = cell(r.get(col["prompt"]), col["prompt"], src, i), cell(r.get(col["completion"]), col["completion"], src, i)
            if skip.keep(completion):
                out.append(TextExample(prompt, completion))
    elif "messages" in col or ("text" in col and fmt.conversational):
        name = col.get("messages") or col["text"]
        for i, r in enumerate(rows, 1):
            conversation = cell(r.get(name), name, src, i)
            if skip.keep(conversation):
                out.append(TextExample(*split_last_turn(_messages(conversation, name, src, i), src, i)))
    elif "chosen" in col:  # a preference data set: SFT on the preferred replies, as for hh_rlhf
        log(f"[data] {src}: SFT on column {col['chosen']!r} (the preferred replies)")
        for i, r in enumerate(rows, 1):
            prompt = cell(r.get(col["prompt"]), col["prompt"], src, i) if "prompt" in col else ""
            chosen = cell(r.get(col["chosen"]), col["chosen"], src, i)
            if skip.keep(chosen):
                out.append(TextExample(prompt, chosen) if prompt or isinstance(chosen, str)
                           else TextExample(*split_last_turn(chosen, src, i)))
    elif "text" in col:
        for i, r in enumerate(rows, 1):
            text = cell(r.get(col["text"]), col["text"], src, i)
            if skip.keep(text):
                out.append(TextExample("", text))
    else:
        raise DataError(src, f"no SFT columns (found: {', '.join(map(str, rows[0])) or 'none'})",
                        "give a `text`, `prompt` + `completion` or `messages` column, or map yours with "
                        "data.text_column or data.prompt_column + data.response_column")
    skip.finish(len(out), log)
    d = cfg.data
    return split(out[: d.max_examples] if d.max_examples else out, "SFT examples")


def generic_format(cfg: Config, log=print):
    """A csv/jsonl/parquet/hub data set's rows, source name and TRL format (data/formats.py): each role's column is
    the configured one, else the TRL name when the data set has it. A configured column that is missing is named."""
    rows, src = generic_rows(cfg)
    d = cfg.data
    configured = {"data.text_column": d.text_column, "data.prompt_column": d.prompt_column,
                  "data.response_column": d.response_column, "data.chosen_column": d.chosen_column,
                  "data.rejected_column": d.rejected_column, "data.label_column": d.label_column}
    require_columns(rows, src, {f: c for f, c in configured.items() if c})
    fmt = detect(rows, src, {"text": d.text_column, "prompt": d.prompt_column, "completion": d.response_column,
                             "chosen": d.chosen_column, "rejected": d.rejected_column, "messages": None})
    log(f"[data] {src}: {fmt.name} format (columns: {', '.join(f'{k}={v}' for k, v in fmt.columns.items()) or 'none'})")
    return rows, src, fmt


def _messages(value, column: str, src: str, row: int) -> list:
    if isinstance(value, str):
        raise DataError(src, f"column {column!r}, row {row}: text where the data set's other rows hold message lists",
                        "give every row of this column as a list of messages")
    return value


SMALL_HELD_OUT = 32
"""Fewer held-out items than this and the held-out figures are mostly noise: said once per split."""


def _splitter(cfg: Config, log=None):
    """split(items, what) -> (train, held out) with this config's fraction and seed; errors name the data source,
    and a held-out part too small to measure anything is said."""
    source = cfg.data.path or cfg.data.kind

    def split(items, what):
        train, held = split_holdout(items, cfg.data.eval_fraction, cfg.run.seed, source, what)
        if log is not None and len(held) < SMALL_HELD_OUT and cfg.data.kind != "synthetic":
            log(f"[data] warning: {source}: {len(held)} of {len(train) + len(held)} {what} held out "
                f"(data.eval_fraction={cfg.data.eval_fraction:g}); figures on so few are mostly noise: use more "
                "rows or raise data.eval_fraction")
        return train, held
    return split


def synthetic_split(cfg: Config, task: DefaultTask) -> tuple[list[str], list[str]]:
    return _splitter(cfg)(task.reviews(), "reviews")


def preference_pairs(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list[PreferencePair], list[PreferencePair]]:
    kind, seed, frac, split = cfg.data.kind, cfg.run.seed, cfg.data.eval_fraction, _splitter(cfg, log)
    if kind == "synthetic":
        train, held = synthetic_split(cfg, task)
        n_eval = max(64, int(cfg.rm.num_pairs * frac))
        return gold_pairs(train, cfg.rm.num_pairs, seed, cfg.data.prompt_words), gold_pairs(held, n_eval, seed + 1, cfg.data.prompt_words)
    if kind == "imdb":
        train, held = split(imdb_reviews(cfg, log), "labelled reviews")
        n_eval = max(64, int(cfg.rm.num_pairs * frac))
        return sentiment_pairs(train, cfg.rm.num_pairs, seed), sentiment_pairs(held, n_eval, seed + 1)
    if kind == "hh_rlhf":
        return split(hh_pairs(cfg, log), "preference pairs")
    if kind == "arithmetic":
        rng = random.Random(seed)
        return split([PreferencePair(r["prompt"], r["completion"], wrong_completion(r, rng)) for r in arithmetic_rows(cfg)],
                     "preference pairs")
    rows, src, fmt = generic_format(cfg, log)
    col, d = fmt.columns, cfg.data
    if "chosen" in col and "rejected" in col:
        skip, pairs = SkipCounter(src), []
        for i, r in enumerate(rows, 1):
            prompt = cell(r.get(col["prompt"]), col["prompt"], src, i) if "prompt" in col else ""
            chosen, rejected = (cell(r.get(col[k]), col[k], src, i) for k in ("chosen", "rejected"))
            if skip.keep(chosen, rejected) and chosen != rejected:
                pairs.append(PreferencePair(prompt, chosen, rejected))
        skip.finish(len(pairs), log)
        return split(pairs, "preference pairs")
    if d.text_column and d.label_column:
        items = [(str(r[d.text_column]), sentiment_label(r[d.label_column])) for r in rows]
        items = [(t, y) for t, y in items if t.strip() and y is not None]
        train, held = split(items, "labelled rows")
        return sentiment_pairs(train, cfg.rm.num_pairs, seed), sentiment_pairs(held, max(64, int(cfg.rm.num_pairs * frac)), seed + 1)
    raise DataError(src, "no preference columns (`chosen` and `rejected`)",
                    "give `chosen` and `rejected` columns (and optionally `prompt`), map yours with "
                    "data.chosen_column and data.rejected_column, or set data.text_column and data.label_column")


def _truncated(review: str, rng: random.Random) -> str:
    """A review cut after a random sentence: RL responses stop early too, so the reward model must score those."""
    sents = [s for s in review.split(". ") if s]
    if len(sents) <= 1 or rng.random() < 0.5:
        return review
    return ". ".join(sents[: rng.randint(1, len(sents) - 1)]) + "."


def gold_pairs(reviews: list[str], n: int, seed: int, prompt_words: int, min_gap: float = 0.2) -> list[PreferencePair]:
    """Synthetic task: random pairs of (possibly truncated) reviews, the one with the higher gold score chosen;
    near-ties (gold scores closer than `min_gap`) are left out, as annotators are not asked to rank ties."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        a, b = _truncated(rng.choice(reviews), rng), _truncated(rng.choice(reviews), rng)
        sa, sb = gold_score(a).score, gold_score(b).score
        if abs(sa - sb) >= min_gap:
            pairs.append(PreferencePair("", a, b) if sa > sb else PreferencePair("", b, a))
    return pairs


def sentiment_pairs(items: list[tuple[str, int]], n: int, seed: int) -> list[PreferencePair]:
    """IMDb-style: a positive review preferred over a negative one."""
    pos = [t for t, y in items if y == 1]
    neg = [t for t, y in items if y == 0]
    if not pos or not neg:
        raise DataError("preference pairs", "need both positive and negative reviews", "check the label column")
    rng = random.Random(seed)
    return [PreferencePair("", rng.choice(pos), rng.choice(neg)) for _ in range(n)]


@dataclass(frozen=True)
class PromptRow:
    """An RL prompt as the data set gives it (text, or a message list) and its row's other columns, which reward
    functions receive by name (rlfuse/models/rewards.py)."""
    prompt: object
    columns: dict


def rl_prompts(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list, list]:
    """Prompts for RL and evaluation (train, held out): strings, or message lists for conversational data."""
    train, held = rl_prompt_rows(cfg, task, log)
    return [r.prompt for r in train], [r.prompt for r in held]


def rl_prompt_rows(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list[PromptRow], list[PromptRow]]:
    """rl_prompts with each prompt's other columns (train, held out)."""
    kind, seed, split = cfg.data.kind, cfg.run.seed, _splitter(cfg, log)
    rng = random.Random(seed + 7)
    bare = lambda prompts: [PromptRow(p, {}) for p in prompts]
    if kind == "synthetic":
        train, held = synthetic_split(cfg, task)
        return (bare(prompt_of(r, rng, cfg.data.prompt_words) for r in train),
                bare(prompt_of(r, rng, cfg.data.prompt_words) for r in held))
    if kind == "imdb":
        texts = [t for t, _ in imdb_reviews(cfg, log)]
        return split(bare(prompt_of(t, rng, max(cfg.data.prompt_words, 8)) for t in texts), "prompts")
    if kind == "hh_rlhf":
        return split(bare(p.prompt for p in hh_pairs(cfg, log) if p.prompt), "prompts")
    if kind == "arithmetic":
        return split([PromptRow(r["prompt"], {"answer": r["answer"]}) for r in arithmetic_rows(cfg)], "prompts")
    if kind == "guessing":
        return split([PromptRow(r["prompt"], {"target": r["target"]}) for r in guessing_rows(cfg)], "prompts")
    rows, src, fmt = generic_format(cfg, log)
    col = fmt.columns
    if "prompt" in col:  # a prompt column is the prompt, whole
        used = col["prompt"]
        prompts = [cell(r.get(used), used, src, i) for i, r in enumerate(rows, 1)]
    elif "messages" in col or ("chosen" in col and fmt.conversational):  # the conversation before its last reply
        used = col.get("messages") or col["chosen"]
        prompts = [conversation_prompt(_messages(cell(r.get(used), used, src, i), used, src, i))
                   for i, r in enumerate(rows, 1)]
    elif "text" in col:  # a text column is not a prompt: its opening words are, as for the reviews of imdb
        n, used = max(cfg.data.prompt_words, 8), col["text"]
        log(f"[data] {src}: RL prompts are the first 2-{n} words of column {used!r} (a text column); set "
            "data.prompt_column to use a column whole")
        prompts = [prompt_of(str(cell(r.get(used), used, src, i)), rng, n) for i, r in enumerate(rows, 1)]
    else:
        raise DataError(src, f"no prompt column (found: {', '.join(map(str, rows[0])) or 'none'})",
                        "give a `prompt` or `messages` column, or set data.prompt_column")
    out = [PromptRow(p, {k: v for k, v in r.items() if k != used}) for p, r in zip(prompts, rows) if not is_empty(p)]
    return split(out, "prompts")


def guessing_rows(cfg: Config) -> list[dict]:
    return guessing.games(cfg.data.max_examples or ARITHMETIC_PROBLEMS, cfg.run.seed, cfg.data.max_operand)


def arithmetic_rows(cfg: Config) -> list[dict]:
    d = cfg.data
    if d.arithmetic_format != "text":
        return chat_rows(d.max_examples or ARITHMETIC_PROBLEMS, cfg.run.seed, d.max_operand,
                         d.arithmetic_format == "calculator")
    return problems(d.max_examples or ARITHMETIC_PROBLEMS, cfg.run.seed, d.max_operand, d.arithmetic_steps,
                    d.arithmetic_working)
