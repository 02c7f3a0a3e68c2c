"""Multi-turn episodes end to end on the tiny default task through the CLI: ppo and grpo train on episodes of an
environment (metrics say how many turns, tokens sampled and appended), and a run killed with SIGKILL mid-episode
resumes and ends with the uninterrupted run's weights."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY
from rlfuse.cli import main
from test_run_folders import one_line_error, rlfuse_here

GAME = '''
import time


class Echo:
    """Three turns whatever the model says, each answered after a short wait; rewarded for replies near 12 characters
    and for calling `count` on the first turn."""

    def reset(self, **row):
        self.turn, self.score = 0, 0.0

    def step(self, text):
        time.sleep(0.01)
        self.turn += 1
        self.score -= abs(len(text) - 12) / 12
        return f"you wrote {len(text)} characters", 0.0, self.turn >= 3

    @property
    def reward(self):
        return self.score
'''

# a turn ends on the letter e (rl.stop), so the tiny model's turns end before rl.max_new_tokens and episodes go on
EPISODES = ["rl.reward=environment", "data.chat_template=chatml", "rl.stop=[e]", "rl.max_new_tokens=8",
            "rl.max_turns=3", "rl.max_episode_tokens=160", "rl.iterations=3", "rl.prompts_per_iter=4",
            "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.epochs=1", "rl.eval_prompts=4", "rl.ckpt_every=1",
            "rl.k=2", "run.threads=1"]


def game(tmp_path):
    path = tmp_path / "game.py"
    path.write_text(GAME)
    return f"rl.environment={path}:Echo"


@pytest.mark.parametrize("setting,prefix,said", [
    ("rl.tools=rlfuse.data.arithmetic:calculater", "config error: rl.tools:", "has no 'calculater'"),
    ("rl.environment=rlfuse.data.arithmetic:calculator", "config error: rl.environment:", "not a class"),
    ("rl.reward=rlfuse.data.gold:gold_rewards", "config error: rl.reward:", "has no 'gold_rewards'"),
    # the default task's tokenizer has no chat template, which every episode is rendered with
    ("rl.tools=rlfuse.data.arithmetic:calculator", "data error: multi-turn episodes", "data.chat_template=chatml"),
])
def test_a_run_whose_rl_stage_would_refuse_its_code_stops_before_sft(tiny_task, tmp_path, setting, prefix, said):
    # these stopped the RL stage after SFT and the reward model had trained (minutes on the tiny task, hours on a
    # real one)
    proc = rlfuse_here("run", f"run.dir={tmp_path / 'run'}", *TINY, setting)
    line = one_line_error(proc, 2, f"rlfuse run: {prefix}")
    assert said in line and "[sft]" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "sft" / "model").exists()


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_episodes_train_through_the_cli(tiny_task, tmp_path, algo):
    run_dir = tmp_path / "run"
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.critic_init=sft", f"rl.algo={algo}",
                 f"run.dir={run_dir}", game(tmp_path), *TINY, *EPISODES, "rl.lr=1e-2"]) == 0
    rows = [json.loads(l) for l in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["episode/turns"] > 1 and r["episode/tokens_appended"] > 0 for r in rows)
    assert all(r["episode/tool_calls"] == 0 and "episode/env_reward" in r for r in rows)
    # the reward is the environment's (rl.reward=environment)
    assert all(r["reward/mean"] == pytest.approx(r["episode/env_reward"]) for r in rows)
    # the report's held-out samples: every turn and answer of an episode, and its reward
    shown = json.loads((run_dir / "rl" / "samples_after.json").read_text())
    assert all("you wrote" in t and t.splitlines()[-1].startswith("[reward ") for t in shown)
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["after"]["turns"] > 1 and "tool_calls_valid" in result["after"]
    before, after = load_file(str(tiny_task.model_dir / "model.safetensors")), \
        load_file(str(run_dir / "rl" / "model" / "model.safetensors"))
    assert any(not torch.equal(before[n], after[n]) for n in before if n in after)


RECORDED = '''
import os

from rlfuse.data.guessing import GuessNumber


class Recorded(GuessNumber):
    """The guessing game, writing each episode's target to a file."""

    def reset(self, target, **row):
        super().reset(target, **row)
        with open(os.environ["RLFUSE_TEST_TARGETS"], "a") as f:
            f.write(f"{target}\\n")
'''


def test_every_guessing_game_plays_its_own_rows_target(tiny_task, tmp_path, monkeypatch):
    """All the guessing game's rows render to one prompt text: each episode's environment still resets from its own
    row (train and held-out), not from the one row its prompt's token ids would find."""
    (tmp_path / "recorded.py").write_text(RECORDED)
    targets = tmp_path / "targets.txt"
    monkeypatch.setenv("RLFUSE_TEST_TARGETS", str(targets))
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.algo=grpo", f"run.dir={tmp_path / 'run'}",
                 f"rl.environment={tmp_path / 'recorded.py'}:Recorded", "data.kind=guessing", "data.max_examples=200",
                 *TINY, *EPISODES, "rl.iterations=1"]) == 0
    seen = targets.read_text().split()
    assert len(seen) == 4 * 2 + 2 * 4  # the iteration's 4 prompts x k = 2, the evaluation's 4 before and after
    assert len(set(seen[:4])) > 1 and len(set(seen[4:12])) > 1  # held-out games, then the iteration's


def _cmd(tiny_task, run_dir, env_spec):
    return [sys.executable, "-m", "rlfuse", "rl", f"rl.sft_path={tiny_task.model_dir}", "rl.algo=grpo",
            f"run.dir={run_dir}", env_spec, *TINY, *EPISODES, "rl.iterations=4"]


def test_sigkill_mid_episode_then_resume_matches_uninterrupted(tiny_task, tmp_path):
    env = os.environ | {"CI": "true"}
    spec = game(tmp_path)
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cmd(tiny_task, full, spec), check=True, env=env, capture_output=True, cwd=ROOT)
    proc = subprocess.Popen(_cmd(tiny_task, killed, spec), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "rl" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.02)
    time.sleep(0.05)  # into iteration 3's episodes
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "rl" / "model").exists(), "the run finished before it was killed"
    resumed = subprocess.run([sys.executable, "-m", "rlfuse", "rl", "--resume", str(killed)], env=env, cwd=ROOT,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    want = [json.loads(l) for l in (full / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["episode/turns"] for r in rows] == [r["episode/turns"] for r in want]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in want]
    a = load_file(str(full / "rl" / "model" / "model.safetensors"))
    b = load_file(str(killed / "rl" / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=n)


def test_episodes_on_ray_workers_match_one_process(tiny_task, tmp_path):
    """Generation workers on Ray run their prompts' episodes (our engine: the same episodes as one process); the
    first iteration, decoded by the same weights either way, has the single process's turns and rewards."""
    pytest.importorskip("ray")
    runs = {}
    placement = ["placement.strategy=separated", "placement.workers=2"]
    for name, extra in (("single", ["placement.strategy=single"]), ("ray", placement)):
        run_dir = tmp_path / name
        assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.algo=grpo", f"run.dir={run_dir}",
                     game(tmp_path), *TINY, *EPISODES, "rl.iterations=2", "rl.eval_prompts=0", *extra]) == 0
        runs[name] = [json.loads(l) for l in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    first, want = runs["ray"][0], runs["single"][0]
    assert first["episode/turns"] == want["episode/turns"] and first["episode/tokens_appended"] == \
        want["episode/tokens_appended"]
    assert first["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
