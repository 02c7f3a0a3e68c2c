"""Chat templates: conversational rows rendered with the tokenizer's own template, and the ids that end a turn.

The rendered text already holds the model's special tokens (BOS where the template puts one, role headers,
end-of-turn markers), so it is tokenised without adding special tokens: adding them again would put a second BOS in
front of Llama-3-style prompts. Generation stops on every end-of-turn id the tokenizer and generation config name
(Llama-3 instruct ends a turn with <|eot_id|>, not its EOS; Qwen2.5 with <|im_end|>), or a chat model runs on past
its turn.
"""

from __future__ import annotations

from pathlib import Path

from rlfuse.data.formats import Messages
from rlfuse.errors import ConfigError, DataError

# markers that end a turn in common templates: an id is a stop id when its token appears in the template
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                      "</s>", "<|end_of_text|>")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""data.chat_template=chatml: the template of Qwen and many others, for a tokenizer that has none."""


def set_chat_template(tokenizer, template: str | None) -> None:
    """data.chat_template: `chatml`, a .jinja file, or a template string; None keeps the tokenizer's own."""
    if template is None:
        return
    if template == "chatml":
        tokenizer.chat_template = CHATML
    elif template.endswith((".jinja", ".j2", ".txt")):
        path = Path(template)
        if not path.is_file():
            raise ConfigError("data.chat_template", f"{path} does not exist", "give an existing .jinja file, "
                              "`chatml`, or the template text")
        tokenizer.chat_template = path.read_text()
    else:
        tokenizer.chat_template = template


def require_template(tokenizer, source: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(source, "conversational rows (message lists) but the tokenizer has no chat template",
                        "set data.chat_template=chatml (or a .jinja file), use a chat model's tokenizer, or give "
                        "plain text columns")


def render(tokenizer, messages: Messages, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises template errors of its own types (e.g. "roles must alternate")
        raise DataError("chat template", f"could not render a conversation ({type(e).__name__}: {e})",
                        "check the message roles, or set data.chat_template") from None


def render_prompt(tokenizer, messages: Messages) -> str:
    """The conversation so far, followed by the header of the assistant's turn: what the model continues."""
    return render(tokenizer, messages, generation_prompt=True)


def render_completion(tokenizer, prompt: Messages, completion: Messages) -> tuple[str, str]:
    """(prompt text, completion text) whose concatenation is the rendered conversation, the completion ending at
    its last end-of-turn marker (the whitespace some templates print after it is not something the model must
    generate: it stops on the marker)."""
    head = render_prompt(tokenizer, prompt) if prompt else ""
    full = render(tokenizer, prompt + completion, generation_prompt=False)
    if not full.startswith(head):  # templates that render the last turn differently (e.g. drop reasoning)
        head = render(tokenizer, prompt, generation_prompt=False) if prompt else ""
        if not full.startswith(head):
            raise DataError("chat template", "the rendered prompt is not a prefix of the rendered conversation",
                            "use a template whose turns render the same whatever follows")
    return head, full[len(head):].rstrip()


def assistant_spans(tokenizer, messages: Messages) -> tuple[list[tuple[int, int]], str] | None:
    """Character spans of every assistant reply (its first token through its end-of-turn marker) in the rendered
    conversation, and the rendering they index: up to the end of the last assistant turn, a prefix of any rendering
    of this conversation continued. For SFT's loss on every assistant turn (TRL's assistant_only_loss). None when the
    template renders earlier turns differently once later ones follow (e.g. one that drops past reasoning): there
    the turns cannot be located in the full text."""
    spans, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head, reply = render_completion(tokenizer, messages[:i], [message])
        if not head.startswith(done):
            return None
        spans.append((len(head), len(head) + len(reply)))
        done = head + reply
    return spans, done


def next_segment(tokenizer, conversation: Messages, new: Messages, closed: bool = True) -> str:
    """The text to append after the conversation's last turn, up to its end-of-turn marker (where the policy stopped
    sampling), so that the sequence reads as `conversation + new` rendered with the assistant's header after it:
    a multi-turn episode appends a tool's or an environment's message as the ids of this text alone, never
    re-encoding the tokens the policy sampled. closed=False: the last turn stopped at its text's end (a stop
    string), before its end-of-turn marker, which then opens the segment. DataError where the template renders the
    conversation differently once more turns follow (its rendering is then no prefix of the longer one)."""
    head, last = render_completion(tokenizer, conversation[:-1], conversation[-1:])
    content = conversation[-1]["content"]
    done = head + (last if closed or content not in last else last[: last.rindex(content) + len(content)])
    full = render_prompt(tokenizer, conversation + new)
    if not full.startswith(done):
        raise DataError("chat template", "the conversation rendered with one more turn does not start with the "
                        "conversation as rendered before (the template rewrites earlier turns), so a turn cannot be "
                        "appended as new tokens only",
                        "set data.chat_template=chatml (or a template that renders each turn the same whatever "
                        "follows)")
    return full[len(done):]


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of template-rendered text: its special tokens are in the text already."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def end_of_turn_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Every id that ends a turn: the tokenizer's EOS, the generation config's eos_token_id (an int or a list), and
    the end-of-turn markers the chat template uses that are single tokens of this vocabulary."""
    ids = [tokenizer.eos_token_id]
    eos = getattr(generation_config, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str):  # token by token, not get_vocab(): this runs once per SFT example
        for t in (t for t in END_OF_TURN_TOKENS if t in template):
            i = tokenizer.convert_tokens_to_ids(t)
            ids.append(None if i == tokenizer.unk_token_id else i)  # not a single token of this vocabulary
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))
