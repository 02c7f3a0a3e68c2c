"""Run folders as a user meets them from the command line: a second run into a running run's folder, a new run into
a finished one, a run.dir that cannot be written, a disk that fills during a checkpoint. Each case asserts the exit
code, the one line printed and that nothing already there was lost or overwritten."""

import contextlib
import hashlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from rlfuse.cli import main
from rlfuse.runs import LOCK_NAME, RunLock

# the embedded task at its smallest: every stage a few seconds
FAST = ["data.num_reviews=400", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.max_length=96",
        "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=2", "sft.eval_samples=4",
        "rm.steps=2", "rm.batch_size=8", "rm.micro_batch_size=4", "rm.eval_every=2", "rm.num_pairs=64",
        "rl.iterations=2", "rl.prompts_per_iter=4", "rl.mini_batch_size=4", "rl.micro_batch_size=4",
        "rl.eval_prompts=4", "run.quiet=true"]


def rlfuse(*args, limit_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    def cap_file_size():  # a file that may not grow past the limit: what a full disk looks like to a writer
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    return subprocess.run([sys.executable, "-m", "rlfuse", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | {"CI": "true"}, preexec_fn=cap_file_size if limit_file_bytes else None,
                          timeout=600)


def rlfuse_here(*args) -> subprocess.CompletedProcess:
    """`rlfuse ARGS` through rlfuse.cli.main in this process, which is all `python -m rlfuse` runs (its __main__ is
    `raise SystemExit(main())`): the same exit code and output, without a new interpreter importing torch and
    transformers (8-10 s of a test on 2 shared cores). Where a test needs a process of its own (another pid, a file
    size limit, a kill), it calls rlfuse()."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["rlfuse", *map(str, args)], code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess, code: int, prefix: str) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), proc.stderr[-3000:]
    return last


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_into_a_running_runs_folder_is_refused_with_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = RunLock.acquire(run_dir, log=lambda _: None)  # this test process is the running run
    try:
        line = one_line_error(rlfuse("sft", f"run.dir={run_dir}", *FAST), 2, "rlfuse sft: run.dir")
    finally:
        lock.release()
    assert f"in use by another run (pid {os.getpid()}" in line and "choose another run.dir" in line
    assert sorted(p.name for p in run_dir.iterdir()) == [], "the refused run wrote into the folder"


def test_a_killed_runs_lock_is_taken_over_and_said(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": "gone", "started": "yesterday"}))
    proc = rlfuse_here("sft", f"run.dir={run_dir}", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "took over the lock of a run that is no longer running (pid 4194311 on gone, started yesterday)" in proc.stderr
    assert (run_dir / "sft" / "summary.json").is_file() and not (run_dir / LOCK_NAME).exists()


def test_a_finished_stage_is_never_overwritten_without_overwrite(tmp_path):
    run_dir = tmp_path / "run"
    assert rlfuse_here("sft", f"run.dir={run_dir}", *FAST).returncode == 0
    before = digest(run_dir)
    line = one_line_error(rlfuse_here("sft", f"run.dir={run_dir}", *FAST, "sft.steps=3"), 2, "rlfuse sft: run.dir")
    assert "already holds an earlier run (sft finished)" in line and "--overwrite" in line
    assert digest(run_dir) == before, "a refused run changed the folder"
    # the whole pipeline into it: a partly finished run, which --resume continues
    line = one_line_error(rlfuse_here("run", f"run.dir={run_dir}", *FAST), 2, "rlfuse run: run.dir")
    assert f"rlfuse run --resume {run_dir}" in line
    assert digest(run_dir) == before
    # --overwrite with a config that cannot run removes nothing
    one_line_error(rlfuse_here("sft", f"run.dir={run_dir}", *FAST, "sft.micro_batch_size=3", "--overwrite"), 2,
                   "rlfuse sft: config error: sft.batch_size")
    assert digest(run_dir) == before
    # the explicit choice replaces it
    proc = rlfuse_here("sft", f"run.dir={run_dir}", *FAST, "sft.steps=3", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--overwrite: removed sft of the previous run" in proc.stderr
    rows = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3], "metrics of the two runs mixed"


def test_a_run_dir_that_cannot_be_a_folder_is_one_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    line = one_line_error(rlfuse_here("run", f"run.dir={a_file}", *FAST), 2, "rlfuse run: run.dir")
    assert "is a file, not a folder" in line
    line = one_line_error(rlfuse_here("rl", f"run.dir={a_file / 'run'}", *FAST), 2, "rlfuse rl: run.dir")
    assert "cannot write there (Not a directory)" in line
    assert a_file.read_text() == "mine"


def test_a_disk_full_during_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # SFT's and RM's models (under 1 MB each) fit; the RL checkpoint (weights and AdamW states, about 5 MB) does not
    proc = rlfuse("run", f"run.dir={run_dir}", *FAST, limit_file_bytes=2_000_000)
    line = one_line_error(proc, 1, "rlfuse run: cannot write")
    assert f"{run_dir / 'rl' / 'checkpoint.pt'}: File too large" in line and f"--resume {run_dir}" in line
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name], "a temporary file was left behind"
    assert (run_dir / "sft" / "summary.json").is_file() and (run_dir / "rm" / "summary.json").is_file()
    resumed = rlfuse_here("run", "--resume", run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "rl" / "model" / "config.json").is_file() and (run_dir / "eval.json").is_file()
