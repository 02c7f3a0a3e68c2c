"""The generator interface: the engine table and its choice, the vLLM engine's pure parts (seeds, finish reasons,
sampling keywords, the error lines), the one scoring loop, the sampled-token mask and the mismatch metric."""

from __future__ import annotations

import builtins
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlfuse.algos.offpolicy import logprob_mismatch
from rlfuse.config import Config
from rlfuse.config.validate import validate
from rlfuse.errors import ConfigError, UserError
from rlfuse.learn.losses import micro_policy_loss
from rlfuse.plan.resolve import engine_choice
from rlfuse.rollout.engine import DecodeEngine
from rlfuse.rollout.fusion import FusionPolicy, ScoringLoop, build_experience
from rlfuse.rollout.generator import ENGINES
from rlfuse.rollout.score import ScoredSample
from rlfuse.rollout.state import Sample, SamplingParams
from rlfuse.rollout.streams import stream_keys
from rlfuse.rollout.vllm_engine import VllmEngine, finish_reason, load_error_line, request_seed, sampling_kwargs


def cfg_with(**rollout) -> Config:
    cfg = Config()
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_engine_choice_table():
    assert engine_choice(cfg_with(engine="auto"), cuda=True, has_vllm=True)[0] == "vllm"
    assert engine_choice(cfg_with(engine="auto"), cuda=False, has_vllm=True)[0] == "rlfuse"
    assert engine_choice(cfg_with(engine="auto"), cuda=True, has_vllm=False)[0] == "rlfuse"
    name, why = engine_choice(cfg_with(engine="auto"), cuda=False, has_vllm=False)
    assert "not installed" in why
    assert engine_choice(cfg_with(engine="vllm"), cuda=False, has_vllm=False)[0] == "vllm"  # as asked: its error
    ray = cfg_with(engine="auto")
    ray.placement.strategy = "flattened"
    assert engine_choice(ray, cuda=True, has_vllm=True)[0] == "rlfuse"


def test_each_engine_declares_what_it_promises():
    assert DecodeEngine.capabilities is ENGINES["rlfuse"] and VllmEngine.capabilities is ENGINES["vllm"]
    own, vllm = ENGINES["rlfuse"], ENGINES["vllm"]
    assert own.per_sample_streams and own.migrates_rows and own.trainer_logprobs and own.reproducible == "bitwise"
    assert not (vllm.per_sample_streams or vllm.migrates_rows or vllm.partial_rollouts or vllm.trainer_logprobs)
    assert vllm.reproducible == "same-run"


@pytest.mark.parametrize("overrides, field", [
    ({"engine": "vlm"}, "rollout.engine"),
    ({"engine": "vllm", "vllm_kv_cache_gb": 0}, "rollout.vllm_kv_cache_gb"),
])
def test_engine_fields_checked(overrides, field):
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(**overrides))
    assert field in str(e.value)


def test_vllm_refused_where_it_cannot_run():
    ray = cfg_with(engine="vllm")
    ray.placement.strategy = "flattened"
    with pytest.raises(ConfigError, match="not on workers that also train.*single or separated"):
        validate(ray)
    ray.placement.strategy = "separated"
    validate(ray)  # generation workers of its own
    ray.rl.max_staleness, ray.rl.partial_rollout_after = 1, 4
    with pytest.raises(ConfigError, match="rl.partial_rollout_after.*park"):
        validate(ray)
    shared = cfg_with(engine="vllm")
    shared.model.lora, shared.model.shared_base = True, True
    with pytest.raises(ConfigError, match="shared_base"):
        validate(shared)


def test_request_seed_is_the_samples_stream_key():
    """One seed per (seed, prompt id, sample index), the same our engine keys the sample's stream with: a sample's
    seed does not depend on which request slot or batch it gets."""
    key = stream_keys(7, torch.tensor([3]), torch.tensor([2]))
    assert request_seed(7, 3, 2) == int(key[0])
    seeds = {request_seed(s, p, j) for s in (0, 1) for p in range(4) for j in range(4)}
    assert len(seeds) == 32 and all(0 <= x < 2**32 for x in seeds)


def test_finish_reasons_and_sampling_keywords():
    assert finish_reason("length", None) == "length"
    assert finish_reason("stop", None) == "eos"       # the EOS
    assert finish_reason("stop", 2) == "eos"          # a stop token id
    assert finish_reason("stop", "\n\n") == "stop"    # a stop string
    kw = sampling_kwargs(SamplingParams(64, 0.7, 5, 0.9, ("###",), (2, 7)), limit=12, seed=99)
    assert kw["max_tokens"] == 12 and kw["seed"] == 99 and kw["logprobs"] == 0
    assert (kw["temperature"], kw["top_k"], kw["top_p"]) == (0.7, 5, 0.9)
    # vLLM's own EOS rule off: both engines stop on exactly the ids we give
    assert kw["ignore_eos"] and kw["stop_token_ids"] == [2, 7] and kw["stop"] == ["###"] and kw["detokenize"]
    plain = sampling_kwargs(SamplingParams(8), limit=8, seed=0)
    assert plain["stop"] is None and not plain["detokenize"] and plain["top_k"] == 0


def test_vllm_missing_is_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm":
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(UserError) as e:
        VllmEngine("/nowhere", 2)
    line = str(e.value)
    assert "\n" not in line and "scripts/install.sh vllm" in line and "rollout.engine=rlfuse" in line


def test_vllm_load_error_lines():
    kv = load_error_line("/m", ValueError("No available memory for the cache blocks. Try increasing KV cache"), 0.5)
    assert "rollout.vllm_kv_cache_gb=0.5" in kv and "raise rollout.vllm_kv_cache_gb" in kv
    arch = load_error_line("/m", ValueError("Model architectures ['Foo'] are not supported"), 1.0)
    assert "could not load the model in /m" in arch and "rollout.engine=rlfuse" in arch


class _Engine:
    """Yields samples one by one; live_rows as the engine would report between yields."""

    def __init__(self, n: int, live_after: list[int]):
        self.n, self.live_after, self.live_rows = n, live_after, 0

    def generate(self):
        for i in range(self.n):
            self.live_rows = self.live_after[i]
            yield Sample(i, 0, [1], [5, 6], torch.zeros(2), "eos")


class _Scorer:
    def __init__(self):
        self.calls = []

    def score(self, samples, proximal=False):
        self.calls.append([s.prompt_id for s in samples])
        return [ScoredSample(s, 1.0, torch.zeros(2), None, s.logprobs) for s in samples]


def test_scoring_loop_scores_while_rows_decode_and_in_chunks():
    engine, scorer = _Engine(7, [6, 5, 4, 3, 2, 0, 0]), _Scorer()
    loop = ScoringLoop(engine, engine.generate(), scorer, FusionPolicy(True, score_every=2, live_below=0))
    assert loop.run(max_finished=3) == 3 and not loop.done    # a worker's chunk
    assert scorer.calls == [[0, 1]] and [s.prompt_id for s in loop.pending] == [2]
    loop.run()
    # [2, 3] while rows decode; 4 and 5 finish with no row left decoding (nothing to overlap): they wait for the end
    assert loop.done and scorer.calls == [[0, 1], [2, 3]] and [s.prompt_id for s in loop.pending] == [4, 5, 6]
    loop.score_pending()
    scored, batches, _ = loop.take_scored()
    assert batches == [2, 2, 3] and [x.sample.prompt_id for x in scored] == list(range(7))
    unfused = ScoringLoop(engine, _Engine(3, [2, 1, 0]).generate(), scorer, FusionPolicy(False))
    unfused.run()
    assert len(unfused.take_pending()) == 3 and unfused.scored == []


def test_experience_mask_is_the_sampled_tokens_and_the_loss_reads_only_them():
    """A response whose middle tokens a tool wrote (Sample.sampled False there): the mask zeroes them, and the policy
    loss is the same whatever log-probs and advantages those tokens carry."""
    sampled = Sample(0, 0, [1, 4], [5, 6, 7, 8], torch.tensor([-1.0, -2.0, -3.0, -4.0]), "eos",
                     sampled=[True, False, False, True])
    plain = Sample(0, 1, [1, 4], [5, 6], torch.tensor([-1.0, -2.0]), "length")
    exp = build_experience([ScoredSample(x, 1.0, x.logprobs.clone(), None, x.logprobs) for x in (sampled, plain)])
    assert exp.mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]

    torch.manual_seed(0)
    actor = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    rl = Config().rl
    rl.algo, rl.share_prompt = "rloo", False
    adv = torch.tensor([[1.0, 2.0, 3.0, 1.0], [0.5, 0.5, 0.0, 0.0]])
    loss_a, _ = micro_policy_loss(actor, exp, [0, 1], adv, rl, 0.0, 0, 1.0)
    adv_b = adv.clone()
    adv_b[0, 1:3] = torch.tensor([-50.0, 80.0])   # the tool's tokens' advantages changed: no effect
    exp.logprobs[0, 1:3] = torch.tensor([-9.0, -0.1])
    loss_b, _ = micro_policy_loss(actor, exp, [0, 1], adv_b, rl, 0.0, 0, 1.0)
    assert float(loss_a) == pytest.approx(float(loss_b), abs=1e-6)


def test_logprob_mismatch_by_hand():
    behaviour = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = torch.tensor([[-1.0, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])   # the last token is padding
    m = logprob_mismatch(behaviour, trainer, mask)
    assert m["mismatch/logprob_abs_mean"] == pytest.approx(0.25)
    assert m["mismatch/logprob_abs_max"] == pytest.approx(0.5)
    assert m["mismatch/kl_k3"] == pytest.approx((0.0 + (math.exp(0.5) - 1 - 0.5)) / 2)
    same = logprob_mismatch(behaviour, behaviour, torch.ones(1, 3))
    assert same == {"mismatch/logprob_abs_mean": 0.0, "mismatch/logprob_abs_max": 0.0, "mismatch/kl_k3": 0.0}


def test_vllm_sync_in_buckets_reloads_once_whole():
    """vLLM re-makes each layer when it reloads: a sync sent in buckets (from another process) is kept until every
    tensor of the checkpoint has come, then loaded in one reload; a whole state dict goes in at once."""
    reloads = []

    class Runner:
        def reload_weights(self, weights_iterator):
            reloads.append(dict(weights_iterator))

    engine = object.__new__(VllmEngine)
    engine._dtype, engine._pending, engine.expected = torch.bfloat16, {}, {"a", "b", "c"}
    engine._runner = lambda: Runner()
    engine.llm = type("LLM", (), {"reset_prefix_cache": lambda self: None})()
    t = lambda v: torch.full((2,), float(v))
    engine.load_weights({"a": t(1), "b": t(2)})
    assert reloads == [] and set(engine._pending) == {"a", "b"}
    engine.load_weights([("c", t(3))])
    assert len(reloads) == 1 and set(reloads[0]) == {"a", "b", "c"} and engine._pending == {}
    assert reloads[0]["a"].dtype == torch.bfloat16 and float(reloads[0]["b"][0]) == 2.0
    assert engine.load_weights({"a": t(4), "b": t(5), "c": t(6)}) == 3 * 2 * 4   # whole: straight in, fp32 bytes
    assert len(reloads) == 2 and float(reloads[1]["c"][0]) == 6.0


def test_sampler_gap_is_zero_for_the_engines_own_model_and_sees_a_planted_error():
    """rollout/score.py sampler_gap: our fp32 engine's recorded log-probs are its model's forward (gap ~ 0); a
    log-prob moved by 0.5 at one token shows as the max gap, and padding never counts."""
    from rlfuse.rollout.score import sampler_gap

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    samples = list(DecodeEngine(model, -1).generate([[1, 5, 7], [1, 9]], 2, SamplingParams(max_new_tokens=6), seed=0))
    gap = sampler_gap(model, samples)
    assert gap["mismatch/logprob_abs_max"] < 1e-4 and gap["mismatch/kl_k3"] < 1e-6
    samples[1].logprobs[2] += 0.5
    moved = sampler_gap(model, samples)
    assert moved["mismatch/logprob_abs_max"] == pytest.approx(0.5, abs=1e-4)
    assert moved["mismatch/logprob_abs_mean"] == pytest.approx(0.5 / 24, abs=1e-4)  # 4 samples x 6 tokens
