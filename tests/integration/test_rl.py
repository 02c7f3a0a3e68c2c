"""RL end to end on the tiny default task: every algorithm runs through the CLI, parameters change, eval.json is
written; a run killed with SIGKILL mid-iteration resumes and ends where an uninterrupted run ends."""

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

RL_TINY = ["rl.iterations=2", "rl.prompts_per_iter=4", "rl.mini_batch_size=4", "rl.micro_batch_size=2",
           "rl.max_new_tokens=8", "rl.epochs=1", "rl.eval_prompts=4", "rl.ckpt_every=1", "rollout.score_every=2"]
EVAL_KEYS = {"gold_positive_rate", "gold_mean", "reward_mean", "kl", "grammatical_rate", "mean_length"}


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("algo,critic", [("ppo", "sft"), ("ppo", "actor"), ("rloo", "sft"), ("grpo", "sft")])
def test_rl_algorithms_run_and_change_every_parameter(tiny_task, tmp_path, algo, critic):
    k = "rl.k=1" if algo == "ppo" else "rl.k=2"
    args = [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", f"rl.critic_init={critic}",
            f"rl.algo={algo}", k, f"run.dir={tmp_path}", *TINY, *RL_TINY, "rl.lr=1e-2"]
    assert main(["rl", *args]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert set(result) == {"before", "after"} and EVAL_KEYS <= set(result["after"])
    rows = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"reward/mean", "train/policy_loss", "time/generation", "time/scoring", "time/training"} <= set(rows[0])
    assert all(0 < r["perf/compute_fraction"] < 1 and r["perf/flops"] > 0 for r in rows)
    before, after = weights(tiny_task.model_dir), weights(tmp_path / "rl" / "model")
    unchanged = [n for n in before if n in after and torch.equal(before[n], after[n])]
    assert not unchanged, unchanged[:5]


def test_a_released_reference_trains_the_same_bits_as_a_resident_one(tiny_task, tmp_path):
    # rl.release_reference (on by default): the reference mapped from the SFT folder, its pages handed back at every
    # update; the KL it gives, and so the rewards and the weights, are the resident reference's to the bit
    runs = {}
    for release in ("true", "false"):
        run_dir = tmp_path / release
        assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward",
                     "rl.critic_init=sft", "rl.algo=ppo", "rl.k=1", f"run.dir={run_dir}", *TINY, *RL_TINY,
                     "rl.eval_prompts=0", f"rl.release_reference={release}"]) == 0
        rows = [json.loads(l) for l in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
        runs[release] = [(r["reward/mean"], r["reward/kl_k1"]) for r in rows], weights(run_dir / "rl" / "model")
    (rows, actor), (want_rows, want_actor) = runs["true"], runs["false"]
    assert rows == want_rows and any(kl != 0 for _, kl in rows[1:])  # the second iteration's KL is not zero
    assert actor.keys() == want_actor.keys() and all(torch.equal(actor[n], want_actor[n]) for n in actor)


def test_full_pipeline_command_writes_eval(tmp_path, capsys):
    assert main(["run", f"run.dir={tmp_path}", *TINY, *RL_TINY, "rl.reward=rm", "rl.critic_init=rm"]) == 0
    out = capsys.readouterr().out
    assert "gold_positive_rate" in out and f"run folder: {tmp_path}" in out
    assert EVAL_KEYS <= set(json.loads((tmp_path / "eval.json").read_text())["before"])


def test_bad_reward_function_is_a_config_error(tiny_task, tmp_path, capsys):
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.reward=nowhere:nothing", "rl.critic_init=sft",
                 f"run.dir={tmp_path}", *TINY, *RL_TINY]) == 2
    assert "rl.reward" in capsys.readouterr().err


def _rl_cmd(tiny_task, run_dir, *extra):
    return [sys.executable, "-m", "rlfuse", "rl", f"rl.sft_path={tiny_task.model_dir}",
            "rl.reward=rlfuse.data.gold:gold_reward", "rl.critic_init=sft", f"run.dir={run_dir}", "run.threads=1",
            *TINY, *RL_TINY, "rl.iterations=5", "rl.max_new_tokens=16", *extra]


# a non-constant temperature schedule and a curriculum scored by the reward: resume must continue both exactly
SCHEDULED = ["rl.temperature=1.0", "rl.temperature_schedule=linear", "rl.temperature_final=0.6", "rl.curriculum=reward",
             "rl.curriculum_start=0.25"]


def test_sigkill_mid_iteration_then_resume_matches_uninterrupted(tiny_task, tmp_path):
    env = os.environ | {"CI": "true"}
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_rl_cmd(tiny_task, full, *SCHEDULED), check=True, env=env, capture_output=True, cwd=ROOT)
    proc = subprocess.Popen(_rl_cmd(tiny_task, killed, *SCHEDULED), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "rl" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # iteration 3 is under way
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "rl" / "model").exists(), "the run finished before it was killed"
    # metrics of iteration 2 are logged just before its checkpoint is written, so the kill may find checkpoint 1 or 2
    # (or land during the write of 2: the rename keeps the previous one whole)
    ckpt = torch.load(killed / "rl" / "checkpoint.pt", weights_only=False)
    assert 1 <= ckpt["iteration"] < 5 and ckpt["counters"]["seconds"] > 0
    # the killed process's seconds up to its checkpoint, made unmistakable: the stage's time counts them
    torch.save(ckpt | {"counters": ckpt["counters"] | {"seconds": 1e6}}, killed / "rl" / "checkpoint.pt")
    t0 = time.perf_counter()
    resumed = subprocess.run([sys.executable, "-m", "rlfuse", "rl", "--resume", str(killed)], env=env, cwd=ROOT,
                             capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert 1e6 < json.loads((killed / "rl" / "summary.json").read_text())["seconds"] < 1e6 + wall
    assert "resumed from" in resumed.stderr
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # nothing lost, nothing logged twice
    # 1.0 -> 0.6 over 5 iterations, the resumed iterations included
    assert [r["rollout/temperature"] for r in rows] == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.6], abs=1e-12)
    difficulty = [json.loads((d / "rl" / "difficulty.json").read_text())["difficulty"] for d in (full, killed)]
    assert difficulty[0] == difficulty[1]  # computed once, before iteration 1, and kept
    a, b = weights(full / "rl" / "model"), weights(killed / "rl" / "model")
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=n)


def test_lora_reference_is_the_actor_with_adapters_disabled(tiny_task, tmp_path):
    from rlfuse.config import load_config
    from rlfuse.data.collate import encode
    from rlfuse.models.load import load_causal_lm
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams
    from rlfuse.rollout.score import Scorer
    from rlfuse.models.forward import collate, response_logprobs
    from rlfuse.models.build import build_models

    cfg = load_config(None, [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward",
                             "rl.algo=grpo", "rl.k=2", "model.lora=true", *TINY])
    models = build_models(cfg, tmp_path, torch.device("cpu"))
    assert models.ref is None  # no second copy of the weights
    with torch.no_grad():  # move the adapters away from zero so the actor differs from the reference
        for n, p in models.actor.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    tok = models.tokenizer
    sample = next(DecodeEngine(models.actor, tok.eos_token_id).generate([encode(tok, "the acting")], 1, SamplingParams(8), 0))
    scored = Scorer(models.reward_fn, tok.pad_token_id, actor=models.actor).score([sample])[0]
    mb = collate([sample.prompt_ids], [sample.token_ids], tok.pad_token_id, "cpu")
    with torch.no_grad():
        sft_lp = response_logprobs(load_causal_lm(str(tiny_task.model_dir)), mb)[0]
    torch.testing.assert_close(scored.ref_logprobs, sft_lp)
    assert not torch.allclose(scored.ref_logprobs, sample.logprobs, atol=1e-3)  # the actor itself has moved


NAN_CALLS: set = set()
REWARD_CALLS: list = []


def reward_nan_on_some_calls(texts):
    """The gold reward, but the first sample's reward is NaN on the calls numbered in NAN_CALLS (call 0 is the
    "before" evaluation; with fusion off, call i is iteration i)."""
    from rlfuse.data.gold import gold_reward

    REWARD_CALLS.append(len(texts))
    scores = list(gold_reward(texts))
    if len(REWARD_CALLS) - 1 in NAN_CALLS:
        scores[0] = float("nan")
    return scores


@pytest.mark.parametrize("nan_calls,code", [({2}, 0), ({1, 2}, 2)])
def test_nonfinite_rewards_skip_the_update_log_the_row_and_stop_on_repeat(tiny_task, tmp_path, capsys, nan_calls, code):
    NAN_CALLS.clear(), NAN_CALLS.update(nan_calls), REWARD_CALLS.clear()
    args = [f"rl.sft_path={tiny_task.model_dir}", f"rl.reward={__name__}:reward_nan_on_some_calls", "rl.algo=rloo",
            "rl.k=2", f"run.dir={tmp_path}", *TINY, *RL_TINY, "rl.iterations=3", "rl.max_bad_steps=2",
            "rollout.fusion=false", "rollout.micro_batch_size=32"]
    assert main(["rl", *args]) == code
    rows = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ([1, 2, 3] if code == 0 else [1, 2])  # no hole, the stopping row included
    bad = [r["step"] for r in rows if r["reward/nonfinite"]]
    assert bad == sorted(nan_calls) and all(rows[s - 1]["reward/nonfinite"] == 1 for s in bad)
    assert [("train/policy_loss" in r) for r in rows] == [r["step"] not in nan_calls for r in rows]
    assert rows[-1]["train/skipped_steps"] == len(nan_calls)
    if code:
        assert "non-finite rewards (1 of 8 samples)" in capsys.readouterr().err


def test_checkpoint_holds_a_constant_lr_schedule(tiny_task, tmp_path):
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", "rl.critic_init=sft",
                 f"run.dir={tmp_path}", *TINY, *RL_TINY, "rl.lr=3e-3", "rl.critic_lr=2e-3", "rl.eval_prompts=0"]) == 0
    ckpt = torch.load(tmp_path / "rl" / "checkpoint.pt", weights_only=False)
    assert ckpt["sched_actor"]["_last_lr"] == [3e-3, 3e-3] and ckpt["sched_critic"]["_last_lr"] == [2e-3, 2e-3]
    assert ckpt["sched_actor"]["last_epoch"] == 2  # one optimiser step per iteration (4 samples, mini-batch 4)


def test_scheduled_temperature_reaches_sampling_reference_and_update(tiny_task, tmp_path):
    """Iteration 2 samples at 0.6 (1.0 -> 0.6 over 2 iterations). With a negligible learning rate the actor is still
    the reference, so the logged KL is ~0 only if the reference was scored at 0.6 too, and with one mini-batch per
    iteration the update's first ratio is 1 (approx_kl ~0, nothing clipped) only if its log-probs are at 0.6 too. fp32
    on any hardware: bf16 autocast's rounding alone would put the KL at ~2e-3."""
    args = [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", "rl.critic_init=sft",
            f"run.dir={tmp_path}", *TINY, *RL_TINY, "rl.lr=1e-9", "run.precision=fp32", "rl.max_new_tokens=16", "rl.temperature=1.0",
            "rl.temperature_schedule=linear", "rl.temperature_final=0.6", "rl.curriculum=length"]
    assert main(["rl", *args]) == 0
    rows = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/temperature"] for r in rows] == [1.0, 0.6]
    last = rows[1]
    assert abs(last["reward/kl"]) < 1e-3 and last["train/approx_kl"] < 1e-5 and last["train/clip_frac"] == 0.0
    difficulty = json.loads((tmp_path / "rl" / "difficulty.json").read_text())
    assert difficulty["curriculum"] == "length" and min(difficulty["difficulty"]) >= 2  # BOS + at least one token

    from rlfuse.metrics.plots import temperature_twin
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    line = temperature_twin(ax, rows)  # the report's reward panels draw the temperature on a right-hand axis
    assert list(line.get_ydata()) == [1.0, 0.6] and temperature_twin(ax, [{"step": 1}]) is None
    plt.close(fig)
