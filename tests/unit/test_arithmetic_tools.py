"""The calculator task (data.arithmetic_format=calculator): the tool, the chat rows, and SFT demonstrations whose
loss covers both assistant turns and never the tool's result, rendered with the tools' system turn RL prompts get."""

import pytest

from rlfuse.config import load_config
from rlfuse.data.arithmetic import calculator, chat_rows, demonstration, exact_match
from rlfuse.data.stages import rl_prompt_rows, sft_examples
from rlfuse.data.tool_text import tool_schema, tools_prompt
from rlfuse.errors import ConfigError


def test_the_calculator():
    assert calculator("4821 + 3977") == "8798" and calculator("(2 + 3) * 4") == "20" and calculator("7 / 2") == "3.5"
    assert calculator(" 10 - 12 ") == "-2"
    for bad in ("__import__('os')", "2 ** 99999", "x + 1", "[1, 2]"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]


def test_chat_rows_with_and_without_tools():
    with_tools, without = chat_rows(50, 0, 9999, True), chat_rows(50, 0, 9999, False)
    assert [r["prompt"] for r in with_tools] == [r["prompt"] for r in without]  # the same problems
    for r in with_tools:
        call, result, answer = r["completion"]
        assert call["role"] == "assistant" and "<tool_call>" in call["content"] and result["role"] == "tool"
        assert result["content"] == r["answer"] and answer["content"] == f"The answer is {r['answer']}."
        assert exact_match([r["prompt"]], [r["completion"]], [r["answer"]]) == [1.0]
    assert max(int(r["answer"]) for r in without) > 1000  # too large to work out in the head
    assert [m["role"] for m in without[0]["completion"]] == ["assistant"]


def test_sft_demonstrations_carry_the_tools_system_turn():
    row = chat_rows(1, 3, 9999, True)[0]
    prompt, response = demonstration(row, tools=True)
    assert prompt[:2] == tools_prompt(row["prompt"], [tool_schema(calculator)])
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool"] and response == row["completion"][-1:]
    cfg = load_config(None, ["data.kind=arithmetic", "data.arithmetic_format=calculator", "data.max_operand=9999",
                             "rl.tools=rlfuse.data.arithmetic:calculator", "data.max_examples=40"])
    train, _ = sft_examples(cfg, None, log=lambda *_: None)
    assert all(isinstance(e.prompt, list) and e.prompt[0]["role"] == "system" for e in train)
    rows, _ = rl_prompt_rows(cfg, None, log=lambda *_: None)
    assert rows[0].prompt[0]["role"] == "user" and "answer" in rows[0].columns  # the episode adds the system turn


def test_sft_loss_is_on_the_assistant_turns_only():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rlfuse.data.chat import CHATML
    from rlfuse.data.collate import encode_sft
    from rlfuse.data.sources import TextExample

    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 0}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  eos_token="<|im_end|>", unk_token="<unk>", bos_token="<|im_start|>")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    row = chat_rows(1, 3, 9999, True)[0]
    ids, labels = encode_sft(tok, TextExample(*demonstration(row, tools=True)), 4000, completion_only=True)
    text = lambda ids: "".join(tok.convert_ids_to_tokens(ids))
    learned = text([i for i, l in zip(ids, labels) if l != -100])
    assert "<tool_call>" in learned and f"The answer is {row['answer']}." in learned
    assert "You can call these tools" not in learned and row["prompt"][0]["content"] not in learned
    tool_turn = f"tool\n{row['answer']}"
    assert tool_turn in text(ids) and tool_turn not in learned


def test_calculator_demonstrations_need_the_tool():
    with pytest.raises(ConfigError, match="rl.tools=rlfuse.data.arithmetic:calculator"):
        load_config(None, ["data.kind=arithmetic", "data.arithmetic_format=calculator"])


def test_guessing_games_and_their_environment():
    import random

    from rlfuse.data.guessing import GuessNumber, demonstration as game_demo, games, halving_game

    game = halving_game(37, 100, random.Random(0))
    guesses = [int(m["content"]) for m in game if m["role"] == "assistant"]
    assert guesses[-1] == 37 and len(guesses) <= 8 and game[-1]["role"] == "assistant"
    env = GuessNumber()
    env.reset(target=37)
    answers = [env.step(str(g)) for g in guesses]
    # the environment answers the demonstration's own game: its user turns, then done on the last guess
    assert [a[0] for a in answers[:-1]] == [m["content"] for m in game if m["role"] == "user"] and answers[-1][2]
    assert env.reward == pytest.approx(1 / len(guesses))
    env.reset(target=5)
    assert env.step("no idea") == ("reply with one number", 0.0, False) and env.reward == 0.0
    rows = games(20, 1, 100)
    prompt, response = game_demo(rows[0])
    assert prompt[0] == rows[0]["prompt"][0] and response[0]["content"] == str(rows[0]["target"])
    with pytest.raises(ConfigError, match="rl.environment=rlfuse.data.guessing:GuessNumber"):
        load_config(None, ["data.kind=guessing"])
    load_config("configs/smollm2_guess.yaml")
    load_config("configs/smollm2_calculator.yaml")
    load_config("configs/smollm2_calculator_notools.yaml")
