"""How much of the model's context a prompt may take, and prompts cut to fit.

A position-embedding model (GPT-2) crashes on a sequence longer than its context, so a prompt plus
rl.max_new_tokens must fit: the budget is checked once from the config and the model's config, and prompts that
are longer keep their end (the part next to the response, e.g. hh-rlhf's last "Assistant:" turn).
"""

from __future__ import annotations

from rlfuse.config import RLConfig
from rlfuse.data.chat import encode_rendered, render_prompt, require_template
from rlfuse.data.collate import encode
from rlfuse.errors import ConfigError

CONTEXT_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")


def model_context(model_config) -> int | None:
    """The most positions the model takes (GPT-2: n_positions; Llama: max_position_embeddings), None if its config
    names none."""
    for name in CONTEXT_FIELDS:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def prompt_budget(rl: RLConfig, context: int | None) -> int:
    """Tokens a prompt may take: rl.max_prompt_tokens, or by default the context minus rl.max_new_tokens.
    ConfigError when the two do not fit in the context together."""
    p, n = rl.max_prompt_tokens, rl.max_new_tokens
    if context is None:
        if p is None:
            raise ConfigError("rl.max_prompt_tokens", "the model's config names no context length "
                              f"({' / '.join(CONTEXT_FIELDS)}), so the prompt budget cannot be derived",
                              "set rl.max_prompt_tokens")
        return p
    if n >= context:
        raise ConfigError("rl.max_new_tokens", f"rl.max_new_tokens={n} leaves no room for a prompt in the model's "
                          f"context of {context} tokens", f"set rl.max_new_tokens below {context} (and "
                          f"rl.max_prompt_tokens + rl.max_new_tokens <= {context})")
    if p is None:
        return context - n
    if p + n > context:
        raise ConfigError("rl.max_prompt_tokens", f"rl.max_prompt_tokens={p} + rl.max_new_tokens={n} = {p + n} "
                          f"exceeds the model's context of {context} tokens",
                          f"lower rl.max_prompt_tokens to {context - n} or less, or lower rl.max_new_tokens")
    return p


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt's ids: text as collate.encode (BOS in front), a message list rendered with the chat template and
    the assistant's turn header (data/chat.py)."""
    if isinstance(prompt, list):
        require_template(tokenizer, "conversational prompts")
        return encode_rendered(tokenizer, render_prompt(tokenizer, prompt))
    return encode(tokenizer, prompt)


def encode_prompts(tokenizer, texts: list, max_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids of each prompt (encode_prompt), longer ones cut to their last tokens so that each has at most
    max_tokens; returns (ids, number of prompts cut)."""
    bos, out, cut = tokenizer.bos_token_id, [], 0
    for text in texts:
        ids = encode_prompt(tokenizer, text)
        if len(ids) > max_tokens:
            cut += 1
            # BOS stays in front: every sequence in SFT and reward-model training began with it, so a prompt without
            # it would be one the model never saw (and Llama-style models lean on it as an attention sink)
            keep_bos = bos is not None and ids[0] == bos and max_tokens >= 2
            ids = [bos] + ids[len(ids) - (max_tokens - 1):] if keep_bos else ids[len(ids) - max_tokens:]
        out.append(ids)
    return out, cut


def check_max_length(max_length: int, context: int | None, field: str = "data.max_length") -> None:
    """SFT and reward model: sequences of data.max_length must fit the model's position embeddings. An error rather
    than a silent clamp, so the config says what was trained."""
    if context is not None and max_length > context:
        raise ConfigError(field, f"{max_length} exceeds the model's context of {context} tokens",
                          f"set {field}={context} or less")
