"""Config files read with limits and without silent loss: a key given twice is refused with both lines, aliases
that expand past a bound (billion laughs) or refer to themselves are refused before anything expands them, and a
file that is not YAML text (gzip, binary, not UTF-8, too big) is one line, never a traceback."""

import gzip

import pytest

from conftest import ROOT, reads_absent_shared_data
from rlfuse.cli import main
from rlfuse.config import load_config
from rlfuse.config.load import MAX_CONFIG_BYTES, MAX_CONFIG_VALUES
from rlfuse.errors import ConfigError

LAUGHS = "\n".join([
    "rl:",
    "  algo: grpo",
    "  reward_weights: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]",
    "  stop: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]",
    "run:",
    "  report_to: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]",
    "model:",
    "  lora_targets: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]",
    "sft:",
    "  lr: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]",
    "rm:",
    "  lr: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]",
    "",
])


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(path, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


@pytest.mark.parametrize("text,key,lines", [
    ("sft:\n  lr: 1.0e-4\nrl:\n  k: 4\nsft:\n  steps: 3\n", "sft", (1, 5)),        # a section given twice
    ("sft:\n  lr: 1.0e-4\n  steps: 3\n  lr: 2.0e-4\n", "lr", (2, 4)),             # a field given twice
    ("rl: {k: 4, k: 8}\n", "k", (1, 1)),                                           # flow style
])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, key, lines):
    line = refused(write(tmp_path, text))
    assert f"key {key!r} is given twice" in line and f"(lines {lines[0]} and {lines[1]})" in line, line


def test_a_billion_laughs_is_refused_before_it_expands(tmp_path):
    # 10**6 values from a 400-byte file (each level ten times the one before); the loader counts, never expands
    line = refused(write(tmp_path, LAUGHS))
    assert f"holds more than {MAX_CONFIG_VALUES} values once its" in line and "aliases" in line, line


def test_a_billion_laughs_in_an_override_is_refused_too():
    nested = "&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for prev, level in zip("abcde", "bcdef"):  # each level ten times the one before: 10**6 values
        nested = f"&{level} [{nested}, " + ", ".join([f"*{prev}"] * 9) + "]"
    with pytest.raises(ConfigError, match="rl.reward_weights: the value holds more than"):
        load_config(None, [f"rl.reward_weights={nested}"])


def test_an_alias_that_contains_itself_is_refused(tmp_path):
    assert "refers to the list or mapping that contains it" in refused(write(tmp_path, "rl: &r\n  k: 4\n  x: *r\n"))


def test_nesting_past_the_limit_is_refused(tmp_path):
    assert "nests lists and mappings more than" in refused(write(tmp_path, "rl:\n  stop: " + "[" * 500 + "]" * 500))


def test_benign_anchors_and_merge_keys_still_load(tmp_path):
    cfg = load_config(write(tmp_path, "sft: &s\n  lr: 1.0e-4\n  steps: 4\nrm:\n  <<: *s\n  steps: 5\n"))
    assert (cfg.sft.lr, cfg.sft.steps, cfg.rm.lr, cfg.rm.steps) == (1e-4, 4, 1e-4, 5)


def test_shipped_configs_and_saved_ones_still_load(tmp_path):
    from rlfuse.config import save_config

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if reads_absent_shared_data(path):
            continue
        cfg = load_config(path)
        save_config(cfg, tmp_path)
        assert load_config(tmp_path / "config.yaml") == cfg


def test_overrides_keep_working():
    cfg = load_config(None, ["sft.lr=1e-4", "rl.stop=[a, b]", "model.lora_targets=c_attn,c_proj", "run.dir=/tmp/x y",
                             "rl.temperature=0.5", "rl.max_prompt_tokens=null"])
    assert (cfg.sft.lr, cfg.rl.stop, cfg.model.lora_targets, cfg.run.dir) == (1e-4, ["a", "b"], ["c_attn", "c_proj"],
                                                                              "/tmp/x y")
    assert (cfg.rl.temperature, cfg.rl.max_prompt_tokens) == (0.5, None)


def test_a_gzip_file_is_one_line_naming_the_fix(tmp_path):
    path = tmp_path / "c.yaml.gz"
    path.write_bytes(gzip.compress(b"sft:\n  lr: 1.0e-4\n"))
    line = refused(path)
    assert "gzip-compressed, not YAML text" in line and "gunzip" in line


@pytest.mark.parametrize("raw,what", [
    (b"sft:\n  lr: 1.0e-4\n\x00\x01\x02", "a binary file, not YAML text (a NUL byte at line 3)"),
    (b"sft:\n  lr: 1.0e-4\nrun:\n  dir: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at line 4)"),
    (b"PK\x03\x04rest of a zip", "is a zip archive"),
])
def test_binary_and_non_utf8_files_are_one_line(tmp_path, raw, what):
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    assert what in refused(path)


def test_a_file_over_the_size_cap_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")
    assert "not a config" in refused(path)


def test_the_cli_prints_one_line_for_a_gzip_config(tmp_path, capsys):
    path = tmp_path / "c.yaml.gz"
    path.write_bytes(gzip.compress(b"sft:\n  lr: 1.0e-4\n"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("rlfuse validate: config error: config:")


def test_the_api_refuses_a_duplicate_key_config_before_the_stage(tmp_path):
    # rlfuse.train_sft reads run.dir from the file before it builds the config
    from rlfuse import api

    with pytest.raises(ConfigError, match="key 'sft' is given twice"):
        api.train_sft(write(tmp_path, "sft:\n  lr: 1.0e-4\nsft:\n  steps: 2\n"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_folder_given_as_the_config_is_one_line(tmp_path):
    assert "is a folder, not a YAML file" in refused(tmp_path)
