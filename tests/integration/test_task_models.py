import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rlfuse.config import load_config
from rlfuse.data.task import build_default_task


def test_task_is_cached(tiny_task):
    again = build_default_task(400, 0, 2, 64, 2, log=lambda *_: (_ for _ in ()).throw(AssertionError("rebuilt")))
    assert again.root == tiny_task.root


def test_tokenizer_round_trips_through_auto(tiny_task, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_task.tokenizer_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    text = "the acting was very good, but the plot was dull."
    assert tok.decode(tok(text)["input_ids"]) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == tok(text)["input_ids"] and again.pad_token == "<pad>"


def test_model_round_trips_through_save_pretrained(tiny_task, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_task.model_dir)
    assert model.config.model_type == "gpt2" and model.config.n_layer == 2
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[0, 5, 9, 11]])
    torch.testing.assert_close(model(ids).logits, again(ids).logits)


def test_lora_targets_gpt2_modules(tiny_task):
    from rlfuse.models.load import load_causal_lm

    cfg = load_config(None, ["model.lora=true"]).model
    model = load_causal_lm(str(tiny_task.model_dir), cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert {n.split(".")[-4] for n in names} == {"c_attn", "c_proj", "c_fc"}
