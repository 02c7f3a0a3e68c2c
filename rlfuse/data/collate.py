"""Tokenisation and padding shared by every stage."""

from __future__ import annotations

import warnings

import torch

from rlfuse.data.chat import (
    assistant_spans,
    encode_rendered,
    end_of_turn_ids,
    render_completion,
    render_prompt,
    require_template,
)
from rlfuse.data.sources import PreferencePair, TextExample


def encode(tokenizer, text: str, bos: bool = True) -> list[int]:
    """Token ids with the model's BOS in front once (GPT-2 tokenizers add none; Llama's add their own), unless that
    BOS is the chat template's turn marker (bos_marks_turns)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    b = tokenizer.bos_token_id
    if bos and b is not None and (not ids or ids[0] != b) and not bos_marks_turns(tokenizer):
        ids = [b] + ids
    return ids


def bos_marks_turns(tokenizer) -> bool:
    """Whether the tokenizer's BOS is the token its chat template opens every turn with (SmolLM2's `<|im_start|>`):
    put before plain text it would read as a turn whose role is the text's first words, so plain text goes without
    it. Told by the template writing that token out more than once (Llama 3's writes `bos_token` once, at the top)."""
    template, b = getattr(tokenizer, "chat_template", None), getattr(tokenizer, "bos_token", None)
    return isinstance(template, str) and isinstance(b, str) and bool(b) and template.count(b) >= 2


def encode_chat(tokenizer, prompt: list, completion: list) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a conversation rendered with the chat template (data/chat.py), each part
    tokenised on its own as RL sees them (the prompt's ids, then the generated ones); EOS after the completion unless
    its turn already ends on an end-of-turn id, so the model learns to stop either way."""
    require_template(tokenizer, "conversational data")
    head, tail = render_completion(tokenizer, list(prompt), list(completion))
    ids = encode_rendered(tokenizer, tail)
    if not ids or ids[-1] not in end_of_turn_ids(tokenizer):
        ids = ids + [tokenizer.eos_token_id]
    return encode_rendered(tokenizer, head), ids


def assistant_turn_labels(tokenizer, history: list, ids: list[int]) -> list[int]:
    """Labels over the ids of a conversation's history (everything before its last assistant turn, rendered with
    the assistant's generation header): the earlier assistant replies' tokens keep their ids, the rest -100, so
    completion-only SFT learns every assistant turn. Tokens are matched to replies by character offsets, so the ids
    are the ones the whole text tokenises to. Where the turns cannot be located (a template that re-renders earlier
    turns, a tokenizer without offsets) the history is masked whole, as before, with one warning."""
    if not any(m["role"] == "assistant" for m in history):
        return [-100] * len(ids)
    found, text = assistant_spans(tokenizer, history), render_prompt(tokenizer, history)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # slow (Python) tokenizers have no offsets
        enc = None
    if found is None or enc is None or enc["input_ids"] != ids or not text.startswith(found[1]):
        _warn_once("completion-only SFT: the earlier assistant turns of a conversation could not be located (the chat "
                   "template renders them differently once later turns follow, or the tokenizer gives no offsets): "
                   "the loss is on the last assistant turn only")
        return [-100] * len(ids)
    inside = lambda a, b: b > a and any(s <= a and b <= e for s, e in found[0])
    return [t if inside(a, b) else -100 for t, (a, b) in zip(ids, enc["offset_mapping"])]


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)

        warnings.warn(message, stacklevel=3)


def is_chat(*parts) -> bool:
    return any(isinstance(p, list) for p in parts)


def encode_sft(tokenizer, ex: TextExample, max_length: int, completion_only: bool) -> tuple[list[int], list[int]]:
    """(input ids, labels) with EOS after the response; labels are -100 where the loss does not apply.
    Conversational examples: the chat template's rendering; with completion_only the loss is on every assistant
    turn (the last one's ids as RL sees them, encode_chat)."""
    if is_chat(ex.prompt, ex.response):
        prompt, response = encode_chat(tokenizer, ex.prompt or [], ex.response)
        ids = (prompt + response)[:max_length]
        if not completion_only:
            return ids, list(ids)
        labels = assistant_turn_labels(tokenizer, list(ex.prompt or []), prompt)
        return ids, (labels + response)[:max_length]
    prompt = encode(tokenizer, ex.prompt) if ex.prompt else encode(tokenizer, "")
    response = tokenizer(ex.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if ex.prompt and not ex.prompt.endswith((" ", "\n")) and not ex.response.startswith((" ", "\n")):
        response = tokenizer(" " + ex.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + response)[:max_length]
    labels = ([-100] * len(prompt) if completion_only else list(prompt)) + response
    return ids, labels[:max_length]


def encode_reward_text(tokenizer, prompt: str, response: str, max_length: int) -> list[int]:
    """Reward-model input: BOS + prompt + response + EOS; truncation keeps the end. The score is read at the rightmost
    token that is not the pad id, and rlfuse's pad id is the EOS id (GPT-2 tokenizers have none), so it is read at the
    text's last token, the one before this EOS; models/rewards.py reward_model_fn builds the same input."""
    if is_chat(prompt, response):  # the rendered conversation, ending on its end-of-turn id, then EOS as above
        head, tail = encode_chat(tokenizer, prompt or [], response)
        ids = head + tail + ([] if tail[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id])
        return ids[-max_length:]
    text = f"{prompt} {response}".strip() if prompt and not prompt.endswith((" ", "\n")) else prompt + response
    ids = encode(tokenizer, text) + [tokenizer.eos_token_id]
    return ids[-max_length:]


def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    """(B, T) tensor right-padded to the longest sequence of this batch only."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def sft_batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    ids = pad([i for i, _ in items], pad_id)
    return {"input_ids": ids, "attention_mask": pad([[1] * len(i) for i, _ in items], 0),
            "labels": pad([l for _, l in items], -100)}


def pair_batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Chosen then rejected in one (2B, T) batch: one forward per micro-batch."""
    seqs = [c for c, _ in items] + [r for _, r in items]
    return {"input_ids": pad(seqs, pad_id), "attention_mask": pad([[1] * len(s) for s in seqs], 0)}


def encode_pair(tokenizer, p: PreferencePair, max_length: int) -> tuple[list[int], list[int]]:
    return (encode_reward_text(tokenizer, p.prompt, p.chosen, max_length),
            encode_reward_text(tokenizer, p.prompt, p.rejected, max_length))


def prompt_runs(order: list[int], prompt_of: list) -> list[list[int]]:
    """`order` cut into runs of consecutive samples of one prompt (prompt_of[i]: sample i's prompt id): the units a
    token-budget packing keeps together. [4, 5, 0, 1, 2] with prompts [0, 0, 1, 1, 2, 2] -> [[4, 5], [0, 1], [2]]."""
    runs: list[list[int]] = []
    for i in order:
        if runs and prompt_of[runs[-1][-1]] == prompt_of[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def pack_by_tokens(units: list[list[int]], cost, budget: int) -> list[list[int]]:
    """Greedy packing of units (lists of sample indices) in order into micro-batches whose cost(indices) (tokens as
    forwarded, padding included) stays within `budget`. A unit is split into single samples only when it alone
    exceeds the budget; a single sample over the budget gets a micro-batch of its own."""
    out, cur = [], []
    for unit in units:
        for piece in [unit] if cost(unit) <= budget else [[i] for i in unit]:
            if cur and cost(cur + piece) > budget:
                out.append(cur)
                cur = []
            cur = cur + piece
    return out + ([cur] if cur else [])
