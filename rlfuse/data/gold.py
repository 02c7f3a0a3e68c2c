"""Gold sentiment scorer and grammaticality check for the embedded task: the ground truth the reward model only
approximates, so that RL can be judged on real improvement rather than on fooling the reward model.

`gold_score(text)` is defined for any text: sentences the grammar accepts are scored structurally (intensifiers
scale, negation flips and damps, the clause after "but" dominates); sentences it rejects fall back to a lexicon
scan, so degenerate text ("great great great") still scores, and `grammatical_rate` exposes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rlfuse.data import grammar as g

_SENTENCE_SPLIT = re.compile(r"[.!?]+")
_TOKEN = re.compile(r"[a-z']+|,")


@dataclass(frozen=True)
class GoldScore:
    score: float
    """tanh of the summed sentence polarities, in [-1, 1]."""
    label: str
    """positive | negative | neutral."""
    grammatical_rate: float
    """Fraction of sentences the grammar accepts (1.0 for empty text with no sentences)."""


def sentences(text: str) -> list[list[str]]:
    """Lower-cased tokens per sentence; empty sentences dropped."""
    out = []
    for chunk in _SENTENCE_SPLIT.split(text.lower()):
        toks = _TOKEN.findall(chunk)
        if toks:
            out.append(toks)
    return out


def _clause(t: list[str], i: int):
    """SUBJECT (was|is) [not] [INTENSIFIER] ADJECTIVE -> (polarity, next index) or None."""
    if i + 1 < len(t) and t[i] == "the" and t[i + 1] in g.ASPECT_SET:
        i += 2
    elif i + 1 < len(t) and t[i] == "this" and t[i + 1] in g.FILM_SET:
        i += 2
    elif i < len(t) and t[i] == "it":
        i += 1
    else:
        return None
    if i >= len(t) or t[i] not in g.COPULAS:
        return None
    i += 1
    factor = 1.0
    if i < len(t) and t[i] == "not":
        factor *= g.NEGATION_FACTOR
        i += 1
    if i < len(t) and t[i] in g.INTENSIFIERS:
        factor *= g.INTENSIFIERS[t[i]]
        i += 1
    if i < len(t) and t[i] in g.ADJECTIVES:
        return factor * g.ADJECTIVES[t[i]], i + 1
    return None


def _opinion(t: list[str]):
    first = _clause(t, 0)
    if first is None:
        return None
    pol, i = first
    if i == len(t):
        return pol
    if t[i] == ",":
        i += 1
    if i < len(t) and t[i] == "but":
        second = _clause(t, i + 1)
        if second is not None and second[1] == len(t):
            return g.BUT_WEIGHTS[0] * pol + g.BUT_WEIGHTS[1] * second[0]
    return None


def _statement(t: list[str]):
    """i [did not | INTENSIFIER] VERB (the ASPECT | this FILM)."""
    if not t or t[0] != "i":
        return None
    i, factor = 1, 1.0
    if t[i:i + 2] == ["did", "not"]:
        if i + 2 >= len(t) or t[i + 2] not in g.BASE_VERBS:
            return None
        factor, pol, i = g.NEGATION_FACTOR, g.BASE_VERBS[t[i + 2]], i + 3
    else:
        if i < len(t) and t[i] in g.INTENSIFIERS:
            factor, i = g.INTENSIFIERS[t[i]], i + 1
        if i >= len(t) or t[i] not in g.VERBS:
            return None
        pol, i = g.VERBS[t[i]][1], i + 1
    if t[i:] and len(t) == i + 2 and ((t[i] == "the" and t[i + 1] in g.ASPECT_SET) or (t[i] == "this" and t[i + 1] in g.FILM_SET)):
        return factor * pol
    return None


def _noun_phrase(t: list[str], i: int, nouns: set[str]):
    if i >= len(t) or t[i] != "the":
        return None
    i += 1
    if i < len(t) and t[i] in g.DESCRIPTOR_SET:
        i += 1
    return i + 1 if i < len(t) and t[i] in nouns else None


def _plot(t: list[str]):
    """[ADVERB ,] the [DESC] CHARACTER ACTION the [DESC] (THING|CHARACTER) [PREP the PLACE]; neutral."""
    i = 0
    if t and t[0] in g.ADVERBS:
        i = 2 if len(t) > 1 and t[1] == "," else 1
    i = _noun_phrase(t, i, g.CHARACTER_SET)
    if i is None or i >= len(t) or t[i] not in g.ACTION_SET:
        return None
    i = _noun_phrase(t, i + 1, g.THING_SET | g.CHARACTER_SET)
    if i is None:
        return None
    if i == len(t):
        return 0.0
    if t[i] in g.PREPOSITIONS and _noun_phrase(t, i + 1, g.PLACE_SET) == len(t):
        return 0.0
    return None


def _setting(t: list[str]):
    if t[:5] == ["the", "story", "takes", "place", "in"] and len(t) == 7 and t[5] == "the" and t[6] in g.PLACE_SET:
        return 0.0
    if t[:4] == ["it", "is", "set", "in"] and len(t) == 6 and t[4] == "the" and t[5] in g.PLACE_SET:
        return 0.0
    return None


def parse_sentence(tokens: list[str]) -> float | None:
    """Polarity of a sentence the grammar accepts, else None."""
    for form in (_opinion, _statement, _plot, _setting):
        pol = form(tokens)
        if pol is not None:
            return pol
    return None


def lexicon_polarity(tokens: list[str]) -> float:
    """Fallback for sentences outside the grammar: each polar word, scaled by an intensifier and flipped by a
    'not' in the two words before it."""
    total = 0.0
    for i, w in enumerate(tokens):
        pol = g.ADJECTIVES.get(w, g.VERBS.get(w, (None, g.BASE_VERBS.get(w, 0.0)))[1])
        if not pol:
            continue
        window = tokens[max(0, i - 2):i]
        for prev in window:
            if prev in g.INTENSIFIERS:
                pol *= g.INTENSIFIERS[prev]
        if "not" in window:
            pol *= g.NEGATION_FACTOR
        total += pol
    return total


def gold_score(text: str) -> GoldScore:
    """Deterministic sentiment of any text, in [-1, 1], with label and grammatical rate."""
    sents = sentences(text)
    total, accepted = 0.0, 0
    for toks in sents:
        pol = parse_sentence(toks)
        if pol is None:
            pol = lexicon_polarity(toks)
        else:
            accepted += 1
        total += pol
    score = math.tanh(total)
    label = "positive" if score > 1e-9 else "negative" if score < -1e-9 else "neutral"
    rate = accepted / len(sents) if sents else 0.0  # no complete sentence: nothing the grammar accepts
    return GoldScore(score=score, label=label, grammatical_rate=rate)


def grammatical_rate(text: str) -> float:
    """Fraction of the text's sentences the grammar accepts."""
    return gold_score(text).grammatical_rate


def complete_sentences(text: str) -> str:
    """Text up to its last sentence end: a sample cut by the length limit ends mid-sentence, which says nothing
    about grammar."""
    end = max(text.rfind(c) for c in ".!?")
    return text[: end + 1] if end >= 0 else ""


def gold_summary(texts: list[str], finished: list[bool]) -> dict:
    """Gold positive rate, mean score and grammatical rate of samples (prompt + response texts); a sample that hit
    the length limit (finished=False) is judged for grammar on its complete sentences only."""
    scores = [gold_score(t) for t in texts]
    judged = [t if done else complete_sentences(t) for t, done in zip(texts, finished)]
    n = max(1, len(texts))
    return {"gold_positive_rate": sum(g.label == "positive" for g in scores) / n,
            "gold_mean": sum(g.score for g in scores) / n,
            "grammatical_rate": sum(gold_score(t).grammatical_rate for t in judged) / n}


def gold_reward(texts: list[str], **_) -> list[float]:
    """Reward function form (`rlfuse.data.gold:gold_reward`): one gold score per text."""
    return [gold_score(t).score for t in texts]
