"""run.report_to: each tracker's sink on a fake of its package (none is needed installed), the one-line message for a
tracker that is not installed, TensorBoard scalars and text; reward/frac_zero_spread on hand-computed groups."""

import json
import sys
import types

import pytest
import torch

from rlfuse.algos.stats import zero_spread_fraction
from rlfuse.cli import main
from rlfuse.config import load_config
from rlfuse.errors import ConfigError
from rlfuse.metrics.tracker import JsonlTracker, markdown_table, open_sinks, read_metrics, stage_tracker


def fake_wandb_like(name: str, calls: list) -> types.ModuleType:
    """A module with wandb's (and trackio's) init / run.log / Table / run.finish, recording each call."""
    mod = types.ModuleType(name)

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    mod.init, mod.Table = init, Table
    return mod


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_sinks_get_scalars_tables_and_finish(tmp_path, monkeypatch, name):
    calls = []
    monkeypatch.setitem(sys.modules, name, fake_wandb_like(name, calls))
    stage = tmp_path / "myrun" / "rl"
    t = JsonlTracker(stage / "metrics.jsonl", sinks=open_sinks([name], stage, config={"rl": {"lr": 0.1}}))
    t.log(1, **{"reward/mean": torch.tensor(0.5), "note": "text", "bad": float("nan")})
    t.log_table(1, "samples", [{"prompt": "a", "completion": "b", "reward": 1.0}])
    t.close()
    init = calls[0][1]
    assert calls[0][0] == "init" and init["name"] == "myrun-rl" and init["config"] == {"rl": {"lr": 0.1}}
    assert init["project"] == "rlfuse"
    assert calls[1] == ("log", 1, {"reward/mean": 0.5})  # numbers only, finite only
    table = calls[2][2]["samples"]
    assert calls[2][:2] == ("log", 1) and table.columns == ["prompt", "completion", "reward"]
    assert table.data == [["a", "b", 1.0]] and calls[3] == ("finish",)
    assert json.loads((stage / "samples.jsonl").read_text()) == {"step": 1, "prompt": "a", "completion": "b",
                                                                 "reward": 1.0}


def test_mlflow_sink_logs_params_metrics_and_table_artifacts(tmp_path, monkeypatch):
    calls = []
    mod = types.ModuleType("mlflow")
    mod.start_run = lambda run_name: calls.append(("start", run_name))
    mod.log_params = lambda params: calls.append(("params", params))
    mod.log_metrics = lambda metrics, step: calls.append(("metrics", step, metrics))
    mod.log_table = lambda data, artifact_file: calls.append(("table", artifact_file, data))
    mod.end_run = lambda: calls.append(("end",))
    monkeypatch.setitem(sys.modules, "mlflow", mod)
    stage = tmp_path / "r" / "sft"
    t = JsonlTracker(stage / "metrics.jsonl", sinks=open_sinks(["mlflow"], stage, config={"sft": {"lr": 0.002}}))
    t.log(3, **{"train/loss": 1.5})
    t.log_table(3, "samples", [{"prompt": "p", "reward": 2.0}])
    t.close()
    assert calls == [("start", "r-sft"), ("params", {"sft.lr": "0.002"}), ("metrics", 3, {"train/loss": 1.5}),
                     ("table", "samples/step_000003.json", {"prompt": ["p"], "reward": [2.0]}), ("end",)]


def test_a_tracker_that_is_not_installed_says_which_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now fails, as when it is not installed
    with pytest.raises(ConfigError, match=r"run.report_to: wandb is not installed; pip install wandb"):
        load_config(None, ["run.report_to=[tensorboard,wandb]"])
    assert main(["validate", "run.report_to=[wandb]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install wandb" in err
    with pytest.raises(ConfigError, match="pip install wandb"):  # a sink opened without validate says the same
        open_sinks(["wandb"], tmp_path / "run" / "rl")
    with pytest.raises(ConfigError, match="run.report_to: 'neptune' is not one of tensorboard, wandb"):
        load_config(None, ["run.report_to=[neptune]"])


def test_tensorboard_sink_writes_scalars_and_the_sample_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stage = tmp_path / "run" / "rl"
    t = JsonlTracker(stage / "metrics.jsonl", sinks=open_sinks(["tensorboard"], stage))
    t.log(1, **{"reward/mean": 0.25})
    t.log_table(1, "samples", [{"prompt": "a|b", "completion": "c\nd"}])
    t.close()
    acc = EventAccumulator(str(stage / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.25]
    text = acc.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == markdown_table([{"prompt": "a|b", "completion": "c\nd"}])
    assert text.splitlines()[-1] == "| a\\|b | c d |"


def test_report_to_empty_list_writes_only_json_lines(tmp_path):
    stage = tmp_path / "run" / "sft"
    t = JsonlTracker(stage / "metrics.jsonl", sinks=open_sinks([], stage))
    t.log(1, loss=1.0)
    t.close()
    assert not (stage / "tensorboard").exists() and (stage / "metrics.jsonl").read_text().count("\n") == 1


def test_a_new_run_in_a_used_folder_starts_its_metrics_afresh(tmp_path):
    # a second run into the same folder used to append to the first one's rows (steps 1, 2, 3, 1, 2, ...)
    stage, cfg = tmp_path / "rl", load_config(None, ["run.report_to=[]"])
    first = stage_tracker(cfg, stage)
    for step in (1, 2, 3):
        first.log(step, loss=float(step))
        first.log_table(step, "samples", [{"prompt": "p", "completion": str(step)}])
    first.close()
    resumed = stage_tracker(cfg, stage, from_step=2)  # a resume from the checkpoint of step 2 logs step 3 again
    resumed.log(3, loss=30.0)
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(stage / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [r["step"] for r in read_metrics(stage / "samples.jsonl")] == [1, 2]
    second = stage_tracker(cfg, stage)
    second.log(1, loss=5.0)
    second.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(stage / "metrics.jsonl")] == [(1, 5.0)]
    assert read_metrics(stage / "samples.jsonl") == []


def test_zero_spread_fraction_by_hand():
    # groups of 2: (1, 1) no spread, (0, 2) spread, (3, 3) no spread -> 2 of 3
    assert zero_spread_fraction(torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0]), 2).item() == pytest.approx(2 / 3)
    # groups of 3: (1, 2, 3) spread, (5, 5, 5) none -> 1 of 2
    assert zero_spread_fraction(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3).item() == 0.5
    assert zero_spread_fraction(torch.tensor([1.0, 2.0, 1.0, 2.0]), 2).item() == 0.0
