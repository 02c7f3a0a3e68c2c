"""`rlfuse --help` and each command's help list the config fields with their docstrings; unknown fields get the
closest field's doc; `rlfuse env` prints versions."""

import platform

import pytest
import torch

from rlfuse.cli import main
from rlfuse.config import RLConfig, field_docs, load_config
from rlfuse.errors import ConfigError


def help_of(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_section_with_first_sentences(capsys):
    out = help_of([], capsys)
    for section in ("run:", "data:", "model:", "sft:", "rm:", "rl:", "rollout:", "placement:"):
        assert f"\n{section}\n" in out
    line = next(l for l in out.splitlines() if l.strip().startswith("run.memory_table = null"))
    assert line.endswith("(rl/memory.json and the report's table; one process only, Ray workers log their RSS).")
    assert "null: on where" not in out  # the first sentence only; `rlfuse rl --help` has the rest
    assert "run.report_to = null" in out and "rl.eval_every = 0" in out


def test_command_help_lists_its_own_sections_in_full(capsys):
    rl = " ".join(help_of(["rl"], capsys).split())
    assert " ".join(field_docs(RLConfig)["kl_horizon"].split()) in rl
    assert "rollout.fusion = \"auto\"" in rl and "placement.strategy" in rl and "sft.lr =" not in rl
    sft = help_of(["sft"], capsys)
    assert "sft.lr = 0.002" in sft and "rl.kl_horizon" not in sft


def test_unknown_field_names_the_closest_with_its_doc():
    with pytest.raises(ConfigError, match=r"rl.eval_evry: unknown key; remove it \(did you mean rl.eval_every "
                                          r"\(Also evaluate the held-out prompts every this many iterations"):
        load_config(None, ["rl.eval_evry=2"])


def test_env_prints_versions(capsys):
    assert main(["env"]) == 0
    out = dict(l.split(":", 1) for l in capsys.readouterr().out.splitlines())
    assert out["torch"].strip() == torch.__version__ and out["python"].strip() == platform.python_version()
    assert {"cuda", "cpu", "transformers", "peft", "bitsandbytes", "ray", "trl", "wandb"} <= set(out)
