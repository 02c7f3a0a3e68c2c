"""configs/verifiable.yaml end to end on tiny settings: SFT on the arithmetic word problems, then GRPO rewarded by
exact match against each prompt's `answer` column; the per-function reward is logged each iteration."""

import json

from conftest import TINY
from rlfuse.cli import main

SMALL = ["data.max_examples=300", "sft.steps=6", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=3",
         "rl.iterations=2", "rl.prompts_per_iter=4", "rl.k=4", "rl.mini_batch_size=16", "rl.micro_batch_size=8",
         "rl.eval_prompts=8", "rl.ckpt_every=2"]


def test_verifiable_config_runs_with_a_column_reward(tmp_path):
    run_dir = tmp_path / "run"
    tiny_model = [o for o in TINY if o.startswith("model.")]
    assert main(["run", "configs/verifiable.yaml", f"run.dir={run_dir}", *tiny_model, *SMALL, "run.quiet=true"]) == 0
    rows = [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.0 <= r["reward/fn/exact_match"] <= 1.0 for r in rows)
    assert all(abs(r["reward/fn/exact_match"] - r["reward/mean"]) < 1e-6 for r in rows)  # one function, weight 1
    result = json.loads((run_dir / "eval.json").read_text())
    assert 0.0 <= result["before"]["reward_mean"] <= 1.0 and 0.0 <= result["after"]["reward_mean"] <= 1.0
