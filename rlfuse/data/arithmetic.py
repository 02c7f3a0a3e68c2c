"""The second embedded task: small arithmetic word problems with a verifiable answer (`data.kind=arithmetic`): at
data.arithmetic_steps=1 sums of two small numbers and the larger or smaller of two numbers (a tiny model learns
them); at 2 a number changed twice (gets some, then gives some away, or the other way round), which a 135M-parameter
pretrained model answers only now and then after learning the format, so RL has room to teach it.

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
MORE = "{n} has {a} {t} and {m} has {b} {t}. How many {t} does the one with more have?"
FEWER = "{n} has {a} {t} and {m} has {b} {t}. How many {t} does the one with fewer have?"
GET_THEN_GIVE = ("{n} has {a} {t}, gets {b} more and then gives {c} to {m}. How many {t} does {n} have now?",
                 "{n} had {a} {t}. {m} gave {n} {b} {t}, and then {n} lost {c}. How many {t} does {n} have now?")
GIVE_THEN_GET = ("{n} has {a} {t}, gives {c} to {m} and then gets {b} more. How many {t} does {n} have now?",
                 "{n} had {a} {t}, sold {c} of them and then found {b} more. How many {t} does {n} have now?")


def problem(rng: random.Random, max_operand: int) -> dict:
    """One of three kinds, equally often: a sum of two small numbers (up to max_operand // 2 each, so a small model
    can learn it), or the larger or the smaller of two different numbers up to max_operand."""
    kind = rng.choice(("add", "more", "fewer"))
    n, m = rng.sample(NAMES, 2)
    if kind == "add":
        a, b = rng.randint(1, max_operand // 2), rng.randint(1, max_operand // 2)
        question, answer = rng.choice(ADD).format(n=n, a=a, b=b, t=rng.choice(THINGS)), a + b
    else:
        a, b = rng.sample(range(1, max_operand + 1), 2)
        template, pick = (MORE, max) if kind == "more" else (FEWER, min)
        question, answer = template.format(n=n, m=m, a=a, b=b, t=rng.choice(THINGS)), pick(a, b)
    return {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}", "answer": str(answer)}


def two_step_problem(rng: random.Random, max_operand: int) -> dict:
    """A number changed twice, each operand up to max_operand: a + b - c (c below a + b), or a - c + b (c below a)."""
    n, m = rng.sample(NAMES, 2)
    t = rng.choice(THINGS)
    a, b = rng.randint(2, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        c = rng.randint(1, min(max_operand, a + b - 1))
        question, answer = rng.choice(GET_THEN_GIVE).format(n=n, m=m, a=a, b=b, c=c, t=t), a + b - c
    else:
        c = rng.randint(1, a - 1)
        question, answer = rng.choice(GIVE_THEN_GET).format(n=n, m=m, a=a, b=b, c=c, t=t), a - c + b
    return {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}", "answer": str(answer)}


def problems(n: int, seed: int, max_operand: int = 9, steps: int = 1) -> list[dict]:
    """n problems of `steps` operations (data.arithmetic_steps: 1 or 2) on numbers up to max_operand."""
    rng = random.Random(seed)
    make = problem if steps == 1 else two_step_problem
    return [make(rng, max_operand) for _ in range(n)]


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
