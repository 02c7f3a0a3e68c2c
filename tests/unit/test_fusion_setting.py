"""rollout.fusion: auto (the default) | true | false, validated when the config loads; auto is off in one process."""

import pytest

from rlfuse.config import fusion_on, load_config
from rlfuse.errors import ConfigError


def test_default_is_auto_and_off_in_one_process():
    cfg = load_config(None)
    assert cfg.rollout.fusion == "auto" and fusion_on(cfg) is False


@pytest.mark.parametrize("value,on", [("true", True), ("false", False), ("auto", False)])
def test_explicit_values_are_kept(value, on):
    assert fusion_on(load_config(None, [f"rollout.fusion={value}"])) is on


def test_the_shipped_yaml_uses_auto():
    from conftest import ROOT

    assert load_config(ROOT / "configs" / "default.yaml").rollout.fusion == "auto"


@pytest.mark.parametrize("value", ["sometimes", "1", "0.5", "[true]"])
def test_a_bad_value_names_the_field_and_the_fix(value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"rollout.fusion={value}"])
    assert "rollout.fusion" in str(e.value) and "auto" in str(e.value)
