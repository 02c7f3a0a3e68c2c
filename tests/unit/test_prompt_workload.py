"""The planner's prompts measured from a config (rlfuse/models/prompt_workload.py) against hand counts, and where
`rlfuse plan` and placement.strategy=auto take them from: measured, recorded by a run (--lengths-from), or the
planner's table when the tokenizer cannot be loaded."""

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, PreTrainedTokenizerFast

from rlfuse.config import load_config
from rlfuse.data.stages import rl_prompts
from rlfuse.models.prompt_workload import iteration_batches, mean_tokens_and_distinct, measure_prompts

WORDS = ["<bos>", "<unk>", "great", "bad", "movie", "the"]
PROMPTS = ["great", "great great", "the movie", "bad movie great", "bad", "the great movie", "movie", "great bad",
           "the bad movie great"]
"""Nine prompts: one held out (data.eval_fraction 0.1), eight to train on, one RL iteration's worth."""


def hand_count(prompt: str) -> int:
    """A word-level tokenizer: one token a word, BOS in front (data/collate.py encode)."""
    return 1 + len(prompt.split())


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """A model folder as far as the measurement reads it: a word-level tokenizer and a config.json (a 32-token
    context), no weights."""
    folder = tmp_path_factory.mktemp("word_model")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<bos>",
                            unk_token="<unk>").save_pretrained(folder)
    GPT2Config(vocab_size=len(WORDS), n_positions=32, n_embd=8, n_layer=1, n_head=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def word_config(word_model, prompt_file, *extra):
    return load_config(None, ["data.kind=jsonl", f"data.path={prompt_file}", "data.eval_fraction=0.1",
                              f"rl.sft_path={word_model}", "rl.prompts_per_iter=8", "rl.mini_batch_size=8",
                              "rl.micro_batch_size=4", "rl.iterations=2", "rl.max_new_tokens=8", *extra])


def test_measured_mean_is_a_hand_count(word_model, prompt_file):
    cfg = word_config(word_model, prompt_file)
    train, _ = rl_prompts(cfg, None, lambda m: None)
    assert len(train) == 8  # each iteration draws all eight (without replacement): a permutation of them
    counts = [hand_count(p) for p in train]
    m = measure_prompts(cfg, lambda m: None)
    assert m.tokens == pytest.approx(sum(counts) / 8)
    assert m.distinct == len(set(counts))
    assert (m.prompts, m.iterations, m.cut, m.budget) == (16, 2, 0, 32 - 8)  # budget: the context less the response
    assert m.longest == max(counts)
    assert m.planner_inputs() == {"prompt_tokens": m.tokens, "prompt_lengths": m.distinct, "prompt_longest": m.longest}
    # cut to the budget as the run cuts them (their last tokens, BOS kept in front)
    cut = measure_prompts(word_config(word_model, prompt_file, "rl.max_prompt_tokens=3"), lambda m: None)
    assert cut.tokens == pytest.approx(sum(min(c, 3) for c in counts) / 8)
    assert cut.cut == sum(c > 3 for c in counts) and cut.distinct == len({min(c, 3) for c in counts})
    assert cut.longest == 3


def test_mean_and_distinct_lengths_by_hand():
    assert mean_tokens_and_distinct([[2, 3, 3], [4, 4, 4]]) == (pytest.approx(20 / 6), 1.5)


def test_the_first_iterations_batches_up_to_a_few_hundred_prompts():
    batches = iteration_batches(100, 64, 40, seed=0)
    assert len(batches) == 4 and all(len(b) == 64 and len(set(b)) == 64 for b in batches)  # 256 prompts
    assert len(iteration_batches(100, 64, 2, seed=0)) == 2  # never more iterations than the run has
    assert [len(b) for b in iteration_batches(10, 300, 5, seed=0)] == [300]  # at least one, with replacement


def test_an_iteration_records_its_prompts_lengths():
    from rlfuse.rollout.fusion import Experience
    from rlfuse.trainers.observe import rollout_metrics

    zeros = torch.zeros(4, 3)
    exp = Experience(prompt_ids=[[0, 2], [0, 2], [0, 3, 4], [0, 3, 4]], response_ids=[[1]] * 4,
                     prompt_index=torch.tensor([0, 0, 1, 1]), scores=torch.tensor([1.0, 2.0, 3.0, 4.0]),
                     logprobs=zeros, ref_logprobs=zeros, values=None, mask=torch.ones(4, 3),
                     finish_reasons=["length"] * 4)
    m = rollout_metrics(exp, zeros, None, 0.1, 3)
    assert m["rollout/prompt_length_mean"] == 2.5 and m["rollout/prompt_lengths_distinct"] == 2


# ------------------------------------------------------------------------------------------ rlfuse plan and auto


def plan_cli(capsys, tmp_path, *args):
    from rlfuse.cli import main

    assert main(["plan", *args, "--workers", "2", "--out", str(tmp_path / "plan.yaml"), "--top", "2"]) == 0
    return capsys.readouterr()


def word_args(word_model, prompt_file, *extra):
    return ["data.kind=jsonl", f"data.path={prompt_file}", "data.eval_fraction=0.1", f"rl.sft_path={word_model}",
            "rl.prompts_per_iter=8", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.iterations=2",
            "rl.max_new_tokens=8", *extra]


def test_rlfuse_plan_plans_on_the_measured_prompts(word_model, prompt_file, tmp_path, capsys):
    expected = measure_prompts(word_config(word_model, prompt_file), lambda m: None)
    out = plan_cli(capsys, tmp_path, *word_args(word_model, prompt_file)).out
    assert (f"prompts: {expected.tokens:.1f} tokens on average (longest {expected.longest}) over 16 prompts of jsonl "
            f"(prompts.jsonl)") in out
    assert "measured with the model's tokenizer" in out
    assert (f"workload: 8 samples x {expected.tokens:.1f} prompt ({expected.distinct:.1f} distinct lengths, longest "
            f"{expected.longest})") in out


def test_rlfuse_plan_without_a_tokenizer_takes_the_table_in_one_line(word_model, prompt_file, tmp_path, capsys):
    broken = tmp_path / "broken_tokenizer"  # a model folder whose tokenizer cannot load (as a hub name offline)
    shutil.copytree(word_model, broken)
    (broken / "tokenizer.json").write_text("{ not json")
    printed = plan_cli(capsys, tmp_path, *word_args(word_model, prompt_file, f"rl.sft_path={broken}"))
    line = next(x for x in printed.out.splitlines() if x.startswith("prompts:"))
    assert line.startswith("prompts: not measured (model error: could not load") and str(broken) in line
    assert line.endswith("the planner assumes 32 tokens per prompt (its table for data.kind=jsonl) and one prompt "
                         "length per iteration")
    assert "workload: 8 samples x 32.0 prompt (1.0 distinct lengths)" in printed.out
    assert "Traceback" not in printed.err


def test_rlfuse_plan_prefers_the_prompts_a_run_recorded(word_model, prompt_file, tmp_path, capsys):
    from rlfuse.metrics.tracker import measured_prompts

    run = tmp_path / "run"
    (run / "rl").mkdir(parents=True)
    rows = [{"step": i, "rollout/length_mean": 6.0, "rollout/length_max": 8, "rollout/prompt_length_mean": p,
             "rollout/prompt_lengths_distinct": d, "rollout/prompt_length_max": m}
            for i, (p, d, m) in enumerate([(10.0, 3, 21), (14.0, 5, 18)], 1)]
    (run / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert measured_prompts(run) == (12.0, 4.0, 21)
    out = plan_cli(capsys, tmp_path, *word_args(word_model, prompt_file), "--lengths-from", str(run)).out
    assert (f"prompts: 12.0 tokens on average (longest 21), 4.0 distinct lengths per iteration, as the RL iterations "
            f"of {run}") in out
    # the longest sizes the memory model's sequences: the workload line says it
    assert "workload: 8 samples x 12.0 prompt (4.0 distinct lengths, longest 21) + 6.0 response tokens" in out
    # a run from before the longest prompt was recorded: the mean sizes memory, as before
    for r in rows:
        del r["rollout/prompt_length_max"]
    (run / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert measured_prompts(run) == (12.0, 4.0, 0)
    out = plan_cli(capsys, tmp_path, *word_args(word_model, prompt_file), "--lengths-from", str(run)).out
    assert "workload: 8 samples x 12.0 prompt (4.0 distinct lengths) + 6.0 response tokens" in out
    # a run from before the prompt metrics: its response lengths only, the prompts measured here
    (run / "rl" / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/length_mean": 6.0}) + "\n")
    assert measured_prompts(run) is None
    assert "measured with the model's tokenizer" in plan_cli(capsys, tmp_path, *word_args(word_model, prompt_file),
                                                             "--lengths-from", str(run)).out


def test_auto_placement_is_planned_on_the_measured_prompts(word_model, prompt_file):
    from rlfuse import api
    from rlfuse.models.prompt_workload import planner_prompt_inputs
    from rlfuse.plan.planner import first_fitting, plan_config

    cfg = load_config(None, word_args(word_model, prompt_file, "placement.strategy=auto", "placement.workers=2"))
    lines = []
    resolved = api.resolved(cfg, lines.append)
    assert resolved.placement.strategy != "auto"
    said = [x for x in lines if x.startswith("[plan] prompts: ")]  # after the data loader's own lines
    assert len(said) == 1 and "measured with the model's tokenizer" in said[0]
    inputs, _ = planner_prompt_inputs(cfg)
    measured, table = (first_fitting(plan_config(cfg, **kw), 2).iteration_s for kw in (inputs, {}))
    assert measured != table  # ~3 tokens a prompt against the table's 32: the numbers reached the planner
    assert f"predicted {measured:.2f} s per iteration" in lines[-1]


def test_a_run_records_its_prompts_lengths_for_the_planner():
    # what `rlfuse plan --lengths-from` reads back: the mean, the distinct lengths and the longest (memory's size)
    from rlfuse.rollout.fusion import Experience
    from rlfuse.trainers.observe import rollout_metrics

    prompts, T = [[1] * 3, [1] * 3, [1] * 7, [1] * 7], 2
    exp = Experience(prompts, [[2] * T] * 4, torch.tensor([0, 0, 1, 1]), torch.zeros(4), torch.zeros(4, T),
                     torch.zeros(4, T), None, torch.ones(4, T), ["eos"] * 4)
    m = rollout_metrics(exp, torch.zeros(4, T), None, 0.1, 8)
    assert (m["rollout/prompt_length_mean"], m["rollout/prompt_lengths_distinct"], m["rollout/prompt_length_max"]) \
        == (5.0, 2, 7)
