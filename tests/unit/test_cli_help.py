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


def test_top_level_help_lists_the_common_settings_by_topic(capsys):
    out = help_of([], capsys)
    for topic in ("model", "data", "algorithm", "batch sizes", "learning", "KL penalty", "output"):
        assert f"\n  {topic}\n" in out
    assert "rl.k = 1 (rloo, grpo: 4)" in out  # the algorithms' presets beside the default
    assert " ".join(out.split()).count("run.memory_table") == 0  # an uncommon field: in the command's help only
    assert len(out.splitlines()) < 170  # at 80 columns


def test_command_help_lists_its_sections_common_first_then_every_field(capsys):
    rl = help_of(["rl"], capsys)
    flat = " ".join(rl.split())
    assert flat.index("rl.algo =") < flat.index("rl.kl_horizon=256")  # common ones first, then the rest by name
    assert "rollout.fusion=\"auto\"" in flat and "placement.strategy" in flat and "sft.lr =" not in flat
    assert len(rl.splitlines()) < 200  # at 80 columns
    sft = help_of(["sft"], capsys)
    assert "sft.lr = 0.002" in sft and "rl.kl_horizon" not in sft


def test_every_field_has_a_first_sentence_that_is_not_cut_at_an_abbreviation():
    from rlfuse.config import Config, field_summary, section_class
    import dataclasses

    for section in dataclasses.fields(Config):
        cls = section_class(section.name)
        for f in dataclasses.fields(cls):
            summary = field_summary(cls, f.name)
            assert summary, f"{section.name}.{f.name} has no docstring"
            assert not summary.endswith(("e.g.", "i.e.", "vs.", "etc.")), f"{section.name}.{f.name}: {summary}"


def test_explain_prints_a_field_whole_and_maps_trl_names(capsys):
    assert main(["explain", "rl.kl_horizon", "rl.beta"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(field_docs(RLConfig)["kl_horizon"].split()) in out
    assert "rl.beta: TRL's name; rlfuse calls it rl.kl_coef" in out and "rl.kl_coef = 0.2 (rloo: 0.1)" in out
    assert main(["explain", "rl.kl_horizn"]) == 2
    assert "did you mean rl.kl_horizon" in capsys.readouterr().err


def test_unknown_field_names_the_closest_with_its_doc():
    with pytest.raises(ConfigError, match=r"rl.eval_evry: unknown key; remove it \(did you mean rl.eval_every "
                                          r"\(Also evaluate the held-out prompts every this many iterations"):
        load_config(None, ["rl.eval_evry=2"])


def test_env_prints_versions(capsys):
    assert main(["env"]) == 0
    out = dict(l.split(":", 1) for l in capsys.readouterr().out.splitlines())
    assert out["torch"].strip() == torch.__version__ and out["python"].strip() == platform.python_version()
    assert {"cuda", "cpu", "transformers", "peft", "bitsandbytes", "ray", "trl", "wandb"} <= set(out)


def test_overrides_on_both_sides_of_a_flag_are_all_read(capsys):
    # rl.lr after --overwrite reaches the config: its bad value is the config's one-line error, not argparse's
    assert main(["rl", "rl.iterations=2", "--overwrite", "rl.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert "rl.lr" in err and "unrecognized arguments" not in err
    with pytest.raises(SystemExit):
        main(["rl", "rl.iterations=2", "--bogus", "rl.lr=1e-4"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
