"""`--resume` as a user meets it: settings the checkpoint depends on cannot change (refused with the list, nothing
written), the changeable ones take effect for real (the learning rate too) and are noted in config.yaml with their
iteration, a config file given with --resume is held to the same rules, a damaged or foreign checkpoint is one line
that says how to step back, resuming a run with no checkpoint says so, and a finished run says what its kept
checkpoints hold."""

import json
import os
import shutil

import pytest
import torch

from rlfuse.learn.checkpoint import checkpoint_bytes
from test_run_folders import FAST, digest, one_line_error, rlfuse, rlfuse_here


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    proc = rlfuse("run", f"run.dir={run_dir}", *FAST, "rl.ckpt_every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)
    return run_dir


@pytest.fixture
def run_dir(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def lr_by_step(run_dir):
    rows = [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}


def test_settings_the_checkpoint_depends_on_are_refused_with_the_list(run_dir):
    before = digest(run_dir)
    line = one_line_error(rlfuse_here("run", "--resume", run_dir, "rl.algo=rloo", "rl.k=2", "model.n_embd=32"), 2,
                          "rlfuse run: resume:")
    assert "rl.algo 'ppo' -> 'rloo'" in line and "rl.k 1 -> 2" in line and "model.n_embd 64 -> 32" in line
    assert "cannot change in a resumed run" in line
    assert digest(run_dir) == before


def test_learning_rate_and_iterations_changed_on_resume_take_effect_and_are_noted(run_dir):
    proc = rlfuse_here("rl", "--resume", run_dir, "rl.iterations=4", "rl.lr=5e-4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: applying rl.iterations 2 -> 4, rl.lr 0.0001 -> 0.0005" in proc.stderr
    assert lr_by_step(run_dir) == {1: 1e-4, 2: 1e-4, 3: 5e-4, 4: 5e-4}  # the optimiser follows, not the checkpoint's
    notes = [line for line in (run_dir / "config.yaml").read_text().splitlines() if line.startswith("#")]
    assert notes == ["# resumed at iteration 2: rl.iterations 2 -> 4, rl.lr 0.0001 -> 0.0005"]
    assert "lr: 0.0005" in (run_dir / "config.yaml").read_text()


def test_a_config_file_given_with_resume_is_used_by_the_same_rules(run_dir, tmp_path):
    saved = (run_dir / "config.yaml").read_text()
    longer = tmp_path / "longer.yaml"
    longer.write_text(saved.replace("iterations: 2", "iterations: 3"))
    proc = rlfuse_here("rl", "--resume", run_dir, longer)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(lr_by_step(run_dir)) == [1, 2, 3]
    other = tmp_path / "other.yaml"
    assert "  clip: 0.2\n" in saved
    other.write_text(saved.replace("  clip: 0.2\n", "  clip: 0.3\n"))
    before = digest(run_dir)
    line = one_line_error(rlfuse_here("rl", "--resume", run_dir, other), 2, "rlfuse rl: resume:")
    assert "rl.clip 0.2 -> 0.3" in line
    assert digest(run_dir) == before


def test_a_damaged_checkpoint_is_one_line_and_the_previous_one_is_kept(run_dir):
    ckpt = run_dir / "rl" / "checkpoint.pt"
    prev = run_dir / "rl" / "checkpoint.pt.prev"
    assert prev.is_file(), "the checkpoint before the last was not kept"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # a write cut short
    line = one_line_error(rlfuse_here("rl", "--resume", run_dir, "rl.iterations=3"), 2, f"rlfuse rl: {ckpt} is not a "
                          "readable rlfuse checkpoint")
    assert f"`mv {prev} {ckpt}`" in line
    prev.replace(ckpt)  # the step back the line names
    proc = rlfuse_here("rl", "--resume", run_dir, "rl.iterations=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "at iteration 1" in proc.stderr


def test_a_checkpoint_of_another_model_is_one_line(run_dir):
    ckpt = run_dir / "rl" / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False)
    name = next(iter(state["actor"]))
    state["actor"][name] = torch.zeros(3)  # a tensor of another model's shape
    torch.save(state, ckpt)
    line = one_line_error(rlfuse_here("rl", "--resume", run_dir, "rl.iterations=3"), 2, "rlfuse rl:")
    assert "does not fit this run's models" in line and "start a new run" in line


def test_resuming_a_run_with_no_checkpoint_says_so(run_dir):
    (run_dir / "rl" / "checkpoint.pt").unlink()
    (run_dir / "rl" / "checkpoint.pt.prev").unlink()
    proc = rlfuse_here("rl", "--resume", run_dir, "rl.clip=0.3")  # RL has made nothing a change would contradict
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no RL checkpoint" in proc.stderr and "RL starts at iteration 0" in proc.stderr
    assert "# resumed at iteration 0: rl.clip 0.2 -> 0.3" in (run_dir / "config.yaml").read_text()


def test_a_finished_run_says_where_its_checkpoints_are_and_their_size(finished_run):
    stderr = (finished_run.parent / "stderr.txt").read_text()
    said = [line for line in stderr.splitlines() if "checkpoints kept" in line]
    rl = finished_run / "rl"
    size = sum((rl / name).stat().st_size for name in ("checkpoint.pt", "checkpoint.pt.prev"))
    assert len(said) == 1 and f"{size / 2**30:.2f} GiB in {rl / 'checkpoint.pt'}*" in said[0], said
    assert f"rlfuse rl --resume {finished_run} rl.iterations=N" in said[0]


def test_checkpoint_bytes_counts_every_companion_once(tmp_path):
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(b"x" * 100)
    os.link(ckpt, tmp_path / "checkpoint.pt.prev")  # keep_previous's hard link: no second copy on disk
    (tmp_path / "checkpoint.pt.inflight").write_bytes(b"y" * 10)
    (tmp_path / "checkpoint.pt.shards-000002").mkdir()
    (tmp_path / "checkpoint.pt.shards-000002" / "__0_0.distcp").write_bytes(b"z" * 7)
    (tmp_path / "metrics.jsonl").write_bytes(b"w" * 1000)  # beside it, not the checkpoint's
    assert checkpoint_bytes(ckpt) == 117
