"""Temperature schedules: hand-computed values at the first, middle and last iterations, and the trainer's
per-iteration temperature and config checks."""

import math

import pytest

from rlfuse.algos.schedules import SCHEDULE_FNS, progress, scheduled_value
from rlfuse.config import load_config
from rlfuse.errors import ConfigError
from rlfuse.evaluation import eval_temperature
from rlfuse.trainers.rl import iteration_temperature, sampling_note


def test_progress_runs_from_first_to_last_iteration():
    assert [progress(i, 5) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert progress(0, 1) == 0.0  # a one-iteration run stays at the start value


@pytest.mark.parametrize("kind,expected", [
    ("constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
    # 1.0 + (0.6 - 1.0) * p for p = 0, 1/4, 1/2, 3/4, 1
    ("linear", [1.0, 0.9, 0.8, 0.7, 0.6]),
    # 1.0 - 0.4 * (1 - cos(pi p)) / 2: 0, 0.1464..., 0.5, 0.8535..., 1 of the way
    ("cosine", [1.0, 1.0 - 0.4 * (1 - math.sqrt(0.5)) / 2, 0.8, 1.0 - 0.4 * (1 + math.sqrt(0.5)) / 2, 0.6]),
])
def test_scheduled_values_by_hand(kind, expected):
    got = [scheduled_value(kind, 1.0, 0.6, i, 5) for i in range(5)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_a_wrong_schedule_value_fails():
    assert scheduled_value("linear", 1.0, 0.6, 2, 5) != pytest.approx(0.7, abs=1e-12)
    assert set(SCHEDULE_FNS) == {"constant", "linear", "cosine"}


def test_iteration_temperature_follows_the_config():
    rl = load_config(None, ["rl.iterations=3", "rl.temperature=1.0", "rl.temperature_schedule=linear",
                            "rl.temperature_final=0.5"]).rl
    assert [iteration_temperature(rl, i) for i in range(3)] == [1.0, 0.75, 0.5]
    assert sampling_note(rl) == "temperature 1 -> 0.5 (linear)"
    default = load_config(None, ["rl.iterations=3"]).rl
    assert [iteration_temperature(default, i) for i in range(3)] == [0.7, 0.7, 0.7]
    assert eval_temperature(default) == 0.7 and eval_temperature(rl) == 1.0  # the first iteration's
    assert eval_temperature(load_config(None, ["rl.eval_temperature=0.6"]).rl) == 0.6


@pytest.mark.parametrize("overrides,field", [
    (["rl.temperature_schedule=linear"], "rl.temperature_final"),           # where to anneal to?
    (["rl.temperature_final=0.5"], "rl.temperature_final"),                 # set but a constant schedule ignores it
    (["rl.temperature_schedule=exponential", "rl.temperature_final=0.5"], "rl.temperature_schedule"),
    (["rl.temperature_schedule=cosine", "rl.temperature_final=0"], "rl.temperature_final"),
    (["rl.eval_temperature=-1"], "rl.eval_temperature"),
    (["rl.curriculum=hardness"], "rl.curriculum"),
    (["rl.curriculum=length", "rl.curriculum_start=0"], "rl.curriculum_start"),
    (["rl.curriculum=length", "rl.curriculum_start=1.5"], "rl.curriculum_start"),
])
def test_bad_schedule_or_curriculum_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.field == field
