"""rl.train_parallel is validated eagerly (the config's fields when it loads, the placement's training workers and
the models' layers in plan.resolve, before a run): each pipeline mode that cannot run says so in one line naming the
field and the fix."""

import pytest

from rlfuse.config import load_config
from rlfuse.errors import ConfigError
from rlfuse.plan.resolve import resolve

RAY2 = ["placement.strategy=flattened", "placement.workers=2"]


def config(*overrides):
    return resolve(load_config(None, ["model.n_layer=2", *overrides]))


@pytest.mark.parametrize("overrides,problem", [
    (["rl.train_parallel=pipeline_fused"], "placement.strategy=single gives 1"),
    (["rl.train_parallel=pipeline_serial", *RAY2[:1], "placement.workers=3"], "policy's 2 layers cannot be cut into 3 stages"),
    (["rl.train_parallel=pipeline_fused", *RAY2, "rl.algo=grpo", "rl.k=2"], "a separate critic"),
    (["rl.train_parallel=pipeline_fused", *RAY2, "rl.critic_init=actor"], "a separate critic"),
    (["rl.train_parallel=pipeline_fused", *RAY2, "model.lora=true"], "no LoRA"),
    (["rl.train_parallel=single", *RAY2], "trains on Ray workers"),
    (["rl.train_parallel=tensor"], "not one of single, data, fsdp, pipeline_serial, pipeline_fused"),
    (["rl.train_parallel=fsdp"], "placement.strategy=single trains in one process"),
    (["rl.train_parallel=fsdp", "placement.strategy=separated", "placement.workers=2"], "separated gives 1"),
])
def test_a_pipeline_that_cannot_run_is_refused_in_one_line(overrides, problem):
    with pytest.raises(ConfigError, match="rl.train_parallel") as e:
        config(*overrides)
    assert problem in str(e.value) and "\n" not in str(e.value)


def test_runnable_settings_pass():
    assert config("rl.train_parallel=pipeline_fused", *RAY2).rl.train_parallel == "pipeline_fused"
    assert config("rl.train_parallel=pipeline_serial", *RAY2).rl.train_parallel == "pipeline_serial"
    assert config().rl.train_parallel == "data"
    assert config("rl.train_parallel=fsdp", *RAY2, "model.lora=true").rl.train_parallel == "fsdp"
