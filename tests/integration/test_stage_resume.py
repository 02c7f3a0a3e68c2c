"""A supervised stage (SFT, reward model) killed part-way continues from its checkpoint with `--resume` and ends as
the uninterrupted stage does: the same weights bit for bit, each step's metrics once."""

import importlib
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY
from rlfuse import api
from rlfuse.cli import main

STAGE_TINY = [*TINY, "sft.eval_samples=0", "sft.ckpt_every=2", "rm.steps=6", "rm.eval_every=3", "rm.ckpt_every=2"]


class Killed(Exception):
    pass


def quiet(*_):
    pass


def with_dropout(model_dir, folder, p: float = 0.1):
    """A copy of a GPT-2 folder whose dropout draws from the RNG: a resumed stage must restore its state."""
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("stage,lora", [("sft", False), ("rm", True)], ids=["sft-full", "rm-lora-dropout"])
def test_stage_killed_mid_step_resumes_to_the_uninterrupted_model(stage, lora, tiny_task, tmp_path, monkeypatch, capsys):
    train = getattr(api, f"train_{stage}")
    backbone = with_dropout(tiny_task.model_dir, tmp_path / "backbone")  # the reward model's
    overrides = [*STAGE_TINY, f"model.lora={str(lora).lower()}", f"rm.sft_path={backbone}"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(None, full, overrides=overrides, log=quiet)
    assert not (full / stage / "checkpoint.pt").exists()  # the saved model is the result; the checkpoint goes

    trainer = importlib.import_module(f"rlfuse.trainers.{stage}")
    original, steps = trainer.stage_step, []

    def killed_in_step_five(*args, **kwargs):  # after step 5's backward, before its optimiser step
        steps.append(1)
        if len(steps) == 5:
            raise Killed
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "stage_step", killed_in_step_five)
    with pytest.raises(Killed):
        train(None, killed, overrides=overrides, log=quiet)
    monkeypatch.undo()
    ckpt = killed / stage / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == 4 and saved["seconds"] > 0
    torch.save(saved | {"seconds": 1e6}, ckpt)  # the killed process's seconds, made unmistakable
    assert not (killed / stage / "model").exists()

    # starting again there is refused with the way to continue; a change the checkpoint depends on is refused
    assert main([stage, f"run.dir={killed}"]) != 0
    assert f"rlfuse {stage} --resume {killed}" in capsys.readouterr().err
    for change in (f"{stage}.weight_decay=0.5", "data.max_length=80"):  # the data: every stage reads it
        assert main([stage, "--resume", str(killed), change]) != 0
        assert "cannot change in a resumed run" in capsys.readouterr().err

    if stage == "rm":  # its backbone saved again since the checkpoint (`rlfuse sft --overwrite`): refused
        weights = backbone / "model.safetensors"
        shutil.copy(weights, tmp_path / "kept.safetensors")
        save_file({k: v + 1e-3 for k, v in load_file(str(weights)).items()}, str(weights))
        assert main([stage, "--resume", str(killed)]) != 0
        assert "was trained from another model than" in capsys.readouterr().err
        shutil.copy(tmp_path / "kept.safetensors", weights)
    assert main([stage, "--resume", str(killed), f"{stage}.ckpt_every=3"]) == 0
    err = capsys.readouterr().err
    assert f"[{stage}] resumed from {ckpt} at step 4 of 6" in err
    assert f"# resumed at {stage} step 4: {stage}.ckpt_every 2 -> 3" in (killed / "config.yaml").read_text()
    assert not ckpt.exists()
    # the stage's seconds count the killed process's up to its checkpoint too
    assert json.loads((killed / stage / "summary.json").read_text())["seconds"] > 1e6
    rows = [json.loads(line) for line in (killed / stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing logged twice
    uninterrupted = [json.loads(line) for line in (full / stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in uninterrupted]
    a, b = (load_file(str(d / stage / "model" / "model.safetensors")) for d in (full, killed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name

    # a finished stage resumed is returned as it was saved
    assert main([stage, "--resume", str(killed)]) == 0
    assert "already finished" in capsys.readouterr().err


def test_resume_before_the_first_checkpoint_starts_at_step_zero(tiny_task, tmp_path, monkeypatch, capsys):
    trainer = importlib.import_module("rlfuse.trainers.sft")
    original = trainer.stage_step

    def killed_at_once(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(trainer, "stage_step", killed_at_once)
    with pytest.raises(Killed):
        api.train_sft(None, tmp_path, overrides=[*STAGE_TINY, "sft.steps=2"], log=quiet)
    monkeypatch.setattr(trainer, "stage_step", original)
    # nothing trained yet: every sft setting may still change
    assert main(["sft", "--resume", str(tmp_path), "sft.lr=1e-3"]) == 0
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "starting at step 0" in err
    assert (tmp_path / "sft" / "model").is_dir()


def test_run_resume_continues_a_killed_sft_stage(tiny_task, tmp_path, monkeypatch, capsys):
    trainer = importlib.import_module("rlfuse.trainers.sft")
    original, steps = trainer.stage_step, []

    def killed_in_step_five(*args, **kwargs):
        steps.append(1)
        if len(steps) == 5:
            raise Killed
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "stage_step", killed_in_step_five)
    rl = ["rl.algo=grpo", "rl.k=2", "rl.reward=rlfuse.data.gold:gold_reward", "rl.iterations=1", "rl.prompts_per_iter=2",
          "rl.mini_batch_size=4", "rl.micro_batch_size=4", "rl.max_new_tokens=8", "rl.eval_prompts=2"]
    with pytest.raises(Killed):
        api.run_pipeline(None, tmp_path, overrides=[*STAGE_TINY, *rl], log=quiet)
    monkeypatch.setattr(trainer, "stage_step", original)
    ckpt = tmp_path / "sft" / "checkpoint.pt"
    torch.save(torch.load(ckpt, weights_only=False) | {"seconds": 1e6}, ckpt)  # the killed process's, unmistakable
    t0 = time.perf_counter()
    assert main(["run", "--resume", str(tmp_path), "sft.ckpt_every=3"]) == 0
    wall = time.perf_counter() - t0
    out, err = capsys.readouterr()
    assert f"[sft] resumed from {tmp_path / 'sft' / 'checkpoint.pt'} at step 4 of 6" in err
    # the pipeline's time is the whole run's: the killed process's SFT seconds, then this one's
    sft_s = json.loads((tmp_path / "sft" / "summary.json").read_text())["seconds"]
    rl_s = json.loads((tmp_path / "rl" / "summary.json").read_text())["seconds"]
    total = float(next(line for line in (out + err).splitlines() if line.strip().startswith("total")).split()[1])
    assert 1e6 < sft_s < 1e6 + wall and sft_s + rl_s - 1 <= total <= 1e6 + wall + 1
    # the change is noted where it took effect, once, by the first stage that ran
    notes = [line for line in (tmp_path / "config.yaml").read_text().splitlines() if line.startswith("# resumed")]
    assert notes == ["# resumed at sft step 4: sft.ckpt_every 2 -> 3"]
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "rl" / "model").is_dir() and not (tmp_path / "rm").exists()
