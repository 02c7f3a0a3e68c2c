"""The second embedded task: small arithmetic word problems with a verifiable answer (`data.kind=arithmetic`): at
data.arithmetic_steps=1 sums of two small numbers and the larger or smaller of two numbers (a tiny model learns
them); at 2 a number changed twice (gets some, then gives some away, or the other way round), which a 135M-parameter
pretrained model answers only now and then after learning the format, so RL has room to teach it.

Offline like the first: problems are generated from a seed, each row a TRL prompt-completion row with the
ground truth in its own column, `{"prompt", "completion", "answer"}`. SFT learns the answer format from the
completions; RL is rewarded by `exact_match` (a reward function of the TRL form, reading the `answer` column),
and the held-out reward is the exact-match accuracy.

With data.arithmetic_format=calculator the problems are sums, differences and products of numbers too large to
work out in the head, asked in a chat; the SFT demonstrations call the `calculator` tool, read its result and state
the answer, so RL (with rl.tools=rlfuse.data.arithmetic:calculator) trains a multi-turn episode (docs/episodes.md).
data.arithmetic_format=chat asks the same problems with direct answers: the same pipeline with tools off.

With data.arithmetic_working=true the completions show their working before the answer (" 12 + 5 = 17, and 17 - 3 =
14. The answer is 14.", about 25 tokens instead of 2): a task whose samples take many decode steps, where the answer
depends on the steps the model writes, and `exact_match` reads the number after "The answer is".
"""

from __future__ import annotations

import ast
import operator
import random
import re

from rlfuse.data.tool_text import tool_call_text, tool_schema, tools_prompt

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


def row(question: str, answer: int, working: str | None) -> dict:
    """A prompt-completion row; with `working`, the completion is the working then "The answer is N."."""
    completion = f" {answer}" if working is None else f" {working} The answer is {answer}."
    return {"prompt": f"Question: {question}\nAnswer:", "completion": completion, "answer": str(answer)}


def problem(rng: random.Random, max_operand: int, working: bool = False) -> dict:
    """One of three kinds, equally often: a sum of two small numbers (up to max_operand // 2 each, so a small model
    can learn it), or the larger or the smaller of two different numbers up to max_operand."""
    kind = rng.choice(("add", "more", "fewer"))
    n, m = rng.sample(NAMES, 2)
    if kind == "add":
        a, b = rng.randint(1, max_operand // 2), rng.randint(1, max_operand // 2)
        question, answer = rng.choice(ADD).format(n=n, a=a, b=b, t=rng.choice(THINGS)), a + b
        shown = f"{a} + {b} = {a + b}."
    else:
        a, b = rng.sample(range(1, max_operand + 1), 2)
        template, pick = (MORE, max) if kind == "more" else (FEWER, min)
        question, answer = template.format(n=n, m=m, a=a, b=b, t=rng.choice(THINGS)), pick(a, b)
        shown = f"{max(a, b)} is more than {min(a, b)}."
    return row(question, answer, shown if working else None)


def two_step_problem(rng: random.Random, max_operand: int, working: bool = False) -> dict:
    """A number changed twice, each operand up to max_operand: a + b - c (c below a + b), or a - c + b (c below a)."""
    n, m = rng.sample(NAMES, 2)
    t = rng.choice(THINGS)
    a, b = rng.randint(2, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        c = rng.randint(1, min(max_operand, a + b - 1))
        question, answer = rng.choice(GET_THEN_GIVE).format(n=n, m=m, a=a, b=b, c=c, t=t), a + b - c
        shown = f"{a} + {b} = {a + b}, and {a + b} - {c} = {answer}."
    else:
        c = rng.randint(1, a - 1)
        question, answer = rng.choice(GIVE_THEN_GET).format(n=n, m=m, a=a, b=b, c=c, t=t), a - c + b
        shown = f"{a} - {c} = {a - c}, and {a - c} + {b} = {answer}."
    return row(question, answer, shown if working else None)


def problems(n: int, seed: int, max_operand: int = 9, steps: int = 1, working: bool = False) -> list[dict]:
    """n problems of `steps` operations (data.arithmetic_steps: 1 or 2) on numbers up to max_operand; `working`
    (data.arithmetic_working): completions show the working (the same problems for a seed either way)."""
    rng = random.Random(seed)
    make = problem if steps == 1 else two_step_problem
    return [make(rng, max_operand, working) for _ in range(n)]


SUM = ("{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
       "A shop had {a} {t} and bought {b} more. How many {t} does it have?")
DIFFERENCE = ("{n} had {a} {t} and gave {b} of them to {m}. How many {t} does {n} have left?",
              "A shop had {a} {t} and sold {b}. How many {t} are left?")
PRODUCT = ("A box holds {b} {t}. How many {t} are in {a} boxes?",
           "{n} buys {a} packs of {b} {t}. How many {t} is that?")


def tool_problem(rng: random.Random, max_operand: int) -> dict:
    """A sum, a difference or a product, equally often, of numbers up to max_operand (products: the second up to
    99): {"question", "expression", "answer"}."""
    kind = rng.choice(("sum", "difference", "product"))
    n, m = rng.sample(NAMES, 2)
    t = rng.choice(THINGS)
    if kind == "product":
        a, b = rng.randint(11, max_operand), rng.randint(11, 99)
        return {"question": rng.choice(PRODUCT).format(n=n, a=a, b=b, t=t), "expression": f"{a} * {b}",
                "answer": str(a * b)}
    a, b = rng.randint(max_operand // 10, max_operand), rng.randint(max_operand // 10, max_operand)
    if kind == "difference":
        a, b = max(a, b), min(a, b)
        return {"question": rng.choice(DIFFERENCE).format(n=n, m=m, a=a, b=b, t=t), "expression": f"{a} - {b}",
                "answer": str(a - b)}
    return {"question": rng.choice(SUM).format(n=n, a=a, b=b, t=t), "expression": f"{a} + {b}",
            "answer": str(a + b)}


def chat_rows(n: int, seed: int, max_operand: int, tools: bool) -> list[dict]:
    """Chat rows of tool_problem: {"prompt": [user turn], "completion": [assistant turns], "answer"}, the completion
    with tools a calculator call, its result and the answer (the call and the result are the prompt's continuation
    an episode samples and is answered with), without them the answer alone."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        p = tool_problem(rng, max_operand)
        answer = {"role": "assistant", "content": f"The answer is {p['answer']}."}
        calls = [{"role": "assistant", "content": tool_call_text("calculator", {"expression": p["expression"]})},
                 {"role": "tool", "content": calculator(p["expression"])}] if tools else []
        out.append({"prompt": [{"role": "user", "content": p["question"]}], "completion": calls + [answer],
                    "answer": p["answer"]})
    return out


def demonstration(row: dict, tools: bool) -> tuple[list, list]:
    """An SFT example (prompt messages, response messages) of a chat row: with tools the prompt carries the tools'
    system turn and the call with its result, so that completion-only SFT learns both assistant turns and never the
    tool's; the response is the final answer."""
    if not tools:
        return row["prompt"], row["completion"]
    prompt = tools_prompt(row["prompt"], [tool_schema(calculator)])
    return prompt + row["completion"][:-1], row["completion"][-1:]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if abs(left) > 1e15 or abs(right) > 1e15:
            raise ValueError("numbers too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers with + - * / and parentheses.

    Args:
        expression: the expression, e.g. "4821 + 3977".
    """
    value = _value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def wrong_completion(row: dict, rng: random.Random) -> str:
    """A near miss for preference pairs (the reward-model stage): the answer off by 1-3 (a chat row's last turn with
    it)."""
    wrong = int(row["answer"]) + rng.choice((-3, -2, -1, 1, 2, 3))
    if isinstance(row["completion"], list):
        return row["completion"][:-1] + [{"role": "assistant", "content": f"The answer is {wrong}."}]
    return f" {wrong}"


FIRST_NUMBER = re.compile(r"-?\d+")
STATED_ANSWER = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


def exact_match(prompts: list, completions: list, answer: list, **_) -> list[float]:
    """1.0 where the completion's answer is the truth, else 0.0 (`rlfuse.data.arithmetic:exact_match`): the number
    after the first "the answer is" where the completion says it (completions with working), else its first number."""
    out = []
    for completion, truth in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        stated = STATED_ANSWER.search(text)
        found = stated.group(1) if stated else (m.group() if (m := FIRST_NUMBER.search(text)) else None)
        out.append(float(found == str(truth).strip()))
    return out
