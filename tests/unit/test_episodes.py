"""Multi-turn episodes (rollout/episodes.py): the tokens a 3-turn episode is made of and which of them the update
trains on, by hand; the limits; every fault as the tool's message; the template check; and, on a tiny real model,
the same episodes whatever the batch, with log-probs that equal a full forward of the whole episode."""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from rlfuse.algos.advantages import gae_advantages
from rlfuse.algos.kl import kl_shaped_rewards
from rlfuse.data.chat import CHATML, next_segment
from rlfuse.errors import ConfigError, DataError, UserError
from rlfuse.rollout.engine import EngineStats
from rlfuse.rollout.episodes import (EpisodeGenerator, EpisodeLimits, Episodes, check_episode_template,
                                     check_tool_names, environment_tools_of_class, episode_metrics, episode_prompt)
from rlfuse.rollout.generator import ENGINES
from rlfuse.rollout.state import EngineState, RowState, Sample, SamplingParams

SPECIAL = {"<|im_end|>": 1, "<|im_start|>": 2}


class CharTok:
    """One id per character, the two ChatML markers one id each: hand-countable token ids."""
    eos_token_id = 0
    name_or_path = "char-model"

    def __init__(self, template=CHATML):
        self.chat_template = template

    def __call__(self, text, add_special_tokens=False):
        ids = []
        for part in re.split(r"(<\|im_end\|>|<\|im_start\|>)", text):
            ids += [SPECIAL[part]] if part in SPECIAL else [ord(c) for c in part]
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=False):
        names = {v: k for k, v in SPECIAL.items()}
        return "".join("" if i in names and skip_special_tokens else names.get(i, chr(i)) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        import jinja2

        return jinja2.Template(self.chat_template).render(messages=messages,
                                                          add_generation_prompt=add_generation_prompt)


TOK = CharTok()
ids = lambda text: TOK(text)["input_ids"]
END = "<|im_end|>"


class Scripted:
    """An engine that answers each (prompt, sample) row with the next turn of its script, as our engine's extend /
    resume contract says: a row comes back with its tokens so far and the new turn after them."""
    capabilities = replace(ENGINES["rlfuse"], keeps_turn_kv=False)
    dtype, shares_weights, transient_weights = torch.float32, True, False

    def __init__(self, script: dict):
        self.script, self.turn, self.live_rows, self.stats = script, {}, 0, EngineStats()

    def generate(self, prompts, k, params, seed, lengths=None, prompt_ids=None):
        rows = [RowState(pid, j, p, [], [], params.max_new_tokens)
                for pid, p in zip(prompt_ids or range(len(prompts)), prompts) for j in range(k)]
        return self.resume(EngineState(seed, params, rows))

    def resume(self, state):
        self.queue = deque(state.rows)
        return self._loop()

    def extend(self, state):
        self.queue.extend(state.rows)

    def _loop(self):
        while self.queue:
            r = self.queue.popleft()
            n = self.turn.get((r.prompt_id, r.sample_index), 0)
            self.turn[(r.prompt_id, r.sample_index)] = n + 1
            new = ids(self.script[(r.prompt_id, r.sample_index)][n])
            room = r.limit - len(r.token_ids)
            reason = "length" if len(new) > room else "eos"
            new = new[:room]
            yield Sample(r.prompt_id, r.sample_index, r.prompt_ids, r.token_ids + new,
                         torch.tensor(r.logprobs + [-0.5] * len(new)), reason)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def call(name, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def run(script, prompt="2+3+1?", tools=None, environment=None, k=1, **limits):
    episodes = Episodes(TOK, tools if tools is not None else {"add": add}, environment,
                        EpisodeLimits(**({"max_tokens": 2000, "turn_tokens": 400} | limits)))
    prompt_ids = ids(TOK.apply_chat_template(episode_prompt(prompt, episodes.schemas), add_generation_prompt=True))
    episodes.rows = {tuple(prompt_ids): (prompt, {"answer": "6"})}
    gen = EpisodeGenerator(Scripted(script), episodes)
    out = list(gen.generate([prompt_ids], k, SamplingParams(max_new_tokens=400), seed=0))
    return sorted(out, key=lambda s: s.sample_index), prompt_ids


def segment(role, content):
    return ids(f"\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n")


def test_a_three_turn_episode_by_hand():
    t1, t2, t3 = call("add", a=2, b=3) + END, call("add", a=5, b=1) + END, "6" + END
    [s], prompt_ids = run({(0, 0): [t1, t2, t3]})
    # token in, token out: the policy's turns as sampled, each tool result as its own segment between them
    assert s.token_ids == ids(t1) + segment("tool", "5") + ids(t2) + segment("tool", "6") + ids(t3)
    assert s.sampled == ([True] * len(ids(t1)) + [False] * len(segment("tool", "5")) + [True] * len(ids(t2)) +
                         [False] * len(segment("tool", "6")) + [True] * len(ids(t3)))
    # appended tokens carry no sampling log-prob
    assert s.logprobs.tolist() == [-0.5 if m else 0.0 for m in s.sampled]
    rec = s.episode
    assert (rec.turns, rec.tool_calls, rec.faults, rec.truncated) == (3, 2, {}, None)
    assert [m["role"] for m in rec.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert rec.messages[-1]["content"] == "6" and rec.messages[1]["content"] == "5"
    assert s.finish_reason == "eos"
    # the prompt describes the tool in a system turn
    assert '"name": "add"' in TOK.decode(prompt_ids) and TOK.decode(prompt_ids).startswith("<|im_start|>system")


def test_the_update_reads_only_sampled_tokens():
    """A turn, a tool segment, a turn: the KL-shaped reward lands on the last sampled token, GAE runs over the
    sampled tokens alone (the next value after turn 1 is turn 2's first), nothing falls on the tool's tokens."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]])  # sampled, tool, tool, sampled, padding
    values = torch.tensor([[0.5, 9.0, 9.0, 0.2, 9.0]])
    rewards = torch.tensor([[0.0, 7.0, 7.0, 1.0, 7.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # sampled only: v = [0.5, 0.2], r = [0, 1]: delta = [0.9 * 0.2 - 0.5, 1 - 0.2] = [-0.32, 0.8]
    assert_close(adv, torch.tensor([[-0.32 + 0.45 * 0.8, 0.0, 0.0, 0.8, 0.0]]))
    assert_close(ret, torch.tensor([[-0.32 + 0.45 * 0.8 + 0.5, 0.0, 0.0, 1.0, 0.0]]))
    shaped = kl_shaped_rewards(torch.tensor([2.0]), torch.tensor([[0.1, 0.7, 0.7, 0.2, 0.0]]), mask, 1.0)
    assert_close(shaped, torch.tensor([[-0.1, 0.0, 0.0, -0.2 + 2.0, 0.0]]))
    # a right-padded single-turn mask: the same numbers as before gaps were handled
    plain = torch.tensor([[1.0, 1.0, 0.0]])
    a, _ = gae_advantages(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.3, 0.6, 0.0]]), plain, 1.0, 1.0)
    assert_close(a, torch.tensor([[0.7, 0.4, 0.0]]))


def test_the_loss_and_kl_leave_the_tool_tokens_out(tiny):
    """grpo's clipped loss with the KL in it, on samples whose middle tokens are a tool's: whatever the old and
    reference log-probs and the advantages say at those tokens, the loss and its gradient are the same."""
    import dataclasses

    from helpers import hand_experience
    from rlfuse.config import RLConfig
    from rlfuse.learn.losses import micro_policy_loss

    _, model = tiny
    exp = hand_experience(model, n=4, k=2, longest=6)
    exp.mask[:, 1:3] = 0.0  # tokens 1 and 2 of every response: a tool's
    rl = RLConfig(algo="grpo", k=2)
    adv = torch.randn(4, exp.mask.shape[1])

    def loss_and_grad(e, a):
        model.zero_grad()
        loss, _ = micro_policy_loss(model, e, [0, 1, 2, 3], a, rl, 0.5, 0, 1.0)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    tool = torch.zeros_like(exp.mask, dtype=torch.bool)
    tool[:, 1:3] = True
    other = dataclasses.replace(exp, logprobs=exp.logprobs.masked_fill(tool, -20.0),
                                ref_logprobs=exp.ref_logprobs.masked_fill(tool, 3.0))
    a, ga = loss_and_grad(exp, adv)
    b, gb = loss_and_grad(other, adv.masked_fill(tool, 100.0))
    assert a == pytest.approx(b, abs=1e-6) and all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ga, gb))
    c, _ = loss_and_grad(dataclasses.replace(exp, mask=torch.where(tool, 1.0, exp.mask)), adv.masked_fill(tool, 100.0))
    assert abs(c - a) > 1e-3  # the same change at sampled tokens does move it


def test_a_turn_ended_by_a_stop_string_is_closed_by_the_segment():
    tok = CharTok()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "guess 5"}]
    assert next_segment(tok, conversation, [{"role": "user", "content": "higher"}], closed=False) == \
        "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


def test_limits_truncate_and_say_which():
    loop = [call("add", a=1, b=1) + END] * 5
    [s], _ = run({(0, 0): loop}, max_turns=2)
    assert (s.episode.turns, s.episode.truncated, s.finish_reason) == (2, "turns", "length")
    many = call("add", a=1, b=1) + call("add", a=2, b=2) + call("add", a=3, b=3) + END
    [s], _ = run({(0, 0): [many, "ok" + END]}, max_tool_calls=2)
    assert s.episode.faults == {"too_many_calls": 1} and s.episode.tool_calls == 3
    assert [m["content"] for m in s.episode.messages[1:4]] == ["2", "4", "error: more than 2 tool calls in one "
                                                                          "turn; only the first 2 ran"]
    [s], _ = run({(0, 0): loop}, max_tokens=len(ids(loop[0])) + 20)  # no room for the tool's segment
    assert (s.episode.truncated, s.episode.turns) == ("tokens", 1)
    [s], _ = run({(0, 0): ["x" * 50 + END]}, turn_tokens=10)  # a turn cut at rl.max_new_tokens (the turn's limit)
    assert (s.episode.truncated, len(s.token_ids)) == ("tokens", 10)


def test_every_fault_is_the_tools_message_and_the_episode_goes_on(capsys):
    def raises(x: int) -> str:
        """Raise."""
        raise ValueError("boom")

    def not_text(x: int) -> str:
        """A dict."""
        return {"a": x}

    def hangs(x: int) -> str:
        """Sleep."""
        time.sleep(3)
        return "late"

    def prints(x: int) -> str:
        """Print."""
        print("noise")
        return "ok"

    tools = {f.__name__: f for f in (raises, not_text, hangs, prints)}
    turn = "".join(call(n, x=1) for n in tools) + call("nope", x=1) + "<tool_call>{bad json</tool_call>" + END
    [s], _ = run({(0, 0): [turn, "done" + END]}, tools=tools, max_tool_calls=10, tool_timeout_s=0.5)
    assert s.episode.faults == {"raised": 1, "not_text": 1, "timeout": 1, "printed": 1, "unknown_tool": 1,
                                "bad_call": 1}
    assert s.episode.turns == 2 and s.episode.truncated is None
    assert "noise" not in capsys.readouterr().out  # a tool's prints stay off the run's terminal
    m = episode_metrics([s.episode], sampled=10, masked=5)
    assert m["episode/tool_error_rate"] == 5 / 6 and m["episode/faults/printed"] == 1.0  # printed: answered, counted
    assert m["episode/tool_calls"] == 6 and m["episode/turns"] == 2


class Guess:
    """A Gym-style game: find the number; the environment answers higher or lower."""

    def reset(self, answer, **row):
        self.target, self.tries = int(answer), 0

    def step(self, text):
        self.tries += 1
        guess = int(re.sub(r"\D", "", text) or -1)
        if guess == self.target:
            return "", 1.0 / self.tries, True
        return ("higher" if guess < self.target else "lower"), 0.0, False


def test_a_gym_style_environment_answers_in_user_turns():
    [s], _ = run({(0, 0): ["3" + END, "8" + END, "6" + END]}, tools={}, environment=Guess)
    rec = s.episode
    assert [m["content"] for m in rec.messages] == ["3", "higher", "8", "lower", "6"]
    assert rec.reward == pytest.approx(1 / 3) and rec.turns == 3
    assert s.token_ids == ids("3" + END) + segment("user", "higher") + ids("8" + END) + segment("user", "lower") + \
        ids("6" + END)


def test_tools_beside_a_gym_style_environment():
    [s], _ = run({(0, 0): [call("add", a=2, b=2) + END, "4" + END, "6" + END]}, environment=Guess)
    assert [m["content"] for m in s.episode.messages] == [call("add", a=2, b=2), "4", "4", "higher", "6"]
    assert [m["role"] for m in s.episode.messages] == ["assistant", "tool", "assistant", "user", "assistant"]


class Broken(Guess):
    def reset(self, answer, **row):
        raise KeyError("level")


class StepRaises(Guess):
    def step(self, text):
        raise RuntimeError("lost")


class StepHangs(Guess):
    def step(self, text):
        time.sleep(30)


def test_environment_faults():
    with pytest.raises(UserError, match=r"rl.environment: Broken.reset raised KeyError: 'level' on the row of "
                                        r"prompt 0 \(answer='6'\); fix reset or that row"):
        run({(0, 0): ["3" + END]}, tools={}, environment=Broken)
    [s], _ = run({(0, 0): ["3" + END]}, tools={}, environment=StepRaises)
    assert s.episode.faults == {"raised": 1} and s.episode.turns == 1  # the episode ends, the run goes on
    t = time.perf_counter()
    [s], _ = run({(0, 0): ["3" + END]}, tools={}, environment=StepHangs, tool_timeout_s=0.3)
    assert s.episode.faults == {"timeout": 1} and time.perf_counter() - t < 10


class Counter_:
    """TRL's environment_factory form: public methods are the tools, the reward is read at the end."""

    def reset(self, **row):
        self.n = 0

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much.
        """
        self.n += by
        return str(self.n)

    @property
    def reward(self):
        return float(self.n == 3)


class Hidden:
    """A game whose prompt is the same for every row: only the row's hidden target tells the episodes apart."""

    def reset(self, target, **row):
        self.target = target

    def step(self, text):
        return "", 0.0, True

    @property
    def reward(self):
        return float(self.target)


def by_target(completions, target, **kwargs):
    return [float(t) for t in target]


def test_each_episode_plays_its_own_row_where_prompts_render_the_same():
    from rlfuse.models.rewards import FunctionReward

    episodes = Episodes(TOK, {}, Hidden, EpisodeLimits(max_tokens=2000, turn_tokens=400))
    prompt_ids = ids(TOK.apply_chat_template(episode_prompt("Guess my number.", []), add_generation_prompt=True))
    episodes.rows = {tuple(prompt_ids): ("Guess my number.", {"target": 50})}  # by token ids: one row for both
    gen = EpisodeGenerator(Scripted({(0, 0): ["4"], (1, 0): ["4"]}), episodes)
    rows = [("Guess my number.", {"target": 3}), ("Guess my number.", {"target": 7})]
    out = sorted(gen.generate([prompt_ids, prompt_ids], 1, SamplingParams(max_new_tokens=400), seed=0, rows=rows),
                 key=lambda s: s.prompt_id)
    assert [s.episode.reward for s in out] == [3.0, 7.0]
    assert FunctionReward([by_target], None, TOK)(out).tolist() == [3.0, 7.0]  # reward functions read it too
    without = list(EpisodeGenerator(Scripted({(0, 0): ["4"]}), episodes).generate(
        [prompt_ids], 1, SamplingParams(max_new_tokens=400), seed=0))
    assert without[0].episode.reward == 50.0  # no rows given: found by the prompt's token ids


def test_an_iterations_rows_are_drawn_with_its_prompts():
    from rlfuse.config import load_config
    from rlfuse.trainers.rl import IterationRequests

    rl = load_config(None, ["rl.prompts_per_iter=4", "rl.k=4", "rl.mini_batch_size=16"]).rl
    prompts, rows = [[i] for i in range(10)], [("same prompt", {"i": i}) for i in range(10)]
    with_rows = IterationRequests(prompts, None, rl, SamplingParams(8), 3, rows)
    for it, draw in ((0, 0), (5, 0), (5, 1)):
        request = with_rows(it, draw)
        assert [r[1]["i"] for r in request.rows] == [p[0] for p in request.prompts]
        assert request.prompts == IterationRequests(prompts, None, rl, SamplingParams(8), 3)(it, draw).prompts


def test_an_environment_whose_methods_are_the_tools():
    [s], prompt_ids = run({(0, 0): [call("increment", by=1) + END, call("increment", by=2) + END, "3" + END]},
                          tools={}, environment=Counter_)
    assert s.episode.reward == 1.0 and s.episode.tool_calls == 2
    assert '"name": "increment"' in TOK.decode(prompt_ids) and '"self"' not in TOK.decode(prompt_ids)


def test_a_template_that_rewrites_turns_is_refused_at_start_up():
    rewriting = CharTok("{% for m in messages[-2:] %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    episodes = Episodes(rewriting, {"add": add})
    with pytest.raises(DataError, match="the chat template of char-model: .*rewrites earlier turns.*chatml"):
        check_episode_template(rewriting, [{"role": "user", "content": "hi"}], episodes)
    check_episode_template(TOK, [{"role": "user", "content": "hi"}], Episodes(TOK, {"add": add}))


# ---- a tiny real model on our engine: same episodes whatever the batch, log-probs of the whole episode ----

class Echo:
    """Three turns whatever the model says; the observation depends on the reply (so a changed turn shows)."""

    def reset(self, **row):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        return f"len {len(text)}", float(len(text) % 3), self.turn >= 3


@pytest.fixture(scope="module")
def tiny(tiny_task):
    from rlfuse.models.load import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_task.model_dir))
    tok.chat_template = CHATML
    return tok, load_causal_lm(str(tiny_task.model_dir)).eval()


def tiny_episodes(tiny, max_rows, seed=3, overlap=False, keep_kv=True, stats=None, fast_decode=True):
    from rlfuse.data.prompts import encode_prompt
    from rlfuse.rollout.engine import DecodeEngine

    tok, model = tiny
    rows = [("the film was", {}), ("i really", {}), ("a story", {})]
    episodes = Episodes(tok, {}, Echo, EpisodeLimits(max_turns=3, max_tokens=90, turn_tokens=12))
    prompts = [encode_prompt(tok, episode_prompt(p, [])) for p, _ in rows]
    episodes.rows = {tuple(ids): row for ids, row in zip(prompts, rows)}
    episodes.overlap_tools = overlap
    engine = DecodeEngine(model, tok.eos_token_id, max_rows=max_rows, tokenizer=tok, fast_decode=fast_decode)
    if not keep_kv:  # every turn prefills the whole conversation again
        engine.capabilities = replace(engine.capabilities, keeps_turn_kv=False)
    gen = EpisodeGenerator(engine, episodes)
    # a third of the vocabulary ends a turn, so a random tiny model's turns end before the limit
    params = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(range(0, 1024, 3)))
    out = sorted(gen.generate(prompts, 2, params, seed), key=lambda s: (s.prompt_id, s.sample_index))
    if stats is not None:
        stats.append(gen.stats)
    return prompts, out


def test_same_episodes_whatever_the_batch(tiny):
    _, one = tiny_episodes(tiny, max_rows=1)
    _, many = tiny_episodes(tiny, max_rows=64)
    _, overlapped = tiny_episodes(tiny, max_rows=64, overlap=True)  # rows rejoin as their answers come
    assert [s.episode.turns for s in one] and max(s.episode.turns for s in one) >= 2
    for a, b, c in zip(one, many, overlapped):
        assert b.token_ids == c.token_ids and b.episode.messages == c.episode.messages
        assert a.token_ids == b.token_ids and a.sampled == b.sampled
        assert a.episode.messages == b.episode.messages and a.episode.reward == b.episode.reward
        assert_close(a.logprobs, b.logprobs)
    _, other_seed = tiny_episodes(tiny, max_rows=64, seed=4)
    assert [s.token_ids for s in other_seed] != [s.token_ids for s in many]


@pytest.mark.parametrize("fast_decode", [True, False], ids=["own-step", "transformers-cache"])
def test_a_kept_turn_cache_prefills_only_the_answer_and_changes_no_episode(tiny, fast_decode):
    kept, again = [], []
    prompts, a = tiny_episodes(tiny, max_rows=64, stats=kept, fast_decode=fast_decode)
    _, b = tiny_episodes(tiny, max_rows=64, keep_kv=False, stats=again)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.sampled == y.sampled and x.episode.messages == y.episode.messages
        assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=1e-5)
    # where each later turn starts: after the answer appended to the turn before
    starts = [(len(s.prompt_ids), i) for s in a for i in range(1, len(s.sampled))
              if s.sampled[i] and not s.sampled[i - 1]]
    assert len(starts) >= 3
    once = sum(len(p) for p in prompts)  # a prompt's samples share its prefill
    # without the kept cache, a later turn prefills the prompt and everything before it
    assert again[0].prefill_tokens == once + sum(p + i for p, i in starts)
    # with it, the previous turn's last token (no forward read it yet) and the appended answer
    assert kept[0].prefill_tokens == once + len(starts) + sum(s.sampled.count(False) for s in a)


def test_episode_logprobs_equal_one_forward_of_the_whole_episode(tiny):
    from rlfuse.models.forward import collate, response_logprobs

    tok, model = tiny
    prompts, samples = tiny_episodes(tiny, max_rows=4)
    multi = [s for s in samples if False in s.sampled]
    assert multi, "no episode got a second turn"
    mb = collate([s.prompt_ids for s in multi], [s.token_ids for s in multi], tok.pad_token_id or 0, "cpu")
    with torch.no_grad():
        full = response_logprobs(model, mb, 1.0)
    for b, s in enumerate(multi):
        sampled = torch.tensor(s.sampled)
        assert_close(s.logprobs[sampled], full[b, : len(s.token_ids)][sampled], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides,field,fix", [
    (["rl.reward=environment"], "rl.reward", "set rl.environment=module:Class"),
    (["rl.environment=rlfuse.data.arithmetic:exact_match", "rl.max_staleness=1", "placement.strategy=separated",
      "rl.partial_rollout_after=4"], "rl.environment", "set rl.partial_rollout_after=0"),
    (["rl.tools=rlfuse.data.arithmetic:exact_match", "rl.max_episode_tokens=10", "rl.max_new_tokens=48"],
     "rl.max_episode_tokens", "set it >= 48"),
    (["rl.tools=rlfuse.data.arithmetic:exact_match", "rl.max_turns=0"], "rl.max_turns", ""),
    (["rl.tools=nowhere_module:fn"], "rl.tools", ""),
])
def test_episode_settings_are_checked_before_anything_loads(overrides, field, fix):
    from rlfuse.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.field == field and fix in str(e.value), str(e.value)


class NeedsLevel:
    def __init__(self, level):
        self.level = level

    def reset(self, **row):
        pass


@pytest.mark.parametrize("spec,problem,fix", [
    ("rlfuse.data.arithmetic:calculator", "is a function, not a class", "plain tool functions go in rl.tools"),
    ("collections:OrderedDict", "has no reset method", "add def reset(self, **row)"),
    ("test_episodes:NeedsLevel", "cannot be made without arguments", "give its __init__ defaults"),
])
def test_an_environment_that_is_not_a_class_with_reset_is_refused_as_it_loads(spec, problem, fix):
    from rlfuse.config import load_config

    cfg = load_config(None, [f"rl.environment={spec}"])  # the config is fine: the code it names is not
    with pytest.raises(ConfigError) as e:
        Episodes.from_config(cfg.rl, tokenizer=None)
    assert e.value.field == "rl.environment" and problem in e.value.problem and fix in e.value.fix, str(e.value)
    Episodes.from_config(load_config(None, ["rl.environment=rlfuse.data.guessing:GuessNumber"]).rl, tokenizer=None)


def test_tool_names_the_policy_cannot_call_or_that_clash_are_refused():
    check_tool_names(["add", "calculator"], ["increment"])
    with pytest.raises(ConfigError, match=r"rl.tools: a tool named '<lambda>'.* define it with def"):
        check_tool_names(["<lambda>"], [])
    with pytest.raises(ConfigError, match=r"rl.tools: two tools are named 'increment'.*rename one"):
        check_tool_names(["increment"], environment_tools_of_class(Counter_))


def test_fused_scoring_of_episodes_gives_the_unfused_numbers(tiny):
    """An episode is scored as soon as it ends while others decode (rollout.fusion): the same episodes, rewards and
    reference log-probs as scoring them all at the end."""
    from rlfuse.data.prompts import encode_prompt
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.fusion import FusionPolicy, generate_rollouts
    from rlfuse.rollout.score import Scorer

    tok, model = tiny
    rows = [("the film was", {}), ("i really", {}), ("a story", {})]
    prompts = [encode_prompt(tok, episode_prompt(p, [])) for p, _ in rows]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(range(0, 1024, 3)))
    out = {}
    for fused in (False, True):
        episodes = Episodes(tok, {}, Echo, EpisodeLimits(max_turns=3, max_tokens=90, turn_tokens=12),
                            rows={tuple(ids): row for ids, row in zip(prompts, rows)})
        gen = EpisodeGenerator(DecodeEngine(model, tok.eos_token_id, max_rows=4, tokenizer=tok), episodes)
        scorer = Scorer(lambda samples: torch.zeros(len(samples)), 0, ref=model, micro_batch_size=2)
        out[fused] = generate_rollouts(gen, scorer, prompts, 2, params, 3, FusionPolicy(fused, score_every=2))
    a, b = out[False], out[True]
    assert b.timing["scoring_during_decode"] > 0  # scored while other episodes were still running
    assert a.response_ids == b.response_ids and torch.equal(a.mask, b.mask) and bool((a.mask == 0).any())
    assert_close(a.scores, b.scores)
    assert bool((a.scores != 0).any())  # the environment's reward
    assert_close(a.ref_logprobs, b.ref_logprobs)
    assert [e.turns for e in a.episodes] == [e.turns for e in b.episodes]
