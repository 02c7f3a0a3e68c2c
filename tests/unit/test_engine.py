"""Rollout engine semantics on a tiny real GPT-2: exact log-probs, row retirement, shared prefill, stopping, seeding,
and fused vs unfused scoring giving identical samples and scores."""

import pytest
import torch
from torch.testing import assert_close

from rlfuse.data.collate import encode
from rlfuse.data.gold import gold_reward
from rlfuse.models.heads import ValueModel
from rlfuse.models.load import load_causal_lm, load_tokenizer
from rlfuse.rollout.engine import DecodeEngine, SamplingParams, filter_logits
from rlfuse.rollout.fusion import FusionPolicy, generate_rollouts
from rlfuse.models.rewards import FunctionReward
from rlfuse.rollout.score import Scorer

PROMPTS = ["the acting", "the old detective finds the", "i really", "this film was", "later, the thief"]


@pytest.fixture(scope="module")
def lm(tiny_task):
    torch.manual_seed(0)
    return load_tokenizer(str(tiny_task.model_dir)), load_causal_lm(str(tiny_task.model_dir)).eval()


def run(lm, k=3, seed=0, max_rows=256, **kw):
    tok, model = lm
    eng = DecodeEngine(model, tok.eos_token_id, max_rows=max_rows, tokenizer=tok)
    params = SamplingParams(**({"max_new_tokens": 12} | kw))
    return eng, list(eng.generate([encode(tok, p) for p in PROMPTS], k, params, seed))


def test_every_prompt_sample_pair_once(lm):
    _, samples = run(lm, k=3)
    assert sorted((s.prompt_id, s.sample_index) for s in samples) == [(p, j) for p in range(5) for j in range(3)]


def test_logprobs_equal_one_full_forward(lm):
    tok, model = lm
    _, samples = run(lm, k=2, temperature=0.7, max_new_tokens=16)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float() / 0.7, -1)[0]
        n = len(s.prompt_ids)
        ref = logp[n - 1:-1].gather(1, torch.tensor(s.token_ids)[:, None]).squeeze(1)
        assert_close(s.logprobs, ref, atol=1e-4, rtol=0)


def test_finished_rows_leave_the_batch(lm):
    tok, _ = lm
    # EOS = a frequent token, so rows finish at different steps
    eng, samples = run(lm, k=3, max_new_tokens=20)
    common = max(set(t for s in samples for t in s.token_ids), key=lambda t: sum(s.token_ids.count(t) for s in samples))
    eng.eos = common
    samples = list(eng.generate([encode(tok, p) for p in PROMPTS], 3, SamplingParams(max_new_tokens=20), 0))
    lengths = [len(s.token_ids) for s in samples]
    assert len(set(lengths)) > 1
    # the first token of each row comes from the prefill; each later token costs exactly one decode row
    assert eng.stats.decode_rows == sum(n - 1 for n in lengths)
    assert eng.stats.decode_rows < eng.stats.decode_steps * len(samples)  # the padded alternative
    assert eng.stats.rows_per_step == sorted(eng.stats.rows_per_step, reverse=True)


def test_each_prompt_is_prefilled_once_for_k_samples(lm):
    tok, _ = lm
    eng, _ = run(lm, k=4)
    assert eng.stats.prefill_tokens == sum(len(encode(tok, p)) for p in PROMPTS)


def test_k_samples_of_a_prompt_differ(lm):
    _, samples = run(lm, k=4, max_new_tokens=10)
    for p in range(len(PROMPTS)):
        seqs = {tuple(s.token_ids) for s in samples if s.prompt_id == p}
        assert len(seqs) > 1


def test_same_seed_same_samples(lm):
    key = lambda ss: sorted((s.prompt_id, s.sample_index, tuple(s.token_ids)) for s in ss)
    assert key(run(lm, seed=5)[1]) == key(run(lm, seed=5)[1])
    assert key(run(lm, seed=5)[1]) != key(run(lm, seed=6)[1])


def test_continuous_batching_with_few_rows(lm):
    eng, samples = run(lm, k=2, max_rows=4)
    assert eng.stats.max_live_rows <= 4 and len(samples) == 10


def test_stop_reasons(lm):
    tok, _ = lm
    # greedy (near-zero temperature) so the continuation is known in advance
    _, greedy = run(lm, k=1, temperature=1e-4, max_new_tokens=6)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 6 for s in greedy)
    g0 = next(s for s in greedy if s.prompt_id == 0)
    j = next(j for j in range(1, 6) if g0.token_ids[j] not in g0.token_ids[:j])  # first new token after the start
    eng = DecodeEngine(lm[1], eos_token_id=g0.token_ids[j], tokenizer=tok)
    s0 = next(s for s in eng.generate([encode(tok, PROMPTS[0])], 1, SamplingParams(6, 1e-4), 0))
    assert s0.finish_reason == "eos" and s0.token_ids == g0.token_ids[: j + 1]
    stop = tok.decode(g0.token_ids[1:3])
    eng = DecodeEngine(lm[1], eos_token_id=tok.eos_token_id, tokenizer=tok)
    s0 = next(s for s in eng.generate([encode(tok, PROMPTS[0])], 1, SamplingParams(6, 1e-4, stop_strings=(stop,)), 0))
    assert s0.finish_reason == "stop" and len(s0.token_ids) == 3


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.75)).tolist() == [[False, False, True, True]]
    # 0.5 + 0.3 < 0.85: the third token is needed to reach top_p
    assert torch.isinf(filter_logits(logits, 0, 0.85)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.9)).tolist() == [[False, False, False, True]]


def test_fused_and_unfused_give_same_samples_and_scores(lm, tiny_task):
    tok, model = lm
    critic = ValueModel.from_causal_lm(load_causal_lm(str(tiny_task.model_dir)))
    torch.nn.init.normal_(critic.head.weight)
    ref = load_causal_lm(str(tiny_task.model_dir))
    prompts = [encode(tok, p) for p in PROMPTS]
    out = {}
    for fused in (True, False):
        scorer = Scorer(FunctionReward([gold_reward], None, tok), tok.pad_token_id, ref=ref, actor=model, critic=critic,
                        micro_batch_size=3)
        eng = DecodeEngine(model, tok.eos_token_id)
        # per-sample limits, so rows finish at different steps whatever the model draws
        out[fused] = generate_rollouts(eng, scorer, prompts, 3, SamplingParams(max_new_tokens=14), 11,
                                       FusionPolicy(fused, score_every=2, live_below=4), lengths=lambda p, j: 5 + 4 * j)
    a, b = out[True], out[False]
    assert a.response_ids == b.response_ids
    assert a.timing["scoring_during_decode"] > 0 and b.timing["scoring_during_decode"] == 0
    # rollout/prefill_tokens: each prompt once, its 3 samples sharing its prefill
    assert a.timing["prefill_tokens"] == b.timing["prefill_tokens"] == sum(map(len, prompts))
    for name in ("scores", "logprobs", "ref_logprobs", "values", "mask"):
        assert_close(getattr(a, name), getattr(b, name))
    # scorer's reference log-probs (same weights as the actor here) equal the engine's sampling log-probs
    assert_close(a.ref_logprobs, a.logprobs, atol=1e-4, rtol=0)


def test_recomputed_old_logprobs_equal_the_engines(lm):
    """The old-log-probs role (for backends that cannot report their sampling log-probs) gives the same numbers."""
    tok, model = lm
    samples = list(DecodeEngine(model, tok.eos_token_id).generate([encode(tok, p) for p in PROMPTS], 2,
                                                                  SamplingParams(max_new_tokens=10, temperature=0.8), 4))
    scorer = Scorer(FunctionReward([gold_reward], None, tok), tok.pad_token_id, actor=model, temperature=0.8,
                    micro_batch_size=4, recompute_old_logprobs=True)
    scored = scorer.score(samples)
    assert scorer.times["old_logprobs"] > 0
    for x in scored:
        assert x.old_logprobs is not x.sample.logprobs
        assert_close(x.old_logprobs, x.sample.logprobs, atol=1e-4, rtol=0)


def test_lean_gpt2_step_equals_transformers_forward(lm, monkeypatch):
    """The lean decode step (rollout/kv.py) against transformers' own forward, through retirement (EOS = a frequent
    token), continuous admission with merges of different widths (max_rows=4), left-padding cuts and buffer growth."""
    from rlfuse.rollout.kv import BufferKV

    monkeypatch.setattr(BufferKV, "GROW", 3)  # grow several times within 20 tokens
    tok, model = lm
    eng, samples = run(lm, k=3, max_new_tokens=20, seed=3, max_rows=4)
    assert eng.fast_step is not None  # a plain GPT2LMHeadModel takes the lean path
    common = max(set(t for s in samples for t in s.token_ids), key=lambda t: sum(s.token_ids.count(t) for s in samples))
    out = {}
    for fast in (True, False):
        eng = DecodeEngine(model, common, max_rows=4, tokenizer=tok, fast_decode=fast)
        assert (eng.fast_step is not None) == fast
        out[fast] = sorted(eng.generate([encode(tok, p) for p in PROMPTS], 3, SamplingParams(20), seed=3),
                           key=lambda s: (s.prompt_id, s.sample_index))
    assert len({len(s.token_ids) for s in out[True]}) > 1
    for a, b in zip(out[True], out[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_sample_tokens_follows_the_distribution():
    from rlfuse.rollout.engine import sample_tokens

    probs = torch.tensor([[0.1, 0.2, 0.0, 0.7, 0.0]]).repeat(100_000, 1)
    drawn = sample_tokens(probs, torch.rand(100_000, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(drawn, minlength=5).float() / len(drawn)
    assert_close(freq, probs[0], atol=0.01, rtol=0)
    assert freq[2] == 0 and freq[4] == 0  # zero-probability tokens are never drawn


def test_sample_tokens_inverse_cdf_by_hand():
    """u picks the token whose CDF step contains u * total; the largest uniform (1 - 2**-24) never lands on a trailing
    zero-probability token, even where u * total rounds up to the total."""
    from rlfuse.rollout.engine import sample_tokens

    probs = torch.tensor([[0.1, 0.2, 0.0, 0.7, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.05, 0.1, 0.35, 1 - 2 ** -24])
    assert sample_tokens(probs, u).tolist() == [0, 0, 1, 3, 3]
    odd = torch.tensor([[0.3, 1 / 3, 0.0]])  # total not a power of two
    assert sample_tokens(odd, torch.tensor([1 - 2 ** -24])).tolist() == [1]


def test_kv_buffer_padding_and_spare_columns_are_zero(lm):
    """Masked columns still enter attention's weighted sum (weight 0): they must hold zeros, never stale memory
    (0 * NaN = NaN)."""
    from rlfuse.rollout.kv import BufferKV, Gpt2DecodeStep

    tok, model = lm
    step = Gpt2DecodeStep(model)
    bufs = []
    for text in ("the acting", "the old detective finds the"):
        ids = torch.tensor([encode(tok, text)])
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values
        buf = BufferKV.from_cache(cache, 2, 5, step)
        P = ids.shape[1]
        assert buf.kv.shape[2] == 2 and buf.kv.shape[4] == P + 5 and buf.width == P
        assert torch.equal(buf.kv[:, :, 0], buf.kv[:, :, 1])  # the k rows of a prompt start from one prefill
        assert not buf.kv[..., P:, :].any()
        bufs.append(buf)
    short, long = bufs
    pad = long.width - short.width
    short.merge(long)
    assert short.width == long.width and short.kv.shape[2] == 4
    assert not short.kv[:, :, :2, :, :pad].any() and not short.kv[..., long.width:, :].any()
    assert short.kv.isfinite().all()


@pytest.mark.parametrize("arch,layout", [("llama", "row"), ("qwen2", "row"), ("llama", "column"), ("llama", "lora"),
                                         ("llama", "lora_off")])
def test_lean_llama_style_step_equals_transformers_forward(arch, layout, monkeypatch):
    """Llama-style lean step (grouped-query attention, rotary positions, RMSNorm, gated MLP; Qwen2 adds q/k/v biases)
    against transformers' forward on tiny random models, through retirement, merges and buffer growth. Row-major
    fp32 weights are multiplied as W @ h^T (every projection and the head), column-major ones through F.linear;
    LoRA-wrapped ones (a shared base decoding as the actor, or with its adapters off as the reference) as W @ h^T
    with the adapter's B @ (A @ h^T) added where it is on."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rlfuse.config import load_config
    from rlfuse.models import layout as layout_module
    from rlfuse.models.load import apply_lora
    from rlfuse.rollout.kv import BufferKV, LlamaDecodeStep

    monkeypatch.setattr(BufferKV, "GROW", 3)
    Config, Model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    model = Model(Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    if layout == "column":
        layout_module.column_major(model)
    elif layout.startswith("lora"):
        lora = load_config(None, ["model.lora=true", "model.lora_targets=[q_proj,v_proj,up_proj,down_proj]"]).model
        peft_model = apply_lora(copy.deepcopy(model), lora)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)  # adapters that change the logits
        if layout == "lora_off":
            peft_model.base_model.disable_adapter_layers()
        model = peft_model.get_base_model().eval()
    transposed_calls = []
    product = layout_module.TransposedProduct.__call__
    monkeypatch.setattr(layout_module.TransposedProduct, "__call__",
                        lambda self, ht: transposed_calls.append(self.module) or product(self, ht))
    assert LlamaDecodeStep.supports(model)
    prompts = [[1, 5, 9], [1, 7], [1, 3, 4, 8, 2], [1, 6, 6, 6]]
    probe = DecodeEngine(model, eos_token_id=-1, max_rows=4, fast_decode=False)
    first = list(probe.generate(prompts, 3, SamplingParams(16), seed=1))
    counts = {}
    for s in first:
        for t in s.token_ids:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)  # a frequent token as EOS, so rows retire at different steps
    out = {}
    for fast in (True, False):
        eng = DecodeEngine(model, eos_token_id=eos, max_rows=4, fast_decode=fast)
        assert isinstance(eng.fast_step, LlamaDecodeStep) == fast
        out[fast] = sorted(eng.generate(prompts, 3, SamplingParams(16), seed=1), key=lambda s: (s.prompt_id, s.sample_index))
    assert len({len(s.token_ids) for s in out[True]}) > 1
    for a, b in zip(out[True], out[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    if layout == "column":
        assert not transposed_calls
    else:  # 7 projections a layer and the head, the adapted ones through their LoRA layer
        wrapped = [m for m in transposed_calls if hasattr(m, "lora_A")]
        assert len(set(transposed_calls)) == 2 * 7 + 1 and len(set(wrapped)) == (2 * 4 if "lora" in layout else 0)


def test_lean_gpt2_step_refuses_lora_wrapped_projections(lm):
    """The GPT-2 step reads the projections' weights itself, so on a shared base (LoRA layers in the model the engine
    decodes) it would silently drop the adapter: such a model keeps transformers' forward."""
    import copy

    from rlfuse.config import load_config
    from rlfuse.models.load import apply_lora
    from rlfuse.rollout.kv import decode_step_for

    _, model = lm
    assert decode_step_for(model) is not None
    peft_model = apply_lora(copy.deepcopy(model), load_config(None, ["model.lora=true"]).model)
    assert decode_step_for(peft_model.get_base_model()) is None
