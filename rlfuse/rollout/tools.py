"""Tools for multi-turn episodes, as TRL users write them: plain Python functions whose type hints and docstring are
the tool's JSON schema (data/tool_text.py), called by the policy with a `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` block (the format of Qwen's and Hermes' chat templates, which transformers renders `tools=`
into), answered in a `tool` turn.

Everything a tool does wrong becomes the tool's message, never the run's failure: it raises, returns something that
is not text, runs past its timeout, prints, or the call names no tool or is not JSON. Each such result says which
fault it was (ToolResult.fault), for the metrics.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import threading
from dataclasses import dataclass


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

FAULTS = ("raised", "not_text", "timeout", "printed", "unknown_tool", "bad_call", "too_many_calls")
"""Every fault a tool call can have, as ToolResult.fault names it."""

@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolResult:
    name: str
    text: str
    """The tool message's content: the tool's return value, or what went wrong."""
    fault: str | None = None
    """None, or one of FAULTS."""


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[ToolResult]]:
    """The well-formed calls in a reply, and a bad_call result for each block that is not {"name": str,
    "arguments": object} JSON."""
    calls, bad = [], []
    for block in TOOL_CALL.findall(text):
        try:
            obj = json.loads(block)
            name, arguments = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            bad.append(ToolResult("", f"error: the tool call is not valid ({type(e).__name__}: {e}); write "
                                      '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>', "bad_call"))
            continue
        calls.append(ToolCall(name, arguments))
    return calls, bad


class _ToolStdout:
    """sys.stdout while tools run: what a tool's thread prints goes to that call's buffer, what any other thread
    prints (the run's progress lines) to the stream it replaced. One for all calls: redirect_stdout per call would
    swap the process's stdout from several threads at once and leave it pointing at a buffer."""

    def __init__(self, base):
        self.base, self.local = base, threading.local()

    def write(self, text: str) -> int:
        return (getattr(self.local, "buffer", None) or self.base).write(text)

    def flush(self) -> None:
        self.base.flush()

    def __getattr__(self, name):
        return getattr(self.base, name)


_kept = {"users": 0, "proxy": None}
_kept_lock = threading.Lock()


@contextlib.contextmanager
def tool_prints_kept():
    """While open, tools' prints are kept off the terminal (call_tool counts them). Nested and concurrent uses share
    one proxy, installed by the first to open and removed by the last to close."""
    with _kept_lock:
        if _kept["users"] == 0:
            _kept["proxy"] = sys.stdout = _ToolStdout(sys.stdout)
        _kept["users"] += 1
    try:
        yield
    finally:
        with _kept_lock:
            _kept["users"] -= 1
            if _kept["users"] == 0:
                if sys.stdout is _kept["proxy"]:  # unless someone else replaced it meanwhile
                    sys.stdout = _kept["proxy"].base
                _kept["proxy"] = None


def _run_quietly(fn, arguments: dict) -> tuple[object, str]:
    """fn(**arguments) and what it printed, in a tool's own thread under tool_prints_kept."""
    proxy, out = sys.stdout, io.StringIO()
    local = proxy.local if isinstance(proxy, _ToolStdout) else None
    if local is not None:
        local.buffer = out
    value = fn(**arguments)
    return value, out.getvalue()


class Timeout(Exception):
    """A user's function did not return within its time (run_bounded)."""


def run_bounded(fn, arguments: dict, timeout_s: float, name: str) -> tuple[object, str]:
    """fn(**arguments) on a daemon thread of its own, within timeout_s seconds: (its value, what it printed), or its
    exception, or Timeout. A hung call's thread is left to finish on its own (Python cannot kill a thread): its
    result is dropped, and it holds up neither the run nor the process's exit."""
    box: dict = {}

    def run():
        try:
            box["value"] = _run_quietly(fn, arguments)
        except Exception as e:  # noqa: BLE001 - the user's code: any exception is handed back as it is
            box["error"] = e

    with tool_prints_kept():
        thread = threading.Thread(target=run, name=f"rlfuse-{name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
    if thread.is_alive():
        raise Timeout(f"{name} did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_tool(tools: dict, call: ToolCall, timeout_s: float) -> ToolResult:
    """Run one call (run_bounded: its own thread, so the decode loop goes on meanwhile) within timeout_s seconds;
    whatever goes wrong becomes the result's text, with its fault."""
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(call.name, f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools))}",
                          "unknown_tool")
    try:
        value, printed = run_bounded(fn, call.arguments, timeout_s, call.name)
    except Timeout as e:
        return ToolResult(call.name, f"error: {e}", "timeout")
    except Exception as e:  # noqa: BLE001 - the user's tool: any exception is its answer
        return ToolResult(call.name, f"error: {call.name} raised {type(e).__name__}: {e}", "raised")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # a calculator's number is text enough
    if not isinstance(value, str):
        return ToolResult(call.name, f"error: {call.name} returned a {type(value).__name__}, not text", "not_text")
    return ToolResult(call.name, value, "printed" if printed else None)
