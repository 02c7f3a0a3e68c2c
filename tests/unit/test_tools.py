"""Multi-turn groundwork: tools' schemas from type hints and docstrings, parsing tool calls, every tool fault as the
tool's message, and the chat segment a tool turn appends (token in, token out)."""

from __future__ import annotations

import sys
import time
from typing import Literal, Optional

import pytest

from rlfuse.data.chat import CHATML, next_segment
from rlfuse.errors import DataError
from rlfuse.data.tool_text import tool_schema, tools_system_text
from rlfuse.rollout.tools import FAULTS, ToolCall, call_tool, parse_tool_calls


def calculator(expression: str, precision: int = 6) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "12 * 7".
        precision (int): digits after the point.
    """
    return str(round(eval(expression, {"__builtins__": {}}), precision))


def lookup(city: str, unit: Literal["c", "f"] = "c", days: Optional[list[int]] = None) -> str:
    """Weather for a city."""
    return f"{city}: 20{unit}"


def test_schema_from_hints_and_docstring():
    s = tool_schema(calculator)
    assert s["type"] == "function"
    f = s["function"]
    assert f["name"] == "calculator" and f["description"] == "Evaluate an arithmetic expression."
    assert f["parameters"]["required"] == ["expression"]
    assert f["parameters"]["properties"] == {
        "expression": {"type": "string", "description": 'the expression, e.g. "12 * 7".'},
        "precision": {"type": "integer", "description": "digits after the point."}}
    w = tool_schema(lookup)["function"]["parameters"]["properties"]
    assert w["unit"] == {"enum": ["c", "f"]} and w["days"] == {"type": "array", "items": {"type": "integer"}}
    assert '"name": "calculator"' in tools_system_text([s]) and "<tool_call>" in tools_system_text([s])


def test_parse_tool_calls_and_bad_ones():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
            '<tool_call>{"name": calculator}</tool_call><tool_call>{"name": "x", "arguments": [1]}</tool_call>')
    calls, bad = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "2+3"})]
    assert [b.fault for b in bad] == ["bad_call", "bad_call"] and "<tool_call>" in bad[0].text
    assert parse_tool_calls("no call here") == ([], [])


def test_every_fault_is_the_tools_message_not_a_crash():
    def raises(x: int) -> str:
        raise ValueError("boom")

    def not_text(x: int) -> str:
        return {"a": 1}

    def hangs(x: int) -> str:
        time.sleep(2)
        return "late"

    def prints(x: int) -> str:
        print("debug output")
        return "ok"

    tools = {f.__name__: f for f in (raises, not_text, hangs, prints, calculator)}
    stdout = sys.stdout
    results = {name: call_tool(tools, ToolCall(name, {"x": 1}), 0.3)
               for name in ("raises", "not_text", "hangs", "prints", "missing")}
    good = call_tool(tools, ToolCall("calculator", {"expression": "6 * 7"}), 5)
    wrong_args = call_tool(tools, ToolCall("calculator", {"nope": 1}), 5)
    assert sys.stdout is stdout  # the process's stdout is back as it was
    assert {n: r.fault for n, r in results.items()} == {"raises": "raised", "not_text": "not_text",
                                                         "hangs": "timeout", "prints": "printed",
                                                         "missing": "unknown_tool"}
    assert "ValueError: boom" in results["raises"].text and "within 0.3 s" in results["hangs"].text
    assert results["prints"].text == "ok" and "calculator" in results["missing"].text
    assert good.text == "42" and good.fault is None
    assert wrong_args.fault == "raised" and "TypeError" in wrong_args.text
    assert set(r.fault for r in results.values()) <= set(FAULTS)


class _Tok:
    """The template rendering a tokenizer does, without a vocabulary (next_segment works on text)."""

    def __init__(self, template):
        self.template = template

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        import jinja2

        return jinja2.Template(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_the_segment_a_tool_turn_appends():
    tok = _Tok(CHATML)
    conversation = [{"role": "user", "content": "What is 6 * 7?"},
                    {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'}]
    segment = next_segment(tok, conversation, [{"role": "tool", "content": "42"}])
    # after the assistant's <|im_end|> (where the policy stopped): the rest of its line, the tool turn, the header
    assert segment == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # renders only the last two messages: adding a turn drops the first from the text
    tok = _Tok("{% for m in messages[-2:] %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}[assistant]{% endif %}")
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match="rewrites earlier turns.*chatml"):
        next_segment(tok, conversation, [{"role": "user", "content": "again"}])


def test_concurrent_tools_leave_stdout_alone_and_a_hung_one_holds_no_exit():
    """Tools printing from many threads at once: their prints are theirs, the process's stdout is untouched after;
    a tool that never returns times out and the process still exits at once (its thread is a daemon)."""
    import concurrent.futures
    import subprocess

    def noisy(x: int) -> str:
        """Print a lot."""
        for _ in range(50):
            print("tool noise", x)
        return str(x)

    stdout = sys.stdout
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: call_tool({"noisy": noisy}, ToolCall("noisy", {"x": i}), 5), range(16)))
    assert sys.stdout is stdout and [r.text for r in results] == [str(i) for i in range(16)]
    assert all(r.fault == "printed" for r in results)
    code = ("import time; from rlfuse.rollout.tools import ToolCall, call_tool\n"
            "def hang(x: int) -> str:\n    time.sleep(600)\n"
            "print(call_tool({'hang': hang}, ToolCall('hang', {'x': 1}), 0.2).fault)")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "timeout" and time.perf_counter() - t < 30

