"""TRL's dataset formats (standard and conversational), cell checks, chat-template rendering and end-of-turn ids."""

import json

import pytest

from rlfuse.config import load_config
from rlfuse.data.chat import CHATML, end_of_turn_ids, render_completion
from rlfuse.data.collate import bos_marks_turns, encode, encode_reward_text, encode_sft
from rlfuse.data.formats import cell, detect
from rlfuse.data.prompts import encode_prompt
from rlfuse.data.sources import PreferencePair, TextExample
from rlfuse.data.stages import preference_pairs, rl_prompts, sft_examples
from rlfuse.errors import DataError

USER = [{"role": "user", "content": "How do I bake bread?"}]
REPLY = [{"role": "assistant", "content": "Mix flour and water."}]
WORSE = [{"role": "assistant", "content": "No."}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg_for(path, *extra):
    return load_config(None, ["data.kind=jsonl", f"data.path={path}", "data.eval_fraction=0.2", *extra])


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A tiny byte-level BPE tokenizer with ChatML's markers as special tokens and the ChatML template."""
    from helpers import _tiny_tokenizer

    tok = _tiny_tokenizer(["How do I bake bread? Mix flour and water. No. user assistant system"] * 20, 300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


@pytest.mark.parametrize("row, name", [
    ({"text": "a b"}, "standard language modelling"),
    ({"prompt": "a"}, "standard prompt-only"),
    ({"prompt": "a", "completion": "b"}, "standard prompt-completion"),
    ({"prompt": "a", "chosen": "b", "rejected": "c"}, "standard preference"),
    ({"messages": USER + REPLY}, "conversational messages"),
    ({"prompt": USER, "completion": REPLY}, "conversational prompt-completion"),
    ({"chosen": USER + REPLY, "rejected": USER + WORSE}, "conversational preference"),
])
def test_format_detected_per_data_set(row, name):
    assert detect([row], "x", {k: None for k in ("text", "prompt", "completion", "chosen", "rejected", "messages")}).name == name


def test_a_column_of_another_type_is_a_data_error_naming_it():
    with pytest.raises(DataError, match=r"column 'prompt', row 3: a dict is neither text nor a list of messages"):
        cell({"q": 1}, "prompt", "f.jsonl", 3)
    with pytest.raises(DataError, match=r"column 'messages', row 1: a message needs a role"):
        cell([{"role": "robot", "content": "hi"}], "messages", "f.jsonl", 1)


def test_rows_mixing_text_and_messages_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "plain", "completion": REPLY}] * 3)
    with pytest.raises(DataError, match="mixes message lists and plain text"):
        sft_examples(cfg_for(path), None, log=lambda *_: None)


def test_a_prompt_column_is_used_whole_not_cut_to_words(tmp_path):
    long = "Write a careful and detailed answer to the following question about baking bread at home"
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{long} {i}"} for i in range(10)])
    train, held = rl_prompts(cfg_for(path), None, log=lambda *_: None)
    assert sorted(train + held) == sorted(f"{long} {i}" for i in range(10))


def test_conversational_stages_keep_message_lists(tmp_path):
    rows = [{"prompt": USER, "chosen": REPLY, "rejected": WORSE}] * 6
    path = write_jsonl(tmp_path / "pref.jsonl", rows)
    cfg, quiet = cfg_for(path), (lambda *_: None)
    train, _ = preference_pairs(cfg, None, quiet)
    assert train[0] == PreferencePair(USER, REPLY, WORSE)
    sft, _ = sft_examples(cfg, None, quiet)  # a preference data set trains SFT on its preferred replies
    assert sft[0] == TextExample(USER, REPLY)
    prompts, _ = rl_prompts(cfg, None, quiet)
    assert prompts[0] == USER
    convo = write_jsonl(tmp_path / "messages.jsonl", [{"messages": USER + REPLY}] * 6)
    assert sft_examples(cfg_for(convo), None, quiet)[0][0] == TextExample(USER, REPLY)
    assert rl_prompts(cfg_for(convo), None, quiet)[0][0] == USER  # the conversation before its last reply


def test_hub_data_set_takes_subset_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, split=None):
        calls.append((name, subset, split))
        return [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = load_config(None, ["data.kind=hub", "data.path=openai/gsm8k", "data.subset=main", "data.split=test",
                             "data.prompt_column=question"])
    train, held = rl_prompts(cfg, None, log=lambda *_: None)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert len(train) + len(held) == 10 and all(p.startswith("What is") for p in train)


def test_chat_template_rendering_and_stop_ids(chat_tokenizer):
    tok = chat_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in end_of_turn_ids(tok) and tok.eos_token_id in end_of_turn_ids(tok)
    prompt_ids = encode_prompt(tok, USER)
    assert tok.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    assert prompt_ids.count(tok.bos_token_id) == 0  # the template decides on BOS; none is added
    head, tail = render_completion(tok, USER, REPLY)
    assert tail == "Mix flour and water.<|im_end|>"
    ids, labels = encode_sft(tok, TextExample(USER, REPLY), 256, completion_only=True)
    assert ids[: len(prompt_ids)] == prompt_ids and ids[-1] == end  # the turn ends on its marker, no EOS after it
    assert labels[: len(prompt_ids)] == [-100] * len(prompt_ids) and labels[len(prompt_ids):] == ids[len(prompt_ids):]
    # the reward model reads what RL scores: rendered prompt, reply up to its end-of-turn id, then EOS
    chosen = encode_reward_text(tok, USER, REPLY, 256)
    assert chosen == ids + [tok.eos_token_id]


def test_completion_only_sft_learns_every_assistant_turn(chat_tokenizer):
    tok = chat_tokenizer
    first = [{"role": "assistant", "content": "No."}]
    convo = USER + first + USER + REPLY
    ids, labels = encode_sft(tok, TextExample(convo[:-1], REPLY), 256, completion_only=True)
    learned = tok.decode([t for t, l in zip(ids, labels) if l != -100])
    # both replies with their end-of-turn markers; no user text, no role headers
    assert learned == "No.<|im_end|>Mix flour and water.<|im_end|>"
    assert all(l in (-100, t) for t, l in zip(ids, labels))
    full_ids, full_labels = encode_sft(tok, TextExample(convo[:-1], REPLY), 256, completion_only=False)
    assert full_ids == ids and full_labels == ids


def test_a_template_that_rerenders_earlier_turns_falls_back_to_the_last_one(chat_tokenizer):
    import warnings

    tok = chat_tokenizer
    saved = tok.chat_template  # earlier assistant turns lose their text once another turn follows (reasoning-style)
    tok.chat_template = CHATML.replace("message['content']", "(message['content'] if loop.last or "
                                                             "message['role'] != 'assistant' else '')")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            ids, labels = encode_sft(tok, TextExample(USER + WORSE + USER, REPLY), 256, completion_only=True)
        assert tok.decode([t for t, l in zip(ids, labels) if l != -100]) == "Mix flour and water.<|im_end|>"
    finally:
        tok.chat_template = saved
    import rlfuse.data.collate as collate
    assert any("last assistant turn only" in str(w.message) for w in said) or \
        any("last assistant turn only" in m for m in collate._WARNED)  # warned once per process


def test_conversational_rows_without_a_template_say_how_to_fix(chat_tokenizer):
    tok = chat_tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(DataError, match="set data.chat_template=chatml"):
            encode_prompt(tok, USER)
    finally:
        tok.chat_template = saved


def test_generation_stops_on_every_end_of_turn_id(tmp_path):
    import torch
    from helpers import make_tiny_model
    from rlfuse.models.load import load_causal_lm
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams

    folder = make_tiny_model(tmp_path / "m", ["one two three four five six seven"] * 10, vocab_size=300)
    model = load_causal_lm(str(folder)).eval()
    vocab = model.config.vocab_size
    engine = DecodeEngine(model, eos_token_id=0)
    plain = list(engine.generate([[0, 5, 6]], 4, SamplingParams(max_new_tokens=6), seed=1))
    assert max(len(s.token_ids) for s in plain) > 1
    every = tuple(range(1, vocab))  # every id but EOS ends a turn: each sample stops after one token
    stopped = list(engine.generate([[0, 5, 6]], 4, SamplingParams(max_new_tokens=6, stop_token_ids=every), seed=1))
    assert [len(s.token_ids) for s in stopped] == [1] * 4 and {s.finish_reason for s in stopped} == {"eos"}
    assert torch.isfinite(torch.cat([s.logprobs for s in stopped])).all()


def test_plain_text_gets_no_bos_where_the_bos_opens_every_chat_turn(chat_tokenizer):
    """SmolLM2's BOS is `<|im_start|>`, its template's turn marker: before plain text it would open a turn whose role
    is the text. A BOS the template writes once (Llama 3) or not at all (GPT-2, no template) still goes in front."""
    tok, saved = chat_tokenizer, (chat_tokenizer.bos_token, chat_tokenizer.chat_template)
    try:
        plain = tok("Mix flour", add_special_tokens=False)["input_ids"]
        assert not bos_marks_turns(tok) and encode(tok, "Mix flour") == [tok.bos_token_id] + plain
        tok.bos_token = "<|im_start|>"
        assert bos_marks_turns(tok) and encode(tok, "Mix flour") == plain
        tok.chat_template = "{{ bos_token }}<|im_start|>{% for m in messages %}{{ m['content'] }}{% endfor %}"
        assert not bos_marks_turns(tok) and encode(tok, "Mix flour") == [tok.bos_token_id] + plain
    finally:
        tok.bos_token, tok.chat_template = saved
