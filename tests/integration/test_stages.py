"""SFT and RM on the tiny default task and on the real shared data, through the CLI as a user runs them."""

import csv
import json

import pytest
import torch

from conftest import TINY
from helpers import HH_JSONL, IMDB_CSV, make_tiny_model
from rlfuse.cli import main
from rlfuse.data.collate import encode_sft
from rlfuse.models.load import load_causal_lm, load_reward_model, load_tokenizer


def held_out_loss(model, items) -> float:
    """Next-token cross-entropy per labelled token over (ids, labels) items, one unpadded sequence at a time, in plain
    torch (the trainers' batching and losses not involved)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in items:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            target = torch.tensor(labels[1:])
            keep = target != -100
            total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


def pair_scores(model, items) -> torch.Tensor:
    """(chosen - rejected) score of each (chosen ids, rejected ids) pair, each text alone, unpadded."""
    with torch.no_grad():
        score = lambda ids: float(model(input_ids=torch.tensor([ids])).logits[0, 0])
        return torch.tensor([score(c) - score(r) for c, r in items])


def test_the_sft_trainer_lowers_the_held_out_loss(tiny_task, tmp_path):
    """train_sft (6 steps of 8 reviews, TINY) lowers the held-out loss: the untrained model's, computed here over the
    stage's own held-out reviews, is above the trainer's evaluation at step 3, which is above its evaluation at step
    6; and the summary's loss is the saved model's on those reviews. (It replaces a test of torch's AdamW on a batch of
    its own, which no bug in the trainer could fail.)"""
    from rlfuse.config import load_config
    from rlfuse.data.stages import sft_examples
    from rlfuse.trainers.sft import train_sft

    cfg = load_config(None, [*TINY, "sft.eval_samples=0", "sft.eval_every=3"])
    train_sft(cfg, tmp_path, log=lambda *_: None)
    tok = load_tokenizer(str(tiny_task.model_dir))
    held = [encode_sft(tok, ex, cfg.data.max_length, cfg.sft.completion_only)
            for ex in sft_examples(cfg, tiny_task, log=lambda *_: None)[1]][:512]
    untrained = held_out_loss(load_causal_lm(str(tiny_task.model_dir)).eval(), held)
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    # measured: 6.94 untrained, 6.88 and 6.71 after steps 3 and 6
    assert len(evals) == 2 and untrained > evals[0] > evals[1] + 0.05, (untrained, evals)
    trained = held_out_loss(load_causal_lm(str(tmp_path / "sft" / "model")).eval(), held)
    assert json.loads((tmp_path / "sft" / "summary.json").read_text())["val_loss"] == pytest.approx(trained, rel=1e-4)


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
    """SFT (LoRA) then the reward model on the real IMDb file: the SFT adapter trained (its B matrices moved off zero)
    and lowered the held-out loss below the base model's; the summaries' held-out loss, accuracy and margin are what
    the saved models give, recomputed here one text at a time in plain transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlfuse.config import load_config
    from rlfuse.data.collate import encode_pair
    from rlfuse.data.stages import preference_pairs, sft_examples

    args = ["configs/imdb_distilgpt2.yaml", f"model.name={tiny_real_model}", f"data.path={IMDB_CSV}",
            f"run.dir={tmp_path}", *REAL, "sft.lr=5e-3", "sft.warmup_steps=1"]
    assert main(["sft", *args]) == 0
    assert (tmp_path / "sft" / "adapter" / "adapter_config.json").exists()  # the LoRA adapter, beside...
    assert (tmp_path / "sft" / "model" / "config.json").exists()  # ...the merged model
    adapter = load_file(str(tmp_path / "sft" / "adapter" / "adapter_model.safetensors"))
    b = [t for n, t in adapter.items() if "lora_B" in n]
    assert b and all(t.abs().max() > 0 for t in b)  # peft starts every B at zero: each one trained
    cfg = load_config(args[0], args[1:])
    tok = load_tokenizer(str(tmp_path / "sft" / "model"))
    held = [encode_sft(tok, ex, cfg.data.max_length, cfg.sft.completion_only)
            for ex in sft_examples(cfg, None, log=lambda *_: None)[1]][:512]
    sft = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "model", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_real_model, dtype=torch.float32).eval()
    val = json.loads((tmp_path / "sft" / "summary.json").read_text())["val_loss"]
    assert val == pytest.approx(held_out_loss(sft, held), rel=1e-4)
    assert val < held_out_loss(base, held) - 0.02  # measured: 5.93 against the base's 6.00

    assert main(["rm", *args]) == 0  # the reward model starts from the merged SFT model
    summary = json.loads((tmp_path / "rm" / "summary.json").read_text())
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "model", dtype=torch.float32).eval()
    pairs = [encode_pair(tok, p, cfg.rm.max_length or cfg.data.max_length)
             for p in preference_pairs(cfg, None, log=lambda *_: None)[1]][:1024]
    diff = pair_scores(rm, pairs)
    # a pair within 1e-5 of a tie may fall either way between two arithmetics: at most those can disagree
    ties = int((diff.abs() < 1e-5).sum())
    assert abs(summary["accuracy"] - float((diff > 0).float().mean())) <= ties / len(pairs) + 1e-9
    assert summary["margin"] == pytest.approx(float(diff.mean()), abs=1e-5)


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
