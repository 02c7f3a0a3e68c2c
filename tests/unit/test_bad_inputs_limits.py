"""Quiet data loss and unbounded work: a data file whose rows mix schemas is refused with the count of each (never
two thirds of it dropped as "empty text"); `generate -n` is bounded and a long generation says how far it got; a
reward function that hangs is stopped (or at least said) after RLFUSE_REWARD_TIMEOUT_S; a stage that fails before
writing anything of use leaves no stage folder behind, so the same command runs again without --overwrite."""

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlfuse import api
from rlfuse.config import load_config
from rlfuse.data.sources import imdb_reviews
from rlfuse.data.stages import preference_pairs, rl_prompts, sft_examples
from rlfuse.errors import DataError, UserError
from rlfuse.models import rewards
from rlfuse.models.rewards import FunctionReward
from rlfuse.runs import claim_run_folder

# ------------------------------------------------------------------------------------------ mixed schemas


def mixed_jsonl(tmp_path: Path) -> Path:
    """300 rows: a third each of prompt + completion, text, and chosen + rejected rows (interleaved)."""
    rows = []
    for i in range(100):
        rows += [{"prompt": f"question {i}", "completion": f"answer {i}"}, {"text": f"a review number {i}"},
                 {"chosen": f"good reply {i}", "rejected": f"bad reply {i}"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("stage", [sft_examples, preference_pairs, rl_prompts])
def test_rows_of_mixed_schemas_are_counted_and_refused_not_dropped_as_empty(tmp_path, stage):
    cfg = load_config(None, ["data.kind=jsonl", f"data.path={mixed_jsonl(tmp_path)}"])
    with pytest.raises(DataError) as e:
        stage(cfg, None, log=lambda *_: None)
    msg = str(e.value)
    assert "empty text" not in msg
    assert "300 rows" in msg and "100 with prompt + completion (first: row 1)" in msg
    assert "100 with text (first: row 2)" in msg and "100 with chosen + rejected (first: row 3)" in msg


def test_a_column_only_some_rows_have_is_named_with_the_count(tmp_path):
    path = tmp_path / "reviews.jsonl"
    rows = [{"review": "good film", "sentiment": "positive"}, {"text": "bad film", "label": 0}] * 20
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"column 'review' is missing from 20 of 40 rows \(first: row 2, whose columns "
                                        r"are text, label\)"):
        imdb_reviews(load_config(None, ["data.kind=imdb", f"data.path={path}"]), log=lambda *_: None)


def test_rows_of_one_schema_with_extra_columns_still_load(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"q {i}", "completion": f"a {i}", **({"answer": str(i)} if i % 2 else {})} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held = sft_examples(load_config(None, ["data.kind=jsonl", f"data.path={path}"]), None, log=lambda *_: None)
    assert len(train) + len(held) == 40


# ------------------------------------------------------------------------------------------ generate -n


def test_generate_n_has_an_upper_bound():
    with pytest.raises(UserError, match=rf"-n {api.GENERATE_MAX_N + 1}: samples per prompt must be between 1 and "
                                        rf"{api.GENERATE_MAX_N}"):
        api.generate("/no/model/is/loaded", "hi", n=api.GENERATE_MAX_N + 1)


def test_a_long_generation_says_how_far_it_got(tmp_path, monkeypatch):
    from rlfuse.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", ["the movie was good", "a bad film"] * 30)
    monkeypatch.setattr(api, "GENERATE_PROGRESS_S", 0.0)
    lines = []
    out = api.generate(model, ["the movie"], n=3, max_new_tokens=4, log=lines.append)
    assert len(out[0]) == 3
    assert lines and lines[0].startswith("[generate] 1/3 samples in "), lines


# ------------------------------------------------------------------------------------------ reward timeout


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@dataclass
class Sample:
    prompt_ids: list
    token_ids: list


def sleeps(prompts, completions, **_):
    time.sleep(30)
    return [1.0] * len(completions)


def sleeps_and_swallows(prompts, completions, **_):
    try:
        time.sleep(30)
    except Exception:  # a function's own broad except must not swallow the time limit
        pass
    return [1.0] * len(completions)


@pytest.mark.parametrize("fn", [sleeps, sleeps_and_swallows])
def test_a_reward_function_that_hangs_is_stopped_with_one_line(monkeypatch, fn):
    monkeypatch.setenv("RLFUSE_REWARD_TIMEOUT_S", "0.5")
    reward = FunctionReward([fn], None, Tok())
    t0 = time.monotonic()
    with pytest.raises(UserError, match=rf"rl.reward: {fn.__name__}, called on 2 completions, did not return within "
                                        r"0.5 s \(RLFUSE_REWARD_TIMEOUT_S\)"):
        reward([Sample([1], [2]), Sample([1], [3])])
    assert time.monotonic() - t0 < 10


def test_the_time_limit_is_gone_after_the_call(monkeypatch):
    import signal

    monkeypatch.setenv("RLFUSE_REWARD_TIMEOUT_S", "0.3")
    reward = FunctionReward([lambda prompts, completions: [0.5] * len(completions)], None, Tok())
    assert reward([Sample([1], [2])]).tolist() == [0.5]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    time.sleep(0.5)  # no alarm left to fire


def test_off_the_main_thread_a_slow_function_is_said_on_stderr(monkeypatch, capsys):
    monkeypatch.setenv("RLFUSE_REWARD_TIMEOUT_S", "0.2")

    def slow(prompts, completions):
        time.sleep(0.6)
        return [1.0] * len(completions)

    out = []
    worker = threading.Thread(target=lambda: out.append(FunctionReward([slow], None, Tok())([Sample([1], [2])])))
    worker.start()
    worker.join()
    assert out and out[0].tolist() == [1.0]  # not stopped (no signal off the main thread), but said
    err = capsys.readouterr().err
    assert re.search(r"reward function slow has run for \d+ s on 1 completions; past 0.2 s it runs on", err), err


def test_a_bad_timeout_setting_is_one_line(monkeypatch):
    monkeypatch.setenv("RLFUSE_REWARD_TIMEOUT_S", "soon")
    with pytest.raises(UserError, match="RLFUSE_REWARD_TIMEOUT_S='soon' is not a number of seconds"):
        rewards.reward_timeout_s()
    monkeypatch.setenv("RLFUSE_REWARD_TIMEOUT_S", "0")
    assert rewards.reward_timeout_s() is None


# ------------------------------------------------------------------------------------------ stage folders


def finished_sft(run: Path) -> None:
    (run / "sft" / "model").mkdir(parents=True)
    (run / "sft" / "model" / "config.json").write_text("{}")
    (run / "sft" / "summary.json").write_text("{}")
    (run / "config.yaml").write_text("run: {}\n")


def fail_in_stage(run: Path, command: str, write, **kwargs) -> None:
    with pytest.raises(RuntimeError, match="placement failed"):
        with claim_run_folder(run, command, log=lambda *_: None, **kwargs) as folder:
            write(folder)
            raise RuntimeError("placement failed")


def starting_files(folder: Path, stage: str = "rl") -> None:
    """What the RL stage writes before its first iteration: its evaluation before RL, the layout chosen, an empty
    metrics file."""
    (folder / stage).mkdir(exist_ok=True)
    (folder / stage / "eval_before.json").write_text("{}")
    (folder / stage / "weight_layout.txt").write_text("row\n")
    (folder / stage / "metrics.jsonl").write_text("")


def test_a_stage_that_fails_before_writing_anything_of_use_leaves_no_folder(tmp_path):
    run = tmp_path / "run"
    finished_sft(run)
    fail_in_stage(run, "rl", starting_files)
    assert not (run / "rl").exists() and (run / "sft" / "model" / "config.json").is_file()
    with claim_run_folder(run, "rl", log=lambda *_: None):  # the same command again, without --overwrite
        pass


@pytest.mark.parametrize("useful", ["checkpoint.pt", "metrics.jsonl", "model/config.json", "checkpoint.pt.shards-3/x"])
def test_a_stage_with_something_of_use_is_kept(tmp_path, useful):
    run = tmp_path / "run"
    finished_sft(run)

    def write(folder):
        starting_files(folder)
        (folder / "rl" / useful).parent.mkdir(parents=True, exist_ok=True)
        (folder / "rl" / useful).write_text('{"step": 1}\n')

    fail_in_stage(run, "rl", write)
    assert (run / "rl" / useful).is_file()


def test_a_failed_resume_keeps_the_other_stages_and_a_failed_sft_goes(tmp_path):
    run = tmp_path / "run"
    finished_sft(run)
    fail_in_stage(run, "run", lambda folder: starting_files(folder, "rm"), resume=True)
    assert not (run / "rm").exists() and (run / "sft" / "summary.json").is_file()


def test_a_refused_run_leaves_the_earlier_stage_as_it_was(tmp_path):
    run = tmp_path / "run"
    finished_sft(run)
    starting_files(run)  # an earlier, killed RL run's start: refused, not removed by the refusal
    with pytest.raises(UserError, match="already holds an earlier run"):
        with claim_run_folder(run, "rl", log=lambda *_: None):
            pass
    assert (run / "rl" / "eval_before.json").is_file()
