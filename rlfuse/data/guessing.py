"""The third embedded task, a multi-turn game without tools (`data.kind=guessing`): find a whole number from 1 to
data.max_operand; after each guess the environment says higher or lower (`GuessNumber`, a Gym-style environment:
rl.environment=rlfuse.data.guessing:GuessNumber). The reward is 1 / the number of guesses when the number is found
within rl.max_turns, else 0, so RL is paid for finding it in fewer turns.

Offline and seeded like the others: each row a chat prompt and its `target` column. The SFT demonstrations are games
played by halving the range (the guess after "higher" is the middle of what is left), whole conversations whose
every guess is an assistant turn the loss covers; some demonstrations start from a random first guess, so the
model sees ranges of every shape.
"""

from __future__ import annotations

import random
import re

RULES = ("I am thinking of a whole number from 1 to {top}. Guess it: reply with one number, and I will tell you "
         "whether mine is higher or lower.")


def prompt_of(top: int) -> list[dict]:
    return [{"role": "user", "content": RULES.format(top=top)}]


def halving_game(target: int, top: int, rng: random.Random) -> list[dict]:
    """The conversation of a game that halves the range each turn (the first guess the middle, or now and then
    random), up to the guess that finds `target`: assistant guesses and user answers, the last turn the finding
    guess."""
    low, high, turns = 1, top, []
    guess = (low + high) // 2 if rng.random() < 0.7 else rng.randint(low, high)
    while True:
        turns.append({"role": "assistant", "content": str(guess)})
        if guess == target:
            return turns
        if guess < target:
            low = guess + 1
            turns.append({"role": "user", "content": "higher"})
        else:
            high = guess - 1
            turns.append({"role": "user", "content": "lower"})
        guess = (low + high) // 2


def games(n: int, seed: int, top: int) -> list[dict]:
    """n rows {"prompt", "completion" (a demonstration game), "target"}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(1, top)
        out.append({"prompt": prompt_of(top), "completion": halving_game(target, top, rng), "target": target})
    return out


def demonstration(row: dict) -> tuple[list, list]:
    """(prompt, response) for SFT: the game up to its last guess, and that guess (completion-only SFT learns every
    assistant turn of the prompt too)."""
    return row["prompt"] + row["completion"][:-1], row["completion"][-1:]


FIRST_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """One game: `reset(target)`, then `step(reply)` answers each guess. The reward (read at the end) is 1 / guesses
    when the number was found, else 0; a reply with no number counts as a guess and is told to give one."""

    def reset(self, target, **row):
        self.target, self.guesses, self.found = int(target), 0, False

    def step(self, text: str):
        self.guesses += 1
        m = FIRST_NUMBER.search(text)
        if m is None:
            return "reply with one number", 0.0, False
        guess = int(m.group())
        if guess == self.target:
            self.found = True
            return "", 0.0, True
        return ("higher" if guess < self.target else "lower"), 0.0, False

    @property
    def reward(self) -> float:
        return 1.0 / self.guesses if self.found else 0.0
