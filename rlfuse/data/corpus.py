"""Synthetic movie reviews from the grammar in grammar.py: deterministic per seed, balanced sentiment, and
long-tailed lengths (sentences per review are lognormal, as real review lengths roughly are)."""

from __future__ import annotations

import math
import random

from rlfuse.data import grammar as g

POSITIVE = [w for w, p in g.ADJECTIVES.items() if p > 0]
NEGATIVE = [w for w, p in g.ADJECTIVES.items() if p < 0]
POS_VERBS = [w for w, (_, p) in g.VERBS.items() if p > 0]
NEG_VERBS = [w for w, (_, p) in g.VERBS.items() if p < 0]


def _subject(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.7:
        return f"the {rng.choice(g.ASPECTS)}"
    return f"this {rng.choice(g.FILMS)}" if r < 0.9 else "it"


def _clause(rng: random.Random, sign: int) -> str:
    """A clause whose polarity has the given sign (negation picks an adjective of the other sign)."""
    negate = rng.random() < 0.15
    pool = POSITIVE if (sign > 0) != negate else NEGATIVE
    words = [_subject(rng), rng.choice(g.COPULAS)]
    if negate:
        words.append("not")
    if rng.random() < 0.35:
        words.append(rng.choice(list(g.INTENSIFIERS)))
    words.append(rng.choice(pool))
    return " ".join(words)


def _opinion(rng: random.Random, sign: int) -> str:
    if rng.random() < 0.2:  # contrast: the clause after "but" carries the review's sign
        return f"{_clause(rng, -sign)}, but {_clause(rng, sign)}"
    return _clause(rng, sign)


def _statement(rng: random.Random, sign: int) -> str:
    obj = f"the {rng.choice(g.ASPECTS)}" if rng.random() < 0.5 else f"this {rng.choice(g.FILMS)}"
    if rng.random() < 0.2:
        verb = rng.choice(NEG_VERBS if sign > 0 else POS_VERBS)
        return f"i did not {g.VERBS[verb][0]} {obj}"
    verb = rng.choice(POS_VERBS if sign > 0 else NEG_VERBS)
    adv = f"{rng.choice(list(g.INTENSIFIERS))} " if rng.random() < 0.3 else ""
    return f"i {adv}{verb} {obj}"


def _noun_phrase(rng: random.Random, nouns: list[str]) -> str:
    desc = f"{rng.choice(g.DESCRIPTORS)} " if rng.random() < 0.4 else ""
    return f"the {desc}{rng.choice(nouns)}"


def _plot(rng: random.Random) -> str:
    if rng.random() < 0.1:
        place = rng.choice(g.PLACES)
        return f"the story takes place in the {place}" if rng.random() < 0.5 else f"it is set in the {place}"
    adv = f"{rng.choice(g.ADVERBS)}, " if rng.random() < 0.25 else ""
    obj_pool = g.THINGS if rng.random() < 0.7 else g.CHARACTERS
    s = f"{adv}{_noun_phrase(rng, g.CHARACTERS)} {rng.choice(g.ACTIONS)} {_noun_phrase(rng, obj_pool)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(g.PREPOSITIONS)} {_noun_phrase(rng, g.PLACES)}"
    return s


def generate_review(rng: random.Random, sign: int) -> str:
    """One review: lognormal number of sentences, mostly plot and opinions, whose overall sentiment has `sign`."""
    n = min(40, max(1, round(math.exp(rng.gauss(math.log(2.6), 0.85)))))
    out = []
    for i in range(n):
        r = rng.random()
        # opinions agree with the review's sign most of the time; the rest is plot and a few dissenting remarks
        s = sign if rng.random() < 0.8 else -sign
        if i == 0 and r < 0.5 or i > 0 and r < 0.45:
            out.append(_plot(rng))
        elif r < 0.85:
            out.append(_opinion(rng, s))
        else:
            out.append(_statement(rng, s))
    if all(_is_plot(s) for s in out):  # every review says something about the film
        out.append(_opinion(rng, sign))
    return " ".join(f"{s}." for s in out)


def _is_plot(sentence: str) -> bool:
    return not any(w in g.ADJECTIVES or w in g.VERBS or w in g.BASE_VERBS for w in sentence.replace(",", " ").split())


def generate_corpus(n: int, seed: int) -> list[str]:
    """`n` reviews, half meant positive and half negative, interleaved; deterministic for a seed."""
    rng = random.Random(seed)
    return [generate_review(rng, 1 if i % 2 == 0 else -1) for i in range(n)]


def prompt_of(review: str, rng: random.Random, max_words: int) -> str:
    """The first 2..max_words words of a review: the RL/eval prompt (rarely decides the sentiment by itself)."""
    words = review.split()
    return " ".join(words[: rng.randint(2, max_words)]).rstrip(",.")
