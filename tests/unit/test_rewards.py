"""Reward functions as users write them: f(prompts, completions, **columns) with None abstaining, several weighted,
per-function metrics; the older f(texts) form; the embedded arithmetic task's exact-match reward."""

import json
import re
from dataclasses import dataclass

import pytest

from rlfuse.config import load_config
from rlfuse.data.arithmetic import exact_match, problems
from rlfuse.data.stages import rl_prompt_rows
from rlfuse.errors import ConfigError, UserError
from rlfuse.models.rewards import FunctionReward, attach_rows, metrics_of_sums, reward_metrics, weighted_sum


class WordTokenizer:
    """Ids are word indices: enough to decode prompts and responses the way the reward sees them."""
    words = ["<eos>", "What", "is", "2+2?", "3+4?", "4", "7", "five", "Hi"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i == 0))


@dataclass
class FakeSample:
    prompt_ids: list
    token_ids: list


@dataclass
class Row:
    prompt: object
    columns: dict


Q1, Q2 = [1, 2, 3], [1, 2, 4]


def correct(prompts, completions, answer):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def is_number(prompts, completions, **_):
    return [None if c.strip() == "Hi" else float(bool(re.fullmatch(r"\s*\d+", c))) for c in completions]


def test_weighted_sum_leaves_abstentions_out():
    assert weighted_sum([[1.0, None, None], [0.5, 1.0, None]], [2.0, -1.0]) == [1.5, -1.0, 0.0]


def test_functions_get_prompts_completions_and_columns_by_name():
    reward = FunctionReward([correct, is_number], [1.0, 0.5], WordTokenizer())
    attach_rows(reward, [Q1, Q2], [Row("What is 2+2?", {"answer": "4"}), Row("What is 3+4?", {"answer": "7"})])
    samples = [FakeSample(Q1, [5, 0]), FakeSample(Q2, [5, 0]), FakeSample(Q2, [7, 0]), FakeSample(Q1, [8, 0])]
    # correct: 1, 0, 0, 0; is_number: 1, 1, 0, None (abstains on "Hi")
    assert reward(samples).tolist() == [1.5, 0.5, 0.0, 0.0]
    assert reward_metrics(reward) == {"reward/fn/correct": 0.25, "reward/fn/is_number": 2 / 3, "reward/all_abstained": 0.0,
                                      "reward/beyond_bound": 0}
    assert reward_metrics(reward) == {}  # read once


def test_rows_sharing_a_prompt_text_with_other_columns_are_counted():
    reward = FunctionReward([correct], None, WordTokenizer())
    same = [Row("What is it?", {"answer": "4"}), Row("What is it?", {"answer": "7"}),
            Row("What is 3+4?", {"answer": "7"})]
    assert attach_rows(reward, [Q1, Q1, Q2], same) == 2
    assert attach_rows(reward, [Q1, Q1, Q2], [same[0], same[0], same[2]]) == 0  # duplicates, same columns: harmless


def test_tallies_of_several_scoring_workers_pool_into_one_process_means():
    # the samples above split over two Ray scoring workers: the pooled means are the one process's, not the mean of
    # each worker's means (is_number: 2/2 on the first, 0/1 on the second -> 2/3, not 1/2)
    rows = [Row("What is 2+2?", {"answer": "4"}), Row("What is 3+4?", {"answer": "7"})]
    workers = [FunctionReward([correct, is_number], [1.0, 0.5], WordTokenizer()) for _ in range(2)]
    for w in workers:
        attach_rows(w, [Q1, Q2], rows)
    workers[0]([FakeSample(Q1, [5, 0]), FakeSample(Q2, [5, 0])])
    workers[1]([FakeSample(Q2, [7, 0]), FakeSample(Q1, [8, 0])])
    pooled = metrics_of_sums([w.take_sums() for w in workers] + [None])  # None: a worker scoring with a model
    assert pooled == {"reward/fn/correct": 0.25, "reward/fn/is_number": 2 / 3, "reward/all_abstained": 0.0,
                      "reward/beyond_bound": 0}
    assert metrics_of_sums([w.take_sums() for w in workers]) == {}  # taken once


def test_the_older_form_gets_prompt_and_response_texts():
    seen = []
    reward = FunctionReward([lambda texts: seen.extend(texts) or [len(t) for t in texts]], None, WordTokenizer())
    assert reward([FakeSample(Q1, [5, 0])]).tolist() == [len("What is 2+2? 4")]
    assert seen == ["What is 2+2? 4"]


def test_conversational_prompts_get_message_completions():
    got = {}

    def record(prompts, completions):
        got.update(prompts=prompts, completions=completions)
        return [1.0] * len(prompts)

    reward = FunctionReward([record], None, WordTokenizer())
    messages = [{"role": "user", "content": "What is 2+2?"}]
    attach_rows(reward, [Q1], [Row(messages, {})])
    reward([FakeSample(Q1, [5])])
    assert got == {"prompts": [messages], "completions": [[{"role": "assistant", "content": "4"}]]}


def test_a_missing_column_or_wrong_count_says_what_to_do():
    reward = FunctionReward([correct], None, WordTokenizer())
    attach_rows(reward, [Q1], [Row("What is 2+2?", {"solution": "4"})])
    with pytest.raises(UserError, match=r"takes column\(s\) answer but the prompts' rows have solution"):
        reward([FakeSample(Q1, [5])])
    short = FunctionReward([lambda prompts, completions: [1.0]], None, WordTokenizer())
    with pytest.raises(UserError, match="returned 1 values for 2 completions"):
        short([FakeSample(Q1, [5]), FakeSample(Q2, [6])])


def test_reward_weights_are_checked_against_the_functions():
    two = "rl.reward=rlfuse.data.gold:gold_reward,rlfuse.data.arithmetic:exact_match"
    with pytest.raises(ConfigError, match="rl.reward_weights: 1 weights for 2 reward function"):
        load_config(None, [two, "rl.reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match="rl.reward: 'nocolon' is not module:function or path/to/file.py:function"):
        load_config(None, ["rl.reward=rlfuse.data.gold:gold_reward,nocolon"])
    assert load_config(None, [two, "rl.reward_weights=[1, 0.5]"]).rl.reward_weights == [1.0, 0.5]


def test_arithmetic_problems_and_exact_match():
    rows = problems(50, seed=3)
    assert rows == problems(50, seed=3)
    for r in rows:
        a, b = map(int, re.findall(r"\d+", r["prompt"])[:2])
        assert int(r["answer"]) == (a + b if "more." in r["prompt"] or "gave" in r["prompt"] else
                                    max(a, b) if "with more" in r["prompt"] else min(a, b))
        assert r["completion"] == f" {r['answer']}"
    assert exact_match(["q"] * 4, [" 12", "12 apples", " 13", "none"], ["12", "12", "12", "12"]) == [1.0, 1.0, 0.0, 0.0]


def test_arithmetic_working_completions_by_hand():
    """data.arithmetic_working: the same problems, each completion its working then the stated answer, which
    exact_match reads (not the working's first number)."""
    for steps in (1, 2):
        plain, worked = problems(100, seed=7, max_operand=20, steps=steps), problems(100, 7, 20, steps, working=True)
        assert [(r["prompt"], r["answer"]) for r in plain] == [(r["prompt"], r["answer"]) for r in worked]
        for r in worked:
            assert r["completion"].endswith(f" The answer is {r['answer']}.")
            for a, op, b, c in re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", r["completion"]):
                assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert exact_match([r["prompt"] for r in worked], [r["completion"] for r in worked],
                           [r["answer"] for r in worked]) == [1.0] * 100
    row = problems(1, seed=1, max_operand=20, steps=2, working=True)[0]
    assert row["completion"] == " 10 + 4 = 14, and 14 - 8 = 6. The answer is 6."
    assert exact_match(["q"] * 4, [" 10 + 4 = 14, and 14 - 8 = 6. The answer is 7.", " 6 apples. the Answer is 6",
                                   " 10 + 4 = 14. The answer is", " 6, so the answer is 6 or 7"], ["6"] * 4) == \
        [0.0, 1.0, 0.0, 1.0]
    assert load_config(None, ["data.kind=arithmetic", "data.arithmetic_working=true"]).data.arithmetic_working


def test_two_step_arithmetic_problems_by_hand():
    """data.arithmetic_steps=2: a number changed twice, in the order the question tells it, never below zero."""
    rows = problems(200, seed=5, max_operand=30, steps=2)
    assert rows == problems(200, seed=5, max_operand=30, steps=2)
    for r in rows:
        a, x, y = map(int, re.findall(r"\d+", r["prompt"])[:3])
        gets_first = "more and then" in r["prompt"] or "gave" in r["prompt"]
        assert int(r["answer"]) == (a + x - y if gets_first else a - x + y) >= 0, r["prompt"]
        assert max(a, x, y) <= 30
    assert {("more and then" in r["prompt"] or "gave" in r["prompt"]) for r in rows} == {True, False}
    assert load_config(None, ["data.kind=arithmetic", "data.arithmetic_steps=2"]).data.arithmetic_steps == 2
    with pytest.raises(ConfigError, match="data.arithmetic_steps: 3 is not one of 1, 2"):
        load_config(None, ["data.kind=arithmetic", "data.arithmetic_steps=3"])


def test_prompt_rows_carry_the_other_columns(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i), "level": i % 3}) + "\n"
                            for i in range(10)))
    cfg = load_config(None, ["data.kind=jsonl", f"data.path={path}", "data.prompt_column=question"])
    train, held = rl_prompt_rows(cfg, None, log=lambda *_: None)
    for row in train + held:
        i = int(re.findall(r"\d+", row.prompt)[0])
        assert row.columns == {"answer": str(2 * i), "level": i % 3}


def test_a_ray_scoring_worker_reads_the_columns_the_driver_sends(tiny_task):
    """Placement workers build their reward from folders and names; the prompts' rows travel in RolloutSettings."""
    from rlfuse.models.load import load_tokenizer

    pytest.importorskip("ray", reason="ray is not installed: the runtime's Ray modules import it")
    from rlfuse.runtime.ray_rollout import GenerationWorker, RolloutSettings, WorkerModels

    base = str(tiny_task.model_dir)
    tok = load_tokenizer(base)
    q1, q2 = tok("two and two").input_ids, tok("three and four").input_ids
    rows = {tuple(q1): ("two and two", {"answer": "4"}), tuple(q2): ("three and four", {"answer": "7"})}
    models = WorkerModels(generator=None, reference=base, reward="function:rlfuse.data.arithmetic:exact_match")
    worker = GenerationWorker(models, RolloutSettings(reward_rows=rows))  # in this process: Ray is not needed here
    samples = [FakeSample(q1, tok(" 4").input_ids), FakeSample(q2, tok(" 4").input_ids)]
    assert worker.scorer.reward_fn(samples).tolist() == [1.0, 0.0]
    bare = GenerationWorker(models, RolloutSettings())  # without the rows the column is missing: one line
    with pytest.raises(UserError, match="takes column"):
        bare.scorer.reward_fn(samples)
