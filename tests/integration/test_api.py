"""The Python API: the README example runs as written; live reward callables, hub ids for stage models, sampling
from saved models (CLI and API), held-out evaluation and sample tables during RL, the report's sections."""

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from rlfuse import api, live_rewards
from rlfuse.cli import main
from rlfuse.errors import UserError


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("<!-- api:start -->")[1].split("<!-- api:end -->")[0]
    return section.split("```python\n")[1].split("```")[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's example, run as written in a fresh folder; its functions live in a module that cannot be
    imported (as a notebook's do). Returns (run folder, what it printed)."""
    cwd, out = tmp_path_factory.mktemp("readme"), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(readme_example(), "README.md", "exec"), {"__name__": "readme_example"})
    finally:
        os.chdir(old)
    return cwd / "runs" / "api-demo", out.getvalue()


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_readme_example_runs_and_observes(demo):
    run_dir, printed = demo
    assert printed.startswith("perplexity ") and "->" in printed
    assert (run_dir / "rl" / "model" / "config.json").is_file() and (run_dir / "report.html").is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["rl"]["reward"] == "rlfuse.live_rewards:enthusiasm"  # not importable by name: a live callable
    rows = rows_of(run_dir / "rl" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # rl.eval_every=1: held-out evaluation after iteration 1 (iteration 2's is the "after" evaluation)
    assert {"eval/reward_mean", "eval/kl", "eval/gold_positive_rate"} <= set(rows[0]) and "eval/kl" not in rows[1]
    for r in rows:
        assert r["train/lr"] == pytest.approx(1e-4) and 0.0 <= r["reward/frac_zero_spread"] <= 1.0
    samples = rows_of(run_dir / "rl" / "samples.jsonl")  # rl.log_samples_every=1: 8 rows per iteration
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8
    assert {"prompt", "completion", "reward", "finish", "gold"} <= set(samples[0])
    report = (run_dir / "report.html").read_text()
    assert "Held-out evaluation during RL" in report and "Sample completions during RL" in report
    for stage in ("sft", "rl"):  # run.report_to default: TensorBoard (installed here) for every stage
        assert list((run_dir / stage / "tensorboard").glob("events.*"))


def test_resuming_a_live_reward_without_it_says_how(demo, monkeypatch):
    run_dir, _ = demo
    monkeypatch.setattr(live_rewards, "_LIVE", {})  # as in a new process
    with pytest.raises(UserError, match=r"rl.reward: .*pass it again"):
        api.train_rl(run_dir=run_dir, resume=True)


def test_live_reward_on_ray_workers_is_refused():
    with pytest.raises(UserError, match="rl.reward.*placement.strategy=single"):
        api.train_rl(overrides={"placement.strategy": "flattened", "placement.workers": 2}, reward=lambda t: [0.0] * len(t))


@pytest.mark.parametrize("how", ["folder", "hub id"])
def test_rl_from_a_folder_or_a_hub_id(demo, tmp_path, monkeypatch, how):
    sft_dir, fetched = demo[0] / "sft" / "model", []

    def snapshot(repo_id, allow_patterns):  # the hub, without a network
        fetched.append(repo_id)
        return str(sft_dir)

    monkeypatch.setattr("rlfuse.runs._snapshot_download", snapshot)
    source = str(sft_dir) if how == "folder" else "someorg/tiny-sft"
    cfg = yaml.safe_load((demo[0] / "config.yaml").read_text())
    result = api.train_rl(cfg, tmp_path, overrides={"rl.sft_path": source, "rl.iterations": 1, "rl.eval_every": 0},
                          reward="rlfuse.data.gold:gold_reward")
    assert fetched == ([] if how == "folder" else ["someorg/tiny-sft"])
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rl"]["sft_path"] == source  # the id, not the cache
    assert (result.model_dir / "config.json").is_file() and result.run_dir == tmp_path


def test_generate_cli_is_seeded_and_takes_a_run_folder(demo, capsys):
    run_dir, _ = demo
    args = ["--prompt", "the movie was", "-n", "2", "--seed", "3", "--max-new-tokens", "6"]
    outs = []
    for model in (run_dir / "rl" / "model", run_dir / "rl" / "model", run_dir):
        assert main(["generate", str(model), *args]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].count("[the movie was]") == 2
    assert main(["generate", str(run_dir / "nowhere"), *args]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_generate_from_a_lora_adapter_equals_its_merged_model(tmp_path):
    """A stage's adapter/ (on its base) and model/ (merged) sample the same tokens with the same seed."""
    import torch
    from peft import LoraConfig, get_peft_model

    from helpers import make_tiny_model
    from rlfuse.models.load import load_causal_lm, load_tokenizer, save_trained_model

    base = make_tiny_model(tmp_path / "base", ["the movie was great", "a bad film, really bad"] * 20)
    torch.manual_seed(0)
    lora = get_peft_model(load_causal_lm(str(base)), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                                 init_lora_weights=False))  # a non-zero delta
    save_trained_model(lora, load_tokenizer(str(base)), tmp_path / "sft", base=str(base))
    kw = dict(max_new_tokens=8, n=3, seed=1)
    merged = api.generate(tmp_path / "sft" / "model", ["the movie"], **kw)
    assert api.generate(tmp_path / "sft" / "adapter", ["the movie"], **kw) == merged
    assert api.generate(base, ["the movie"], **kw) != merged  # the adapter matters


def test_stage_paths_resolve_hub_ids_and_say_when_the_hub_fails(tmp_path, monkeypatch):
    from rlfuse.config import load_config
    from rlfuse.runs import with_local_stage_paths

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr("rlfuse.runs._snapshot_download", lambda repo_id, allow_patterns: str(tmp_path))
    cfg = load_config(None, {"rl.sft_path": "org/sft", "rl.rm_path": "org/rm", "rm.sft_path": "org/sft"})
    local = with_local_stage_paths(cfg)
    assert (local.rl.sft_path, local.rl.rm_path, local.rm.sft_path) == (str(tmp_path),) * 3
    assert cfg.rl.sft_path == "org/sft"  # the config saved in the run folder keeps the ids

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore lines")

    monkeypatch.setattr("rlfuse.runs._snapshot_download", offline)
    with pytest.raises(UserError, match=r"^config error: rl.rm_path: could not fetch hub model 'org/rm' \(OSError: We "
                                        r"couldn't connect to 'https://huggingface.co'\); .*set rl.rm_path to a local"):
        with_local_stage_paths(load_config(None, {"rl.rm_path": "org/rm"}))
    for field, path in (("rl.sft_path", "./missing"), ("rm.sft_path", "runs/x/sft/model")):  # paths, not hub ids
        with pytest.raises(UserError, match=f"{field}: folder '{path}' not found"):
            load_config(None, {field: path})


def test_a_model_object_is_saved_into_the_run_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny", ["a small corpus of words"] * 10)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    name = api._model_override(model, tok, tmp_path / "run")
    assert name == str(tmp_path / "run" / "base_model") and (Path(name) / "config.json").is_file()
    assert api._model_override("org/model", None, None) == "org/model"
    with pytest.raises(UserError, match="model: a model object must .* come with tokenizer="):
        api._model_override(model, None, tmp_path / "run")


def says_yes(prompts, completions, answer):  # a reward of TRL's form that reads the data set's `answer` column
    return [float(a in c) for c, a in zip(completions, answer)]


def is_short(prompts, completions, **_):
    return [None if not c.strip() else float(len(c) < 20) for c in completions]


def test_a_datasets_object_and_several_reward_functions(demo, tmp_path):
    from datasets import Dataset

    run_dir, _ = demo
    rows = [{"prompt": f"the movie was number {i}", "answer": "great"} for i in range(12)]
    out = tmp_path / "rl-ds"
    result = api.train_rl(overrides={"rl.sft_path": run_dir / "sft" / "model", "rl.algo": "grpo", "rl.k": 2,
                                     "rl.iterations": 1, "rl.prompts_per_iter": 4, "rl.mini_batch_size": 8,
                                     "rl.micro_batch_size": 4, "rl.max_new_tokens": 6, "rl.eval_prompts": 2,
                                     "rl.reward_weights": [1.0, 0.5], "run.quiet": True},
                          run_dir=out, dataset=Dataset.from_list(rows), reward=[says_yes, is_short])
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["kind"] == "jsonl" and Path(saved["data"]["path"]) == out / "data.jsonl"
    assert [spec.split(":")[1] for spec in saved["rl"]["reward"].split(",")] == ["says_yes", "is_short"]
    row = rows_of(out / "rl" / "metrics.jsonl")[0]
    assert 0.0 <= row["reward/fn/says_yes"] <= 1.0 and 0.0 <= row["reward/fn/is_short"] <= 1.0
    assert result.model_dir.is_dir()
    with pytest.raises(UserError, match="DatasetDict"):
        from datasets import DatasetDict

        api.train_rl(run_dir=tmp_path / "x", dataset=DatasetDict(train=Dataset.from_list(rows)))


def same_for_all(completions, **_):
    return [1.0] * len(completions)


def test_a_health_finding_is_said_once_live_and_found_again_by_audit(demo, tmp_path, capsys):
    """A reward that scores every sample alike: every group has zero spread, so group collapse fires at iteration 3
    (3 iterations running) and is said once, with `rlfuse audit` to run; the audit of the folder finds it again."""
    run_dir, _ = demo
    said, out = [], tmp_path / "flat"
    api.train_rl(overrides={"rl.sft_path": run_dir / "sft" / "model", "rl.algo": "grpo", "rl.k": 2,
                            "rl.iterations": 5, "rl.prompts_per_iter": 4, "rl.mini_batch_size": 8,
                            "rl.micro_batch_size": 4, "rl.max_new_tokens": 6, "rl.eval_prompts": 2, "run.quiet": True},
                 run_dir=out, reward=same_for_all, log=said.append)
    health = [line for line in said if line.startswith("[rl] health:")]
    assert len(health) == 1 and "Group collapse from iteration 1" in health[0] and f"rlfuse audit {out}" in health[0]
    assert main(["audit", str(out)]) == 1
    assert "Group collapse from iteration 1" in capsys.readouterr().out
