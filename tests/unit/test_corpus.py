import random

import numpy as np

from rlfuse.data.corpus import generate_corpus, prompt_of
from rlfuse.data.gold import gold_score
from rlfuse.data.grammar import vocabulary


def test_deterministic_per_seed():
    assert generate_corpus(50, seed=3) == generate_corpus(50, seed=3)
    assert generate_corpus(50, seed=3) != generate_corpus(50, seed=4)


def test_grammar_accepts_everything_it_generates_and_is_balanced():
    reviews = generate_corpus(600, seed=0)
    scores = [gold_score(r) for r in reviews]
    assert all(s.grammatical_rate == 1.0 for s in scores)
    pos = np.mean([s.label == "positive" for s in scores])
    assert 0.4 < pos < 0.6
    # the intended sign of each review (alternating) agrees with the gold scorer most of the time
    agree = np.mean([(s.score > 0) == (i % 2 == 0) for i, s in enumerate(scores)])
    assert agree > 0.75


def test_a_few_hundred_words():
    assert 250 <= len(vocabulary()) <= 600
    used = {w.strip(".,") for r in generate_corpus(2000, 0) for w in r.split()}
    assert len(used) >= 250


def test_lengths_are_long_tailed(tiny_task):
    stats = tiny_task.stats()
    assert stats["tokens_p95"] >= 3 * stats["tokens_p50"], stats


def test_prompts_are_review_prefixes():
    rng = random.Random(0)
    review = "the old detective finds the letter. the acting was good."
    p = prompt_of(review, rng, 4)
    assert review.startswith(p) and 2 <= len(p.split()) <= 4
