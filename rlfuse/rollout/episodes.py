"""Multi-turn episodes: the policy's turns alternate with tool results or an environment's observations, and the
whole episode is one sample to score and train on.

The user's contract follows TRL's:
- tools: plain functions (rollout/tools.py: their type hints and docstring are the schema the prompt shows), called
  by the policy with `<tool_call>{...}</tool_call>` and answered in `tool` turns;
- an environment class (rl.environment): one instance per episode, `reset(**row)` with the prompt's data set row;
  either its public methods are the episode's tools (TRL's environment_factory), or it has a Gym-style
  `step(text) -> (observation, reward, done)` whose observation comes back as a `user` turn (games, simulated users;
  with rl.tools beside it, a reply that calls a tool gets the tool's answer and any other reply the step's).
  Its reward, where it has one (the `reward` attribute or method, or the sum of step rewards), is added to the
  reward functions' with rl.environment_reward_weight.

Token in, token out: a turn's answer is appended as the token ids of its own chat segment (data/chat.py
next_segment: the answer's turn and the assistant's next header), never by re-encoding the conversation, so the
tokens the policy sampled stay the ones it trains on; Sample.sampled marks them, and the loss, the KL and the
advantages read only those.

EpisodeGenerator wraps an engine (rollout/generator.py) and is itself a Generator whose samples are finished
episodes, so the rollout loop, fusion and the evaluation run episodes unchanged. An episode whose turn ended is
answered on a thread pool (with rl.overlap_tools, while the engine decodes the others; otherwise before its next
decode step, so that a run repeats bit for bit); its next turn joins the engine's running batch (`extend`) or,
when nothing else decodes, starts it again (`resume`). On our engine the turn's KV cache is kept meanwhile
(keep_finished_kv), so the next turn prefills only the answer's tokens, not the whole conversation again. Each
row's random stream is keyed by (seed, prompt id, sample index) and continues at its position, so on our engine an
episode's tokens depend only on the seed, the prompt and the answers, never on which episodes shared its batch.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

from rlfuse.config.callables import load_callable
from rlfuse.data.chat import encode_rendered, next_segment
from rlfuse.data.tool_text import tool_schema, tools_prompt
from rlfuse.errors import ConfigError, DataError, UserError, first_line
from rlfuse.rollout.engine import EngineStats
from rlfuse.rollout.generator import Capabilities
from rlfuse.rollout.state import EngineState, RowState, Sample, SamplingParams
from rlfuse.rollout.tools import Timeout, ToolResult, call_tool, parse_tool_calls, run_bounded, tool_prints_kept

RESERVED = {"reset", "step", "reward", "close"}
"""An environment's methods that are not tools."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    """Policy turns per episode; an episode still going after them is truncated ("turns")."""
    max_tool_calls: int = 4
    """Tool calls run per turn; the ones after are answered with an error (fault too_many_calls)."""
    max_tokens: int = 256
    """Tokens per episode after the prompt, sampled and appended together; past it the episode is truncated."""
    turn_tokens: int = 64
    """Tokens the policy may sample in one turn (rl.max_new_tokens)."""
    tool_timeout_s: float = 10.0


@dataclass
class EpisodeRecord:
    """What happened in one episode, for the reward functions, the metrics and the report."""
    messages: list[dict] = field(default_factory=list)
    """The episode after the prompt as chat messages: the policy's turns (assistant) and their answers (tool, user)."""
    turns: int = 0
    tool_calls: int = 0
    faults: dict = field(default_factory=dict)
    """Tool calls that went wrong, by fault (rollout/tools.py FAULTS)."""
    truncated: str | None = None
    """None, "turns" (rl.max_turns), or "tokens" (a turn past rl.max_new_tokens, or the episode past
    rl.max_episode_tokens)."""
    reward: float | None = None
    """The environment's reward (None: it has none)."""
    tool_seconds: float = 0.0
    """Seconds spent answering turns (tools or the environment's step), off the decode loop."""
    row: tuple | None = None
    """The data row the episode played, (prompt, other columns): what its environment's reset and the reward
    functions read."""
    environment: object = None
    """The episode's environment instance (reward functions may take `environments`), in the process that ran the
    episode: it does not travel to another (a Ray worker scoring it gets None), since its class may be defined in a
    file only that process imported."""

    def __getstate__(self) -> dict:
        return self.__dict__ | {"environment": None}


def environment_tools(env) -> dict[str, Callable]:
    """An environment's public methods as tools (TRL's environment_factory form), bound to it: those of its class
    not starting with _ and not reset/step/reward/close (read off the class, so no property runs)."""
    return {name: getattr(env, name) for name in environment_tools_of_class(type(env))}


def has_tool_call(reply: str) -> bool:
    calls, bad = parse_tool_calls(reply)
    return bool(calls or bad)


def gym_style(env_class) -> bool:
    """An environment whose step(text) answers every turn (rather than tools it exposes)."""
    return callable(getattr(env_class, "step", None))


def episode_prompt(prompt, schemas: list[dict]) -> list[dict]:
    """The prompt as an episode starts from (data/tool_text.py tools_prompt)."""
    return tools_prompt(prompt, schemas)


@dataclass
class Episodes:
    """A run's episode settings: its tools, its environment class (or None), limits, and each prompt's data set row
    (prompt as given, other columns) by its token ids, as the reward functions get them."""
    tokenizer: object
    tools: dict[str, Callable] = field(default_factory=dict)
    environment: Callable | None = None
    limits: EpisodeLimits = EpisodeLimits()
    rows: dict = field(default_factory=dict)
    overlap_tools: bool = False
    """Decode the other episodes while a turn is answered (rl.overlap_tools). False: each answer is waited for
    before the engine's next decode step, so every row joins the batch at the same step in every run and the run
    repeats bit for bit; True: a slow tool never holds decoding up, and the episodes are the same token for token,
    but which rows share a decode step, and so the last bits of the recorded log-probs, follow the tools' timing."""

    @classmethod
    def from_config(cls, rl, tokenizer) -> "Episodes":
        """rl.tools and rl.environment loaded (config/callables.py), with the limits rl sets; rows are the caller's
        to fill (the prompts' data rows by their token ids)."""
        tools = [load_callable(spec, "rl.tools") for spec in (rl.tools or "").split(",") if spec]
        limits = EpisodeLimits(rl.max_turns, rl.max_tool_calls, rl.response_limit, rl.max_new_tokens, rl.tool_timeout_s)
        environment = load_callable(rl.environment, "rl.environment") if rl.environment else None
        if environment is not None:
            check_environment_class(environment, rl.environment)
        check_tool_names([fn.__name__ for fn in tools], environment_tool_names(environment))
        return cls(tokenizer, {fn.__name__: fn for fn in tools}, environment, limits, overlap_tools=rl.overlap_tools)

    @functools.cached_property
    def schemas(self) -> list[dict]:
        """The tools the prompt describes: the run's, and an environment's methods where it answers with tools."""
        tools = dict(self.tools) | {name: getattr(self.environment, name)
                                    for name in environment_tool_names(self.environment)}
        return [tool_schema(fn) for fn in tools.values()]

    @property
    def answer_role(self) -> str:
        """The role a turn's answer comes in: user for a Gym-style environment's observation, tool otherwise."""
        return "user" if self.environment is not None and gym_style(self.environment) else "tool"

    def describe(self) -> str:
        """'tools calculator; at most 4 turns, 4 calls per turn, 256 tokens' for the run's log."""
        lim = self.limits
        what = [f"tools {', '.join(s['function']['name'] for s in self.schemas)}"] if self.schemas else []
        if self.environment is not None:
            what.append(f"environment {getattr(self.environment, '__name__', 'environment')}"
                        + (" (step)" if gym_style(self.environment) else ""))
        return (f"{', '.join(what)}; at most {lim.max_turns} turns, {lim.max_tool_calls} tool calls per turn, "
                f"{lim.max_tokens} tokens, tools time out after {lim.tool_timeout_s:g} s")

    def start(self, prompt_id: int, prompt_ids: list[int], row: tuple | None = None) -> "Session":
        """An episode of the prompt's data row: `row` as the rollout request gave it, else the row found by the
        prompt's token ids (self.rows), else none (the decoded prompt, no columns)."""
        prompt, columns = row if row is not None else self.rows.get(tuple(prompt_ids), (None, {}))
        env = None
        if self.environment is not None:
            env = self.environment()
            try:
                env.reset(**({"prompt": prompt} | dict(columns)))
            except Exception as e:  # noqa: BLE001 - the user's environment: its failure named with the row
                name = getattr(self.environment, "__name__", "the environment")
                shown = ", ".join(f"{k}={str(v)[:30]!r}" for k, v in list(columns.items())[:3])
                raise UserError(f"rl.environment: {name}.reset raised {type(e).__name__}: {first_line(e)} on the row "
                                f"of prompt {prompt_id} ({shown or 'no other columns'}); fix reset or that row")
        decode = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        conversation = episode_prompt(prompt if prompt is not None else decode, self.schemas)
        session = Session(self, env, conversation)
        session.record.row = None if prompt is None else (prompt, dict(columns))
        return session


def check_episode_template(tokenizer, prompt: list[dict], episodes: Episodes) -> None:
    """At start-up: the chat template appends a turn's answer and the next reply as new text only (data/chat.py
    next_segment), over two rounds of a probe conversation on the first prompt; else one DataError naming the
    template's model and the fix."""
    conversation, answer = list(prompt), {"role": episodes.answer_role, "content": "probe"}
    try:
        for _ in range(2):
            conversation.append({"role": "assistant", "content": "probe"})
            next_segment(tokenizer, conversation, [answer])
            conversation.append(answer)
    except DataError as e:
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise DataError(f"the chat template of {name}", e.problem, e.fix) from None


def check_environment_class(env, spec: str) -> None:
    """rl.environment names a class that each episode makes with no arguments and resets with its row; else one
    ConfigError saying what it is instead (a function, a class without reset, or one whose __init__ needs arguments)."""
    if not inspect.isclass(env):
        raise ConfigError("rl.environment", f"{spec} is a {type(env).__name__}, not a class: each episode makes one "
                          "instance of it", "name a class with reset(**row) and either step(text) or tool methods; "
                          "plain tool functions go in rl.tools")
    if not callable(getattr(env, "reset", None)):
        raise ConfigError("rl.environment", f"{spec} has no reset method: each episode resets its instance with the "
                          "prompt's data row", "add def reset(self, **row) (it may ignore the row)")
    try:
        inspect.signature(env).bind()
    except TypeError as e:
        raise ConfigError("rl.environment", f"{spec}() cannot be made without arguments ({e})",
                          "give its __init__ defaults for every argument; reset(**row) receives the row") from None
    except ValueError:  # no signature to read (a builtin): making one will say
        pass


def check_tool_names(tools: list[str], environment_tools: list[str]) -> None:
    """The policy calls a tool by its name: each must be one it can write, and no two alike (one would be lost)."""
    for name in tools:
        if not name.isidentifier():
            raise ConfigError("rl.tools", f"a tool named {name!r}: the policy calls tools by name",
                              "define it with def and a name (a lambda has none)")
    seen = set()
    for name in tools + environment_tools:
        if name in seen:
            where = "rl.environment's methods and rl.tools" if name in environment_tools else "rl.tools"
            raise ConfigError("rl.tools", f"two tools are named {name!r} in {where}",
                              "rename one: the policy calls tools by name")
        seen.add(name)


def environment_tool_names(env_class) -> list[str]:
    """The tools an rl.environment class answers with: none without one, or for a Gym-style one (step)."""
    return environment_tools_of_class(env_class) if env_class is not None and not gym_style(env_class) else []


def environment_tools_of_class(env_class) -> list[str]:
    """The tool names an environment class exposes (environment_tools, on the class: no instance is made)."""
    return [name for name, fn in inspect.getmembers(env_class, inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED]


class Session:
    """One episode's environment and conversation; `answer` runs on the thread pool."""

    def __init__(self, episodes: Episodes, env, conversation: list[dict]):
        self.episodes, self.env, self.conversation = episodes, env, conversation
        self.record = EpisodeRecord(environment=env)
        self.tools = dict(episodes.tools) | (environment_tools(env) if env is not None and not gym_style(type(env))
                                            else {})
        self._step_reward = 0.0

    def answer(self, reply: str) -> tuple[list[dict], bool]:
        """The messages answering the policy's reply, and whether the episode is over (no tool call, or the
        environment said done)."""
        t = time.perf_counter()
        try:
            if self.env is not None and gym_style(type(self.env)) and not (self.tools and has_tool_call(reply)):
                return self._step(reply)  # a reply that calls a tool gets the tool's answer, any other the step's
            return self._call_tools(reply)
        finally:
            self.record.tool_seconds += time.perf_counter() - t

    def _step(self, reply: str) -> tuple[list[dict], bool]:
        """The environment's answer, within rl.tool_timeout_s; a step that raises or hangs ends the episode, counted
        as the fault it was (the run goes on)."""
        try:
            (observation, reward, done), _ = run_bounded(functools.partial(self.env.step, reply), {},
                                                         self.episodes.limits.tool_timeout_s, "step")
        except Timeout as e:
            self._fault("timeout")
            self.record.messages.append({"role": "user", "content": f"error: {e}"})
            return [], True
        except Exception as e:  # noqa: BLE001 - the user's environment
            self._fault("raised")
            self.record.messages.append({"role": "user", "content": f"error: step raised {type(e).__name__}: {e}"})
            return [], True
        self._step_reward += float(reward or 0.0)
        return ([] if done else [{"role": "user", "content": str(observation)}]), bool(done)

    def _call_tools(self, reply: str) -> tuple[list[dict], bool]:
        calls, bad = parse_tool_calls(reply)
        if not calls and not bad:
            return [], True
        limit = self.episodes.limits.max_tool_calls
        results: list[ToolResult] = list(bad)
        results += [call_tool(self.tools, c, self.episodes.limits.tool_timeout_s) for c in calls[:limit]]
        results += [ToolResult(c.name, f"error: more than {limit} tool calls in one turn; only the first {limit} ran",
                               "too_many_calls") for c in calls[limit:]]
        self.record.tool_calls += len(results)
        for r in results:
            if r.fault:
                self._fault(r.fault)
        return [{"role": "tool", "content": r.text} for r in results], False

    def _fault(self, fault: str) -> None:
        self.record.faults[fault] = self.record.faults.get(fault, 0) + 1

    def finish(self) -> EpisodeRecord:
        """The record, with the environment's reward read now that the episode is over: its `reward` (an attribute, a
        property or a method), else the sum of its step rewards."""
        env, rec = self.env, self.record
        if env is not None:
            if not hasattr(env, "reward"):  # a Gym-style environment's step rewards, summed; none for a tool one
                rec.reward = self._step_reward if gym_style(type(env)) else None
            else:
                try:
                    value = env.reward() if callable(env.reward) else env.reward
                except Exception as e:  # noqa: BLE001 - the user's environment: one line, naming it
                    raise UserError(f"rl.environment: {type(env).__name__}.reward raised {type(e).__name__}: "
                                    f"{first_line(e)}; fix the environment's reward") from None
                rec.reward = None if value is None else float(value)
        return rec


@dataclass
class _Episode:
    session: Session
    sampled: list[bool] = field(default_factory=list)
    answer: concurrent.futures.Future | None = None
    last: Sample | None = None


class EpisodeGenerator:
    """A Generator (rollout/generator.py) whose samples are whole episodes, over an engine that can take rows back
    (extend / resume: our engine and vLLM). The rollout loop sees it as any engine."""

    def __init__(self, engine, episodes: Episodes, workers: int = 8):
        self.engine, self.episodes = engine, episodes
        cap = engine.capabilities
        self.capabilities = Capabilities(per_sample_streams=cap.per_sample_streams, migrates_rows=False,
                                         partial_rollouts=False, trainer_logprobs=cap.trainer_logprobs,
                                         reproducible=cap.reproducible)
        self.name = getattr(engine, "name", "engine")
        self._answers = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rlfuse-episode")
        self._waiting = 0
        self._earlier_stats = EngineStats()

    # the engine's own: weights, dtype
    dtype = property(lambda self: self.engine.dtype)
    shares_weights = property(lambda self: self.engine.shares_weights)
    transient_weights = property(lambda self: self.engine.transient_weights)

    @property
    def stats(self) -> EngineStats:
        """The engine's counts over the whole rollout (each resume starts the engine's own again)."""
        return self._earlier_stats + self.engine.stats

    @property
    def live_rows(self) -> int:
        """Rows decoding and episodes waiting for an answer: both finish later (the fusion policy's tail)."""
        return self.engine.live_rows + self._waiting

    def load_weights(self, tensors) -> int:
        return self.engine.load_weights(tensors)

    def release_weights(self) -> int:
        return self.engine.release_weights()

    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int, lengths=None,
                 prompt_ids: list[int] | None = None, rows: list | None = None) -> Iterator[Sample]:
        """Every (prompt, sample index) episode once, as it finishes: a Sample whose token_ids are every turn and
        answer after the prompt, `sampled` marking the policy's tokens, `episode` its record. rows: each prompt's
        data row (RolloutRequest.rows), else found by the prompt's token ids."""
        if lengths is not None:
            raise ValueError("episodes: per-sample length overrides are not supported")
        if rows is not None and len(rows) != len(prompts):
            raise ValueError(f"episodes: {len(rows)} data rows for {len(prompts)} prompts")
        ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        rows_of = dict(zip(ids, rows)) if rows is not None else {}
        limits = self.episodes.limits
        turn = min(params.max_new_tokens, limits.turn_tokens, limits.max_tokens)
        params = SamplingParams(turn, params.temperature, params.top_k, params.top_p, params.stop_strings,
                                params.stop_token_ids)
        self._earlier_stats = EngineStats()
        turns = self.engine.generate(prompts, k, params, seed, None, prompt_ids)
        if self.engine.capabilities.keeps_turn_kv:  # after generate, which starts a rollout with none kept
            self.engine.keep_finished_kv(True)
        return self._run(turns, params, seed, rows_of)

    def _run(self, turns: Iterator[Sample], params: SamplingParams, seed: int, rows_of: dict) -> Iterator[Sample]:
        limits, live = self.episodes.limits, {}
        with tool_prints_kept():  # one stdout for the rollout's concurrent tool calls
            yield from self._episodes(turns, params, seed, limits, live, rows_of)

    def _episodes(self, turns, params: SamplingParams, seed: int, limits: EpisodeLimits, live: dict, rows_of: dict):
        try:
            while True:
                sample = next(turns, None)
                if sample is None:
                    pending = [e for e in live.values() if e.answer is not None]
                    if not pending:
                        break
                    concurrent.futures.wait([e.answer for e in pending], return_when="FIRST_COMPLETED")
                    rows, finished = self._answered(live, limits, params)
                    yield from finished
                    if rows:
                        self._earlier_stats += self.engine.stats
                        turns = self.engine.resume(EngineState(seed, params, rows))
                    continue
                key = (sample.prompt_id, sample.sample_index)
                if key not in live:
                    live[key] = _Episode(self.episodes.start(sample.prompt_id, sample.prompt_ids,
                                                             rows_of.get(sample.prompt_id)))
                ep = live[key]
                new = sample.token_ids[len(ep.sampled):]
                ep.sampled += [True] * len(new)
                ep.last = sample
                rec = ep.session.record
                rec.turns += 1
                reply = self.episodes.tokenizer.decode(new, skip_special_tokens=True)
                rec.messages.append({"role": "assistant", "content": reply})
                if sample.finish_reason == "length":  # a turn cut short: its answer would read a broken reply
                    rec.truncated = "tokens"
                    yield self._finish(live.pop(key))
                    continue
                self._waiting += 1
                ep.answer = self._answers.submit(ep.session.answer, reply)
                if not self.episodes.overlap_tools:  # answered before the next decode step: the same step every run
                    concurrent.futures.wait([ep.answer])
                rows, finished = self._answered(live, limits, params)
                yield from finished
                if rows:
                    self.engine.extend(EngineState(seed, params, rows))
        finally:
            self._waiting = 0
            if self.engine.capabilities.keeps_turn_kv:
                self.engine.keep_finished_kv(False)
            for ep in live.values():
                if ep.answer is not None:
                    ep.answer.cancel()

    def _answered(self, live: dict, limits: EpisodeLimits,
                  params: SamplingParams) -> tuple[list[RowState], list[Sample]]:
        """The episodes whose answer has come: rows to decode their next turn, or finished episodes."""
        rows, finished = [], []
        for key in [k for k, e in live.items() if e.answer is not None and e.answer.done()]:
            ep = live[key]
            messages, done = ep.answer.result()
            ep.answer, self._waiting = None, self._waiting - 1
            rec, s = ep.session.record, ep.last
            if done:
                finished.append(self._finish(live.pop(key)))
                continue
            if rec.turns >= limits.max_turns:
                rec.messages += messages
                rec.truncated = "turns"
                finished.append(self._finish(live.pop(key)))
                continue
            segment = encode_rendered(self.episodes.tokenizer, next_segment(
                self.episodes.tokenizer, ep.session.conversation + rec.messages, messages, s.finish_reason == "eos"))
            rec.messages += messages
            used = len(s.token_ids) + len(segment)
            if used >= limits.max_tokens:
                rec.truncated = "tokens"
                finished.append(self._finish(live.pop(key)))
                continue
            ep.sampled += [False] * len(segment)
            limit = min(used + params.max_new_tokens, limits.max_tokens)
            tokens = list(s.token_ids) + segment
            rows.append(RowState(s.prompt_id, s.sample_index, list(s.prompt_ids), tokens,
                                 s.logprobs.tolist() + [0.0] * len(segment), limit, stop_from=len(tokens)))
        return rows, finished

    def _finish(self, ep: _Episode) -> Sample:
        s, rec = ep.last, ep.session.finish()
        if self.engine.capabilities.keeps_turn_kv:
            self.engine.drop_kv(s.prompt_id, s.sample_index)
        n = len(s.token_ids)
        return Sample(s.prompt_id, s.sample_index, s.prompt_ids, s.token_ids, s.logprobs,
                      "length" if rec.truncated else s.finish_reason, sampled=ep.sampled[:n], episode=rec)


def episode_metrics(records: list[EpisodeRecord], sampled: int, masked: int) -> dict[str, float]:
    """episode/*: turns and tool calls per episode, the tool calls' error rate and each fault's count (printed
    included), the share
    truncated at a limit, tokens sampled vs appended, seconds answering turns (summed over episodes: they overlap
    with decoding)."""
    n = len(records)
    if not n:
        return {}
    calls = sum(r.tool_calls for r in records)
    faults = Counter()
    for r in records:
        faults.update(r.faults)
    out = {"episode/turns": sum(r.turns for r in records) / n, "episode/tool_calls": calls / n,
           # a tool that printed still answered: counted as a fault, not as an error
           "episode/tool_error_rate": sum(c for f, c in faults.items() if f != "printed") / calls if calls else 0.0,
           # well formed: valid JSON naming a tool the episode has (whatever the tool then did)
           "episode/tool_calls_valid": (calls - faults["bad_call"] - faults["unknown_tool"]) / calls if calls else 0.0,
           "episode/truncated": sum(r.truncated is not None for r in records) / n,
           "episode/truncated_turns": sum(r.truncated == "turns" for r in records) / n,
           "episode/tokens_sampled": sampled / n, "episode/tokens_appended": masked / n,
           "time/tools": sum(r.tool_seconds for r in records)}
    rewards = [r.reward for r in records if r.reward is not None]
    if rewards:
        out["episode/env_reward"] = sum(rewards) / len(rewards)
    return out | {f"episode/faults/{f}": float(c) for f, c in faults.items()}
