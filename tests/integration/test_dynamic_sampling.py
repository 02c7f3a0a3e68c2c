"""DAPO's dynamic sampling (rl.dynamic_sampling) through the CLI on the tiny default task: a reward that ties often
makes the iteration draw more prompt groups, the batch keeps rl.prompts_per_iter groups, and two runs with the same
seed give the same refills, rewards and weights."""

import json

import torch
from safetensors.torch import load_file

from conftest import TINY
from rlfuse.cli import main

TIES = '''
def has_the(completions, **columns):
    return [float(" the " in f" {c} ") for c in completions]
'''


def test_dynamic_sampling_refills_the_same_way_twice(tiny_task, tmp_path):
    (tmp_path / "ties.py").write_text(TIES)
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", f"rl.reward={tmp_path / 'ties.py'}:has_the",
                     "rl.algo=grpo", "rl.k=2", "rl.recipe=dapo", "rl.max_refills=3", "rl.iterations=3",
                     "rl.prompts_per_iter=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.max_new_tokens=6",
                     "rl.eval_prompts=0", f"run.dir={run_dir}", "run.threads=1", *TINY]) == 0
        rows = [json.loads(l) for l in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
        runs.append((rows, load_file(str(run_dir / "rl" / "model" / "model.safetensors"))))
    (rows, weights), (rows_b, weights_b) = runs
    assert any(r["rollout/refills"] > 0 for r in rows), [r["rollout/refills"] for r in rows]
    assert all(r["rollout/samples"] == 8 for r in rows)  # 4 groups of 2, whatever was drawn
    keys = ("rollout/refills", "rollout/spread_groups", "reward/mean")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in rows_b]
    assert all(torch.equal(weights[n], weights_b[n]) for n in weights)


def test_dynamic_sampling_refills_with_a_transient_decode_copy(tiny_task, tmp_path):
    """A bf16 generator copy of a full fine-tuned actor lives only while decoding (it is released after a rollout,
    for the update's peak): the further draws of dynamic sampling decode with it too."""
    (tmp_path / "ties.py").write_text(TIES)
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", f"rl.reward={tmp_path / 'ties.py'}:has_the",
                 "rl.algo=grpo", "rl.k=2", "rl.recipe=dapo", "rl.max_refills=3", "rl.iterations=2",
                 "rl.prompts_per_iter=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.max_new_tokens=6",
                 "rl.eval_prompts=2", "rollout.generator_dtype=bf16", f"run.dir={tmp_path / 'r'}", "run.threads=1",
                 *TINY]) == 0
    rows = [json.loads(l) for l in (tmp_path / "r" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["rollout/refills"] > 0 for r in rows), [r["rollout/refills"] for r in rows]
