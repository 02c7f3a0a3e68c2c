"""Placements a machine cannot hold, and a cluster address nothing answers at: one line before any worker starts,
not minutes of Ray workers filling memory or a connection retried without end. A driver killed mid-run takes the
local Ray it started with it."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from rlfuse.cli import main
from rlfuse.plan.spec import ClusterResources
from rlfuse.runtime.ray_watchdog import session_processes
from test_bad_rewards import FIXTURES
from test_run_folders import one_line_error

RL = ["configs/verifiable.yaml", "data.max_examples=300", "rl.iterations=1", "rl.prompts_per_iter=4", "rl.k=4",
      "rl.mini_batch_size=16", "rl.micro_batch_size=8", "rl.eval_prompts=4", "run.quiet=true"]


def rlfuse(*args) -> subprocess.CompletedProcess:
    env = os.environ | {"CI": "true", "PYTHONPATH": str(FIXTURES)}
    return subprocess.run([sys.executable, "-m", "rlfuse", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def validate(capsys, *overrides) -> str:
    """`rlfuse validate` in this process (no worker, no Ray): its exit code 2 and its one line."""
    assert main(["validate", "placement.strategy=flattened", *overrides]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("rlfuse validate: config error: placement.workers:"), line
    return line


def machine() -> ClusterResources:
    found = ClusterResources.this_machine()
    if found is None:
        pytest.skip("this machine's GPUs cannot be read from the OS (nvidia-smi without device files): not checked")
    return found


def test_more_workers_than_this_machine_has_cores_is_refused_at_validate(capsys):
    cores = int(machine().cpus)
    line = validate(capsys, f"placement.workers={cores * 32}")
    assert f"needs {cores * 32} CPUs" in line and f"this machine has {cores}" in line


def test_gpus_this_machine_lacks_are_refused_at_validate(capsys):
    gpus = int(machine().gpus)
    line = validate(capsys, "placement.workers=1", f"placement.gpus_per_worker={gpus + 1}" if gpus else
                    "placement.gpus_per_worker=1")
    assert f"but this machine has {gpus}" in line


def test_workers_predicted_beyond_the_memory_available_are_refused_at_validate(capsys):
    machine()
    line = validate(capsys, "placement.workers=2", "model.n_layer=48", "model.n_embd=4096", "model.n_head=32")
    assert "are predicted to need" in line and "GiB available" in line


def test_an_address_nothing_answers_at_is_one_line_within_seconds(tiny_task, tmp_path):
    proc = rlfuse("rl", *RL, f"rl.sft_path={tiny_task.model_dir}", f"run.dir={tmp_path / 'run'}",
                  "placement.strategy=flattened", "placement.workers=2", "placement.address=127.0.0.1:9")
    line = one_line_error(proc, 2, "rlfuse rl: placement.address 127.0.0.1:9: nothing answers there")
    assert "ray start --head" in line


def test_a_killed_driver_takes_its_local_ray_with_it(tiny_task, tmp_path):
    run_dir = tmp_path / "run"
    env = os.environ | {"CI": "true", "PYTHONPATH": str(FIXTURES)}
    driver = subprocess.Popen([sys.executable, "-m", "rlfuse", "rl", *RL, "rl.iterations=200", "rl.ckpt_every=1000",
                               f"rl.sft_path={tiny_task.model_dir}", f"run.dir={run_dir}",
                               "placement.strategy=flattened", "placement.workers=2"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.txt", "w"))
    deadline = time.time() + 240  # killed once its Ray workers are up (the line naming their pids)
    while "Ray worker(s) up" not in (tmp_path / "stderr.txt").read_text() and time.time() < deadline \
            and driver.poll() is None:
        time.sleep(0.2)
    assert driver.poll() is None, "the run ended before it could be killed"
    sessions = glob.glob(f"/tmp/ray/session_*_{driver.pid}")
    assert len(sessions) == 1 and session_processes(sessions[0]), "no Ray session of this driver found"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 30
    while session_processes(sessions[0]) and time.time() < deadline:
        time.sleep(1)
    assert not session_processes(sessions[0]), "Ray processes outlived their driver by 30 s"
