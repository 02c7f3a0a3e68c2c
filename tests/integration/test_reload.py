"""Every saved model reloads as what was trained: SFT and reward model, with and without LoRA, in plain transformers,
as base + adapter in peft, and through rlfuse's loaders; nothing saved refers to a folder that is gone."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY
from helpers import adapter_bases, assert_reloads
from rlfuse.config import load_config
from rlfuse.errors import UserError
from rlfuse.models.load import (apply_lora, load_causal_lm, load_reward_model, save_trained_model,
                                load_tokenizer)
from rlfuse.trainers.rm import train_rm
from rlfuse.trainers.sft import train_sft

FAST = [*TINY, "sft.eval_samples=0", "sft.steps=4", "rm.steps=3", "sft.lr=1e-2", "rm.lr=1e-2", "sft.eval_every=100",
        "rm.eval_every=100"]


@pytest.fixture(scope="module", params=[False, True], ids=["full", "lora"])
def trained(request, tmp_path_factory, tiny_task):
    """SFT then the reward model on the tiny task, with the in-memory models as training left them."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [*FAST, f"run.dir={run_dir}", f"model.lora={str(request.param).lower()}"])
    models = {}
    train_sft(cfg, run_dir, log=lambda *_: None, on_trained=lambda m: models.__setitem__("sft", m))
    train_rm(cfg, run_dir, log=lambda *_: None, on_trained=lambda m: models.__setitem__("rm", m))
    return request.param, run_dir, models, tiny_task


def test_sft_reloads_as_trained(trained):
    lora, run_dir, models, task = trained
    assert (run_dir / "sft" / "adapter").exists() == lora
    assert_reloads(models["sft"], run_dir / "sft", "causal")
    # training moved the model, so the equality above is not the base model's equality with itself
    base = load_causal_lm(str(task.model_dir)).eval()
    ids = torch.tensor([[0, 5, 9, 11]])
    with torch.no_grad():
        moved = (models["sft"].eval()(input_ids=ids).logits - base(input_ids=ids).logits).abs().max()
    assert moved > 1e-3


def test_rm_reloads_as_trained(trained):
    lora, run_dir, models, _ = trained
    assert (run_dir / "rm" / "adapter").exists() == lora
    assert_reloads(models["rm"], run_dir / "rm", "reward")


def test_nothing_saved_refers_to_a_missing_folder(trained):
    lora, run_dir, _, task = trained
    bases = adapter_bases(run_dir)
    assert bool(bases) == lora
    for adapter, base in bases.items():
        assert Path(base).is_dir(), f"{adapter} names {base}, which does not exist"
    if lora:  # each stage builds on the one before: SFT on the base model, the reward model on SFT's merged model
        assert bases[str(run_dir / "sft" / "adapter")] == str(Path(task.model_dir).resolve())
        assert bases[str(run_dir / "rm" / "adapter")] == str((run_dir / "sft" / "model").resolve())
    for stage in ("sft", "rm"):
        assert not (run_dir / stage / "model" / "adapter_config.json").exists()  # model/ is plain transformers


def test_saving_does_not_change_the_model(tiny_task, tmp_path):
    cfg = load_config(None, ["model.lora=true"])
    model = apply_lora(load_causal_lm(str(tiny_task.model_dir)), cfg.model)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)  # a non-zero delta to merge
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_trained_model(model, load_tokenizer(str(tiny_task.model_dir)), tmp_path / "stage", base=str(tiny_task.model_dir))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert_reloads(model, tmp_path / "stage", "causal")


def test_a_wrong_merge_is_caught(tiny_task, tmp_path):
    """assert_reloads can fail: the adapter is saved, then changed in memory."""
    cfg = load_config(None, ["model.lora=true"])
    model = apply_lora(load_causal_lm(str(tiny_task.model_dir)), cfg.model)
    save_trained_model(model, load_tokenizer(str(tiny_task.model_dir)), tmp_path / "stage", base=str(tiny_task.model_dir))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    with pytest.raises(AssertionError, match="reloaded as plain transformers"):
        assert_reloads(model, tmp_path / "stage", "causal")


def test_adapter_with_deleted_base_names_the_base_and_the_fix(tiny_task, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_task.model_dir, base)
    model = apply_lora(load_causal_lm(str(base)), load_config(None, ["model.lora=true"]).model)
    save_trained_model(model, load_tokenizer(str(base)), tmp_path / "sft", base=str(base))
    shutil.rmtree(base)
    with pytest.raises(UserError) as err:
        load_reward_model(str(tmp_path / "sft" / "adapter"))
    msg = str(err.value)
    assert str(tmp_path / "sft" / "adapter") in msg and str(base) in msg and "no longer exists" in msg
    assert "model/" in msg  # the fix: load the merged folder saved beside it
    assert load_reward_model(str(tmp_path / "sft" / "model")).config.num_labels == 1  # which still works


def test_folder_without_config_says_so(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"has no config\.json") as err:
        load_causal_lm(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_missing_folder_says_so(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_load_error_carries_the_real_cause(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(UserError) as err:
        load_causal_lm(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "model_type" in msg  # transformers' own first line
    assert "re-run the stage that wrote this folder" in msg and "hub" not in msg


def test_unreachable_hub_name_says_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network calls, no retries
    with pytest.raises(UserError) as err:
        load_causal_lm("no-such-org/no-such-model")
    msg = str(err.value)
    assert "'no-such-org/no-such-model'" in msg and "unreachable (offline?)" in msg and "local model folder" in msg


def test_older_adapter_only_sft_folder_still_backs_a_reward_model(tiny_task, tmp_path):
    model = apply_lora(load_causal_lm(str(tiny_task.model_dir)), load_config(None, ["model.lora=true"]).model)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(tmp_path / "old")  # adapter only, as rlfuse saved LoRA stages before
    load_tokenizer(str(tiny_task.model_dir)).save_pretrained(tmp_path / "old")
    rm = load_reward_model(str(tmp_path / "old"))
    merged = model.merge_and_unload()
    for k, v in merged.transformer.state_dict().items():
        torch.testing.assert_close(rm.transformer.state_dict()[k], v)


def test_rl_reloads_as_trained(trained):
    """The RL policy, LoRA or full: saved merged (and as an adapter on the SFT model), reloads to the in-memory
    actor's logits; the policy that was trained is the SFT policy plus what RL learned, not the raw base."""
    from rlfuse.trainers.rl import train_rl

    lora, run_dir, _, _ = trained
    cfg = load_config(None, [*FAST, f"run.dir={run_dir}", f"model.lora={str(lora).lower()}", "rl.iterations=2",
                             "rl.prompts_per_iter=4", "rl.mini_batch_size=4", "rl.micro_batch_size=2", "rl.epochs=1",
                             "rl.max_new_tokens=8", "rl.eval_prompts=4", "rl.lr=1e-2", "rl.algo=rloo", "rl.k=2"])
    held = []
    train_rl(cfg, run_dir, log=lambda *_: None, on_ready=held.append)
    actor = held[0].actor
    assert (run_dir / "rl" / "adapter").exists() == lora
    assert_reloads(actor, run_dir / "rl", "causal")
    if lora:
        assert adapter_bases(run_dir)[str(run_dir / "rl" / "adapter")] == str((run_dir / "sft" / "model").resolve())
