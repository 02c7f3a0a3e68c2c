"""Same samples whatever the batch (max_rows, prompt subsets), and engine state moved between engines: export,
re-prefill, continue, to the samples an uninterrupted engine produces; weights by explicit copy."""

import pickle

import pytest
import torch
from torch.testing import assert_close

from rlfuse.data.collate import encode
from rlfuse.models.load import load_causal_lm, load_tokenizer
from rlfuse.rollout.engine import DecodeEngine, SamplingParams, weight_buckets
from rlfuse.rollout.state import EngineState

TEXTS = ["the acting", "the old detective finds the", "i really", "this film was", "later, the thief", "a"]
K = 3
PARAMS = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40)


def lengths(pid, j):  # rows finish at many different steps
    return 2 + (5 * pid + 3 * j) % 13


@pytest.fixture(scope="module")
def task(tiny_task):
    tok = load_tokenizer(str(tiny_task.model_dir))
    return tok, [encode(tok, t) for t in TEXTS], str(tiny_task.model_dir)


@pytest.fixture(scope="module")
def model_a(task):
    return load_causal_lm(task[2]).eval()


@pytest.fixture(scope="module")
def model_b(task, model_a):
    """A separate model object with other weights, brought to A's by load_weights (the engine's explicit sync)."""
    torch.manual_seed(1)
    b = load_causal_lm(task[2])
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn_like(p))
    DecodeEngine(b, 0).load_weights(model_a.state_dict())
    return b.eval()


def engine(task, model, fast, max_rows=256):
    return DecodeEngine(model, task[0].eos_token_id, max_rows=max_rows, tokenizer=task[0], fast_decode=fast)


def by_key(samples):
    out = {(s.prompt_id, s.sample_index): s for s in samples}
    assert len(out) == len(samples)  # no sample twice
    return out


def assert_same(got, want):
    got, want = by_key(got), by_key(want)
    assert sorted(got) == sorted(want)
    for key, s in want.items():
        assert got[key].token_ids == s.token_ids and got[key].finish_reason == s.finish_reason, key
        assert_close(got[key].logprobs, s.logprobs, atol=1e-5, rtol=0)  # prefill vs decode-step rounding


def full_run(task, model_a, fast):
    return list(engine(task, model_a, fast).generate(task[1], K, PARAMS, 7, lengths))


def run_until(it, n):
    """n samples from an engine iterator, then leave it suspended."""
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("fast", [True, False])
def test_max_rows_does_not_change_samples(task, model_a, fast):
    want = full_run(task, model_a, fast)
    assert len({len(s.token_ids) for s in want}) > 3
    for max_rows in (1, 4):
        eng = engine(task, model_a, fast, max_rows)
        got = list(eng.generate(task[1], K, PARAMS, 7, lengths))
        assert eng.stats.max_live_rows <= max(max_rows, K)  # a prompt's k rows are admitted together
        assert_same(got, want)


def test_a_prompt_alone_or_in_a_subset_draws_as_in_the_big_batch(task, model_a):
    want = by_key(full_run(task, model_a, True))
    for ids in ([3], [5, 1], [4, 0, 2]):
        got = list(engine(task, model_a, True, 4).generate([task[1][i] for i in ids], K, PARAMS, 7, lengths, prompt_ids=ids))
        assert_same(got, [want[(p, j)] for p in ids for j in range(K)])
    other_seed = list(engine(task, model_a, True).generate(task[1], K, PARAMS, 8, lengths))
    assert sum(by_key(other_seed)[key].token_ids != s.token_ids for key, s in want.items()) > len(want) // 2


@pytest.mark.parametrize("fast", [True, False])
def test_export_after_some_finished_then_continue_elsewhere(task, model_a, model_b, fast):
    want = full_run(task, model_a, fast)
    a = engine(task, model_a, fast)
    it = a.generate(task[1], K, PARAMS, 7, lengths)
    done_a = run_until(it, 5)
    state = pickle.loads(pickle.dumps(a.export_state()))  # plain data: crosses a process boundary
    assert next(it, None) is None  # the exporting iterator has ended
    assert state.rows and not state.waiting and all(r.position == len(r.token_ids) > 0 for r in state.rows)
    assert len(done_a) + len(state.finished) + len(state.rows) == len(want)
    b = engine(task, model_b, fast)
    done_b = list(b.resume(state))
    assert_same(done_a + done_b, want)
    # imported rows are re-prefilled once each (prompt + tokens so far), never repeated
    assert b.stats.prefill_tokens == sum(len(r.prompt_ids) + len(r.token_ids) for r in state.rows)


@pytest.mark.parametrize("fast", [True, False])
def test_export_with_prompts_still_waiting(task, model_a, model_b, fast):
    want = full_run(task, model_a, fast)
    a = engine(task, model_a, fast, max_rows=4)
    done_a = run_until(a.generate(task[1], K, PARAMS, 7, lengths), 2)
    state = a.export_state()
    assert state.rows and state.waiting and all(w.k == K for w in state.waiting)
    b = engine(task, model_b, fast, max_rows=4)
    assert_same(done_a + list(b.resume(state)), want)


@pytest.mark.parametrize("fast", [True, False])
def test_migration_two_engines_into_one_and_one_into_two(task, model_a, model_b, fast):
    want = full_run(task, model_a, fast)
    halves, done, states = ([0, 2, 4], [1, 3, 5]), [], []
    for ids, n in zip(halves, (2, 4)):  # each worker decodes half the prompts, under their global ids
        eng = engine(task, model_a, fast, max_rows=6)
        done += run_until(eng.generate([task[1][i] for i in ids], K, PARAMS, 7, lengths, prompt_ids=ids), n)
        states.append(eng.export_state())
    merged = EngineState.combine(states)
    assert merged.waiting  # max_rows=6: a prompt of each half was still waiting
    assert_same(done + list(engine(task, model_b, fast).resume(merged)), want)

    a = engine(task, model_a, fast, max_rows=9)
    done = run_until(a.generate(task[1], K, PARAMS, 7, lengths), 3)
    parts = a.export_state().split(2)
    assert all(p.rows for p in parts)
    for part in parts:
        done += list(engine(task, model_b, fast, max_rows=2).resume(part))
    assert_same(done, want)


@pytest.mark.parametrize("fast", [True, False])
def test_extend_a_running_engine_keeps_its_own_rows_live(task, model_a, model_b, fast):
    """Migration onto a keeper that is still decoding: the exporter's rows join the keeper's run; only they are
    re-prefilled (the keeper's own rows keep their KV cache), and the samples are the uninterrupted ones."""
    want = full_run(task, model_a, fast)
    keeper, exporter = engine(task, model_a, fast, max_rows=9), engine(task, model_b, fast)
    keep_it = keeper.generate([task[1][i] for i in (0, 2, 4)], K, PARAMS, 7, lengths, prompt_ids=[0, 2, 4])
    done = run_until(keep_it, 2)
    done += run_until(exporter.generate([task[1][i] for i in (1, 3, 5)], K, PARAMS, 7, lengths, prompt_ids=[1, 3, 5]), 3)
    state = exporter.export_state()
    assert state.rows and keeper.live_rows
    before = keeper.stats.prefill_tokens
    keeper.extend(state)
    done += list(keep_it)
    assert_same(done, want)
    moved = sum(len(r.prompt_ids) + len(r.token_ids) for r in state.rows) + sum(len(w.prompt_ids) for w in state.waiting)
    assert keeper.stats.prefill_tokens - before == moved
    with pytest.raises(RuntimeError, match="no generate"):
        keeper.extend(state)
    other = engine(task, model_a, fast)
    run_until(other.generate(task[1], K, PARAMS, 8, lengths), 1)
    with pytest.raises(ValueError, match="another seed"):
        other.extend(state)


def test_combine_refuses_different_seeds(task, model_a):
    states = []
    for seed in (1, 2):
        eng = engine(task, model_a, True)
        run_until(eng.generate(task[1], K, PARAMS, seed, lengths), 1)
        states.append(eng.export_state())
    with pytest.raises(ValueError, match="different seeds"):
        EngineState.combine(states)


def test_export_needs_a_suspended_iterator(task, model_a):
    eng = engine(task, model_a, True)
    with pytest.raises(RuntimeError, match="no generate"):
        eng.export_state()
    list(eng.generate(task[1][:1], 1, PARAMS, 0))
    with pytest.raises(RuntimeError, match="no generate"):
        eng.export_state()


# ------------------------------------------------------------------------------------------- weights


def test_load_weights_makes_another_copy_sample_like_the_source(task, model_a):
    want = full_run(task, model_a, True)
    torch.manual_seed(2)
    b = load_causal_lm(task[2]).eval()
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(0.5)
    eng = engine(task, b, True)
    assert [s.token_ids for s in eng.generate(task[1], K, PARAMS, 7, lengths)] != [s.token_ids for s in want]
    sd = model_a.state_dict()
    sd.pop("lm_head.weight", None)  # tied to transformer.wte.weight: either name updates both
    written = eng.load_weights(sd)
    assert written == sum(t.numel() * t.element_size() for t in sd.values())
    assert b.lm_head.weight.data_ptr() == b.transformer.wte.weight.data_ptr()
    assert_same(list(eng.generate(task[1], K, PARAMS, 7, lengths)), want)
    assert b.transformer.h[0].attn.c_attn.weight.data_ptr() != model_a.transformer.h[0].attn.c_attn.weight.data_ptr()


def test_load_weights_by_buckets_equals_one_load(task, model_a):
    sd = model_a.state_dict()
    buckets = list(weight_buckets(sd.items(), bucket_bytes=40_000))
    assert len(buckets) > 3 and [n for b in buckets for n in b] == list(sd)
    assert all(sum(t.numel() * 4 for t in b.values()) <= 40_000 or len(b) == 1 for b in buckets)
    one, many = load_causal_lm(task[2]), load_causal_lm(task[2])
    for m in (one, many):
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
    engine(task, one, True).load_weights(sd)
    eng = engine(task, many, True)
    for b in buckets:
        eng.load_weights(b.items())  # an iterable of (name, tensor) works too
    for (name, x), (_, y) in zip(one.state_dict().items(), many.state_dict().items()):
        assert torch.equal(x, y), name
        assert torch.equal(x, sd[name]), name


def test_load_weights_names_the_unknown_name_or_wrong_shape(task, model_a):
    eng = engine(task, load_causal_lm(task[2]), True)
    before = {n: t.clone() for n, t in eng.model.state_dict().items()}
    good = model_a.state_dict()["transformer.ln_f.weight"] + 1
    with pytest.raises(ValueError, match=r"'base_model\.model\.lm_head\.weight' is not a tensor"):
        eng.load_weights({"transformer.ln_f.weight": good, "base_model.model.lm_head.weight": good})
    with pytest.raises(ValueError, match=r"'transformer\.wpe\.weight' has shape \(3, 4\).*\(\d+, \d+\)"):
        eng.load_weights({"transformer.wpe.weight": torch.zeros(3, 4)})
    for n, t in eng.model.state_dict().items():  # nothing was copied from a refused bucket
        assert torch.equal(t, before[n]), n
    eng.load_weights({"transformer.ln_f.weight": good.double()})  # dtype converted on copy
    assert torch.equal(eng.model.transformer.ln_f.weight, good)
