"""SFT and RM on the tiny default task and on the real shared data, through the CLI as a user runs them."""

import csv
import json

import pytest
import torch

from conftest import TINY
from helpers import HH_JSONL, IMDB_CSV, make_tiny_model
from rlfuse.algos.losses import sft_loss
from rlfuse.cli import main
from rlfuse.data.collate import encode_sft, sft_batch
from rlfuse.data.sources import TextExample
from rlfuse.models.load import load_causal_lm, load_reward_model, load_tokenizer


def test_sft_step_lowers_loss_on_a_fixed_batch(tiny_task):
    tok = load_tokenizer(str(tiny_task.model_dir))
    model = load_causal_lm(str(tiny_task.model_dir))
    batch = sft_batch([encode_sft(tok, TextExample("", r), 64, False) for r in tiny_task.reviews()[:8]], tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = sft_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[2] < losses[0]


def test_run_writes_sft_and_rm_into_one_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # the RL stage runs too, kept short: this test is about the SFT and RM outputs
    assert main(["run", f"run.dir={run_dir}", *TINY, "rl.iterations=2", "rl.prompts_per_iter=16",
                 "rl.eval_prompts=8"]) == 0
    assert f"run folder: {run_dir}" in capsys.readouterr().out
    assert (run_dir / "config.yaml").exists()
    for stage in ("sft", "rm"):
        assert (run_dir / stage / "model" / "config.json").exists()
        rows = [json.loads(l) for l in (run_dir / stage / "metrics.jsonl").read_text().splitlines()]
        assert rows and "train/loss" in rows[0]
    sft = json.loads((run_dir / "sft" / "summary.json").read_text())
    assert sft["perplexity"] > 1 and 0 <= sft["grammatical_rate"] <= 1
    rm = json.loads((run_dir / "rm" / "summary.json").read_text())
    assert 0 <= rm["accuracy"] <= 1
    # the reward model loads back as a scalar-head model
    m = load_reward_model(str(run_dir / "rm" / "model"))
    assert m.config.num_labels == 1


def test_rm_without_sft_says_what_to_do(tmp_path, capsys):
    assert main(["rm", f"run.dir={tmp_path}", *TINY]) == 2
    err = capsys.readouterr().err
    assert "rm.init" in err and "rm.sft_path" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_real_model(tmp_path_factory):
    if not IMDB_CSV.exists():
        pytest.skip(f"shared data file {IMDB_CSV} not present")
    texts = [r["review"] for r in csv.DictReader(IMDB_CSV.open(encoding="utf-8"))][:200]
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), texts)


REAL = ["data.max_length=64", "sft.steps=3", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.eval_every=3",
        "rm.steps=3", "rm.batch_size=4", "rm.micro_batch_size=2", "rm.eval_every=3", "rm.num_pairs=40",
        "data.max_examples=200", "run.quiet=true"]


def test_sft_then_rm_on_real_imdb_with_lora(tiny_real_model, tmp_path):
    args = ["configs/imdb_distilgpt2.yaml", f"model.name={tiny_real_model}", f"data.path={IMDB_CSV}",
            f"run.dir={tmp_path}", *REAL]
    assert main(["sft", *args]) == 0
    assert (tmp_path / "sft" / "adapter" / "adapter_config.json").exists()  # the LoRA adapter, beside...
    assert (tmp_path / "sft" / "model" / "config.json").exists()  # ...the merged model
    assert main(["rm", *args]) == 0  # the reward model starts from the merged SFT model
    assert json.loads((tmp_path / "rm" / "summary.json").read_text())["accuracy"] >= 0


def test_rm_on_real_hh_rlhf(tiny_real_model, tmp_path, capsys):
    if not HH_JSONL.exists():
        pytest.skip(f"shared data file {HH_JSONL} not present")
    args = ["configs/hh_rlhf.yaml", f"model.name={tiny_real_model}", f"data.path={HH_JSONL}", f"run.dir={tmp_path}",
            "rm.init=base", "model.lora=false", *REAL]
    assert main(["rm", *args, "rm.max_length=100000"]) == 2  # beyond the model's context: the field and the fix
    assert "rm.max_length" in capsys.readouterr().err
    assert main(["rm", *args, "rm.max_length=48"]) == 0  # the RM's own length, shorter than SFT's data.max_length
    assert "held-out pairs of at most 48 tokens a side" in capsys.readouterr().err
    assert main(["sft", *args]) == 0  # completion-only on the assistant turns
