"""Prompt budget and left truncation, with numbers a person can check."""

import pytest
from transformers import GPT2Config, LlamaConfig

from rlfuse.config import RLConfig
from rlfuse.data.prompts import check_max_length, encode_prompts, model_context, prompt_budget
from rlfuse.errors import ConfigError


class CharTokenizer:
    """One token per character (id = ord), BOS 1, added by collate.encode as for GPT-2."""
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_model_context_reads_each_architectures_field():
    assert model_context(GPT2Config(n_positions=128)) == 128
    assert model_context(LlamaConfig(max_position_embeddings=4096)) == 4096
    assert model_context(object()) is None


def test_default_budget_is_context_minus_new_tokens():
    assert prompt_budget(RLConfig(max_new_tokens=16), 128) == 112
    assert prompt_budget(RLConfig(max_new_tokens=16, max_prompt_tokens=100), 128) == 100
    assert prompt_budget(RLConfig(max_new_tokens=16, max_prompt_tokens=112), 128) == 112  # exactly full


def test_budget_over_the_context_names_both_fields_and_the_context():
    with pytest.raises(ConfigError) as err:
        prompt_budget(RLConfig(max_new_tokens=16, max_prompt_tokens=113), 128)
    msg = str(err.value)
    assert "rl.max_prompt_tokens=113" in msg and "rl.max_new_tokens=16" in msg and "129" in msg and "128" in msg
    assert "112" in msg  # the fix gives the largest budget that fits


def test_new_tokens_alone_filling_the_context_is_an_error():
    with pytest.raises(ConfigError, match=r"rl\.max_new_tokens=128 leaves no room .* context of 128"):
        prompt_budget(RLConfig(max_new_tokens=128), 128)
    assert prompt_budget(RLConfig(max_new_tokens=127), 128) == 1


def test_unknown_context_needs_an_explicit_budget():
    assert prompt_budget(RLConfig(max_prompt_tokens=50), None) == 50
    with pytest.raises(ConfigError, match="rl.max_prompt_tokens"):
        prompt_budget(RLConfig(), None)


def test_long_prompts_keep_bos_and_their_end():
    ids, cut = encode_prompts(CharTokenizer(), ["abcdefgh", "xy", "abcde"], max_tokens=4)
    # "abcdefgh" -> BOS + 8 chars = 9 tokens -> BOS + last 3 ("fgh"); "xy" -> 3 tokens, untouched;
    # "abcde" -> 6 tokens -> BOS + "cde"
    assert ids == [[1, 102, 103, 104], [1, 120, 121], [1, 99, 100, 101]]
    assert cut == 2
    assert all(len(i) <= 4 for i in ids)


def test_prompt_at_the_budget_is_not_cut():
    ids, cut = encode_prompts(CharTokenizer(), ["abc"], max_tokens=4)
    assert ids == [[1, 97, 98, 99]] and cut == 0


def test_budget_of_one_keeps_the_last_token():
    ids, cut = encode_prompts(CharTokenizer(), ["abc"], max_tokens=1)
    assert ids == [[99]] and cut == 1


def test_max_length_over_the_context_is_a_config_error():
    check_max_length(128, 128)
    check_max_length(512, None)
    with pytest.raises(ConfigError, match=r"data\.max_length: 512 exceeds the model's context of 128 tokens.*128"):
        check_max_length(512, 128)
