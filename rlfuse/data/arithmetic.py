"""The second embedded task: small arithmetic word problems with a verifiable answer (`data.kind=arithmetic`).

Offline like the first: problems are generated from a seed, each row a TRL prompt-completion row with the
ground truth in its own column, `{"prompt", "completion", "answer"}`. SFT learns the answer format from the
completions; RL is rewarded by `exact_match` (a reward function of the TRL form, reading the `answer` column),
and the held-out reward is the exact-match accuracy.
"""

from __future__ import annotations

import random
import re

NAMES = ("Tom", "Ana", "Sam", "Mia", "Leo", "Ivy", "Max", "Zoe")
THINGS = ("apples", "books", "coins", "shells", "stamps", "pens", "cards", "eggs")
ADD = ("{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
       "{n} had {a} {t}. A friend gave {n} {b} {t}. How many {t} does {n} have?")
SUB = ("{n} has {a} {t} and gives away {b}. How many {t} are left?",
       "{n} had {a} {t} and lost {b} of them. How many {t} does {n} have now?")


def problem(rng: random.Random, max_operand: int) -> dict:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    subtract = rng.random() < 0.5
    if subtract and b > a:
        a, b = b, a
    template = rng.choice(SUB if subtract else ADD)
    answer = a - b if subtract else a + b
    prompt = "Question: " + template.format(n=rng.choice(NAMES), a=a, b=b, t=rng.choice(THINGS)) + "\nAnswer:"
    return {"prompt": prompt, "completion": f" {answer}", "answer": str(answer)}


def problems(n: int, seed: int, max_operand: int = 9) -> list[dict]:
    rng = random.Random(seed)
    return [problem(rng, max_operand) for _ in range(n)]


def wrong_completion(row: dict, rng: random.Random) -> str:
    """A near miss for preference pairs (the reward-model stage): the answer off by 1-3."""
    return f" {int(row['answer']) + rng.choice((-3, -2, -1, 1, 2, 3))}"


FIRST_NUMBER = re.compile(r"-?\d+")


def exact_match(prompts: list, completions: list, answer: list, **_) -> list[float]:
    """1.0 where the completion's first number is the answer, else 0.0 (`rlfuse.data.arithmetic:exact_match`)."""
    out = []
    for completion, truth in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        found = FIRST_NUMBER.search(text)
        out.append(float(found is not None and found.group() == str(truth).strip()))
    return out
