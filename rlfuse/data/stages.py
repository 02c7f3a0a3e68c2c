"""What each stage trains on, per data kind: SFT examples, preference pairs, RL prompts (each train / held out)."""

from __future__ import annotations

import random

from rlfuse.config import Config
from rlfuse.data.corpus import prompt_of
from rlfuse.data.gold import gold_score
from rlfuse.data.sources import (PreferencePair, SkipCounter, TextExample, generic_rows, hh_pairs, imdb_reviews,
                                 require_columns, sentiment_label, split_holdout)
from rlfuse.data.task import DefaultTask
from rlfuse.errors import DataError


def sft_examples(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list[TextExample], list[TextExample]]:
    kind, split = cfg.data.kind, _splitter(cfg)
    if kind == "synthetic":
        train, held = synthetic_split(cfg, task)
        return [TextExample("", r) for r in train], [TextExample("", r) for r in held]
    if kind == "imdb":
        return split([TextExample("", t) for t, _ in imdb_reviews(cfg, log)], "SFT examples")
    if kind == "hh_rlhf":
        return split([TextExample(p.prompt, p.chosen) for p in hh_pairs(cfg, log)], "SFT examples")
    rows, src = generic_rows(cfg)
    d = cfg.data
    if d.prompt_column and d.response_column:
        require_columns(rows, src, {"data.prompt_column": d.prompt_column, "data.response_column": d.response_column})
        skip = SkipCounter(src)
        out = [TextExample(str(r[d.prompt_column]), str(r[d.response_column])) for r in rows
               if skip.keep(str(r[d.response_column] or ""))]
    else:
        col = d.text_column or "text"
        require_columns(rows, src, {"data.text_column": col})
        skip = SkipCounter(src)
        out = [TextExample("", str(r[col])) for r in rows if skip.keep(str(r[col] or ""))]
    skip.finish(len(out), log)
    return split(out[: d.max_examples] if d.max_examples else out, "SFT examples")


def _splitter(cfg: Config):
    """split(items, what) -> (train, held out) with this config's fraction and seed; errors name the data source."""
    source = cfg.data.path or cfg.data.kind
    return lambda items, what: split_holdout(items, cfg.data.eval_fraction, cfg.run.seed, source, what)


def synthetic_split(cfg: Config, task: DefaultTask) -> tuple[list[str], list[str]]:
    return _splitter(cfg)(task.reviews(), "reviews")


def preference_pairs(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list[PreferencePair], list[PreferencePair]]:
    kind, seed, frac, split = cfg.data.kind, cfg.run.seed, cfg.data.eval_fraction, _splitter(cfg)
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
    rows, src = generic_rows(cfg)
    d = cfg.data
    if d.chosen_column and d.rejected_column:
        require_columns(rows, src, {"data.chosen_column": d.chosen_column, "data.rejected_column": d.rejected_column})
        skip = SkipCounter(src)
        pairs = [PreferencePair(str(r.get(d.prompt_column, "") if d.prompt_column else ""), str(r[d.chosen_column]),
                                str(r[d.rejected_column])) for r in rows
                 if skip.keep(str(r[d.chosen_column] or ""), str(r[d.rejected_column] or ""))]
        skip.finish(len(pairs), log)
        return split(pairs, "preference pairs")
    if d.text_column and d.label_column:
        require_columns(rows, src, {"data.text_column": d.text_column, "data.label_column": d.label_column})
        items = [(str(r[d.text_column]), sentiment_label(r[d.label_column])) for r in rows]
        items = [(t, y) for t, y in items if t.strip() and y is not None]
        train, held = split(items, "labelled rows")
        return sentiment_pairs(train, cfg.rm.num_pairs, seed), sentiment_pairs(held, max(64, int(cfg.rm.num_pairs * frac)), seed + 1)
    raise DataError(src, "no preference columns configured",
                    "set data.chosen_column and data.rejected_column, or data.text_column and data.label_column")


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


def rl_prompts(cfg: Config, task: DefaultTask | None, log=print) -> tuple[list[str], list[str]]:
    """Prompts for RL and evaluation (train, held out)."""
    kind, seed, split = cfg.data.kind, cfg.run.seed, _splitter(cfg)
    rng = random.Random(seed + 7)
    if kind == "synthetic":
        train, held = synthetic_split(cfg, task)
        return [prompt_of(r, rng, cfg.data.prompt_words) for r in train], [prompt_of(r, rng, cfg.data.prompt_words) for r in held]
    if kind == "imdb":
        texts = [t for t, _ in imdb_reviews(cfg, log)]
        return split([prompt_of(t, rng, max(cfg.data.prompt_words, 8)) for t in texts], "prompts")
    if kind == "hh_rlhf":
        return split([p.prompt for p in hh_pairs(cfg, log) if p.prompt], "prompts")
    rows, src = generic_rows(cfg)
    col = cfg.data.prompt_column or cfg.data.text_column or "prompt"
    require_columns(rows, src, {"data.prompt_column": col})
    prompts = [str(r[col]) for r in rows if str(r[col] or "").strip()]
    if not cfg.data.prompt_column:
        prompts = [prompt_of(p, rng, max(cfg.data.prompt_words, 8)) for p in prompts]
    return split(prompts, "prompts")
