"""Bad inputs met through a whole stage, as a user runs it (`rlfuse rl configs/verifiable.yaml ...`, in this
process): a policy folder without a tokenizer or with NaN weights stops RL in one line before it trains (it trained
with exit 0, or ended in an index error); an RL stage that fails before writing anything of use leaves no rl/
behind, so the same command runs again without --overwrite."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT
from test_run_folders import one_line_error, rlfuse_here

FIXTURES = ROOT / "tests" / "fixtures"
SMALL = ["data.max_examples=300", "rl.iterations=2", "rl.prompts_per_iter=4", "rl.k=4", "rl.mini_batch_size=16",
         "rl.micro_batch_size=8", "rl.eval_prompts=4", "run.quiet=true"]


@pytest.fixture
def rl_here(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    return lambda run_dir, sft_path, *extra: rlfuse_here(
        "rl", "configs/verifiable.yaml", f"run.dir={run_dir}", f"rl.sft_path={sft_path}", *SMALL, *extra)


def test_rl_on_a_policy_folder_without_tokenizer_stops_in_one_line(tiny_task, rl_here, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_task.model_dir / f, folder / f)
    line = one_line_error(rl_here(tmp_path / "run", folder), 2, "rlfuse rl: model error:")
    assert f"{str(folder)!r} has no tokenizer files" in line
    assert not (tmp_path / "run" / "rl").exists()


def test_rl_on_nan_weights_stops_in_one_line_naming_the_tensor(tiny_task, rl_here, tmp_path):
    folder = tmp_path / "nan"
    shutil.copytree(tiny_task.model_dir, folder)
    state = load_file(folder / "model.safetensors")
    name = next(k for k, v in state.items() if v.dim() == 2)
    state[name][0] = torch.nan
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    line = one_line_error(rl_here(tmp_path / "run", folder), 2, "rlfuse rl: model error:")
    assert f"{folder / 'model.safetensors'}: weight" in line and "holds NaN or inf values" in line
    assert "out of bounds" not in line


def test_an_rl_stage_that_fails_before_training_can_run_again_without_overwrite(tiny_task, rl_here, tmp_path):
    # the reward function fails in the first iteration, before any metrics row or checkpoint: rl/ held what the stage
    # wrote as it started (eval_before.json, weight_layout.txt, an empty metrics.jsonl, tensorboard/), and the same
    # command was then refused ("already holds an earlier run ... pass --overwrite"). The folder was there before (a
    # run.dir made by hand, or an SFT stage's), so it stays
    run = tmp_path / "run"
    run.mkdir()
    failing = ("rl.eval_prompts=0", "rl.reward=bad_rewards:raises")
    first = one_line_error(rl_here(run, tiny_task.model_dir, *failing), 2, "rlfuse rl: iteration 1: reward error:")
    assert "raised ZeroDivisionError" in first
    assert run.is_dir() and not (run / "rl").exists()
    again = one_line_error(rl_here(run, tiny_task.model_dir, *failing), 2, "rlfuse rl:")
    assert "raised ZeroDivisionError" in again and "already holds" not in again
