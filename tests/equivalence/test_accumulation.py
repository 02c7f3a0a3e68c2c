"""Gradient accumulation must not change the gradient: micro-batches 1x8 equal 8x1 (TRL's invariant test)."""

import torch

from rlfuse.algos.losses import pairwise_reward_loss, sft_loss
from rlfuse.data.collate import encode_sft, pair_batch, sft_batch
from rlfuse.data.sources import TextExample
from rlfuse.models.load import load_causal_lm, load_reward_model, load_tokenizer


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sft_micro_batches_1x8_equal_8x1(tiny_task):
    tok = load_tokenizer(str(tiny_task.model_dir))
    items = [encode_sft(tok, TextExample("", r), 64, False) for r in tiny_task.reviews()[:8]]
    n = sum(sum(1 for l in lab[1:] if l != -100) for _, lab in items)
    result = []
    for micro in (8, 1):
        model = load_causal_lm(str(tiny_task.model_dir))
        for s in range(0, 8, micro):
            b = sft_batch(items[s: s + micro], tok.pad_token_id)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            sft_loss(logits, b["labels"], normalizer=n).backward()
        result.append(grads(model))
    assert result[0].keys() == result[1].keys()
    for k in result[0]:
        torch.testing.assert_close(result[0][k], result[1][k])


def test_rm_micro_batches_1x8_equal_8x1(tiny_task):
    from rlfuse.data.collate import encode_reward_text

    tok = load_tokenizer(str(tiny_task.model_dir))
    reviews = tiny_task.reviews()
    items = [(encode_reward_text(tok, "", reviews[i], 64), encode_reward_text(tok, "", reviews[i + 8], 64)) for i in range(8)]
    result = []
    for micro in (8, 1):
        model = load_reward_model(str(tiny_task.model_dir), pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model.score.weight.data.normal_()
        for s in range(0, 8, micro):
            b = pair_batch(items[s: s + micro], tok.pad_token_id)
            r = model(**b).logits.squeeze(-1)
            k = len(items[s: s + micro])
            (pairwise_reward_loss(r[:k], r[k:]) * k / 8).backward()
        result.append(grads(model))
    for k in result[0]:
        torch.testing.assert_close(result[0][k], result[1][k])
