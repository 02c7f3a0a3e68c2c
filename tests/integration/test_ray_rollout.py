"""Rollout on 2 Ray generation workers (rlfuse/runtime/ray_rollout.py): the same samples and scores as one process,
without and with the tail migrated; the migration really moved rows and the freed worker really scored; and the same
rollout, bit for bit, whichever worker is late."""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'rlfuse[ray]' to run the multi-worker tests")

from rlfuse.data.collate import encode  # noqa: E402
from rlfuse.models.load import load_causal_lm, load_reward_model, load_tokenizer  # noqa: E402
from rlfuse.models.weights import merged_state_dict  # noqa: E402
from rlfuse.runtime.ray_rollout import (MultiWorkerRollout, RolloutSettings, WorkerModels, build_worker_roles,
                                        start_generation_workers)
from rlfuse.rollout.engine import SamplingParams  # noqa: E402
from rlfuse.rollout.fusion import FusionPolicy, LengthTable, generate_rollouts  # noqa: E402

TEXTS = ["the acting", "the old detective finds the", "i really", "this film was", "later, the thief", "a",
         "the music", "my friend said"]
K = 3
PARAMS = SamplingParams(max_new_tokens=48, temperature=0.9, top_k=40)
SEED = 11
# a long tail: one sample of each of the first four prompts (two per worker) runs 40 tokens, the rest 2..20, so
# samples keep finishing (a worker reports back between two finished samples) while the long ones decode
LENGTHS = LengthTable(tuple(tuple(40 if (p < 4 and j == 0) else 2 + (5 * p + 3 * j) % 19 for j in range(K))
                            for p in range(len(TEXTS))))
# migrate_below=1.0 forces a migration at the first pause point (each worker has finished 1 of its 12 samples)
SETTINGS = RolloutSettings(score_every=2, live_below=2, micro_batch_size=4, temperature=0.9, migrate_below=1.0,
                           rows_per_worker=4)


@pytest.fixture(scope="module")
def folders(tiny_task, tmp_path_factory):
    """Generator = the tiny base model; a perturbed reference; a reward model (seeded head) that is also the critic."""
    root, base = tmp_path_factory.mktemp("ray_models"), str(tiny_task.model_dir)
    tok = load_tokenizer(base)
    torch.manual_seed(0)
    ref = load_causal_lm(base)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    rm = load_reward_model(base, pad_token_id=tok.pad_token_id)
    for name, model in (("ref", ref), ("rm", rm)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return WorkerModels(generator=base, reference=str(root / "ref"), reward=str(root / "rm"), critic=str(root / "rm"))


@pytest.fixture(scope="module")
def policy(folders):
    """The policy the trainer would push: the base with other weights (so the sync really matters)."""
    torch.manual_seed(1)
    model = load_causal_lm(folders.generator)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    return model.eval()


@pytest.fixture(scope="module")
def rollout(folders, policy):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        workers = start_generation_workers(2, folders, SETTINGS, cpus_per_worker=1)
        driver = MultiWorkerRollout(workers, SETTINGS, bucket_bytes=100_000)
        sync = driver.sync_weights(merged_state_dict(policy))
        yield driver, sync
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def prompts(folders):
    tok = load_tokenizer(folders.generator)
    return [encode(tok, t) for t in TEXTS]


@pytest.fixture(scope="module")
def one_process(folders, policy, prompts):
    engine, scorer, _ = build_worker_roles(folders, SETTINGS)
    engine.load_weights(merged_state_dict(policy))
    fusion = FusionPolicy(True, SETTINGS.score_every, SETTINGS.live_below)
    return generate_rollouts(engine, scorer, prompts, K, PARAMS, SEED, fusion, lengths=LENGTHS)


def assert_same_experience(got, want):
    assert got.response_ids == want.response_ids  # every (prompt, sample): identical token ids
    assert torch.equal(got.prompt_index, want.prompt_index) and got.finish_reasons == want.finish_reasons
    assert_close(got.scores, want.scores)
    assert_close(got.ref_logprobs, want.ref_logprobs)
    assert_close(got.values, want.values)
    assert_close(got.mask, want.mask)
    # sampling log-probs: a re-prefilled row's next step rounds differently from a decode step (as in test_engine_state)
    assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_weights_reach_every_worker(rollout, policy):
    _, sync = rollout
    assert sync["sync/bytes"] == sum(t.numel() * t.element_size() for t in merged_state_dict(policy).values())
    assert sync["time/weight_sync"] > 0


def test_two_workers_without_migration_equal_one_process(rollout, prompts, one_process):
    driver, _ = rollout
    assert len({len(r) for r in one_process.response_ids}) > 4 and max(map(len, one_process.response_ids)) == 40
    exp = driver.generate(prompts, K, PARAMS, SEED, lengths=LENGTHS, migrate=False)
    assert exp.timing["migrated"] == 0 and exp.timing["migration/rows_moved"] == 0
    assert exp.timing["busy/worker0"] > 0 and exp.timing["busy/worker1"] > 0
    assert exp.timing["prefill_tokens"] == one_process.timing["prefill_tokens"] > 0  # each prompt on one worker, once
    assert_same_experience(exp, one_process)


def test_two_workers_with_the_tail_migrated_equal_one_process(rollout, prompts, one_process):
    driver, _ = rollout
    exp = driver.generate(prompts, K, PARAMS, SEED, lengths=LENGTHS, migrate=True)
    t = exp.timing
    assert t["migrated"] == 1
    # the exporting worker's long samples were still decoding: they moved, with their prompts and tokens so far
    assert t["migration/rows_moved"] >= 2 and t["migration/tokens_moved"] > t["migration/rows_moved"]
    assert 0 < t["migration/migrated_at_unfinished"] < len(TEXTS) * K
    assert t["migration/reprefill_s"] > 0 and t["migration/scoring_on_freed_s"] > 0
    assert t["prefill_tokens"] >= one_process.timing["prefill_tokens"] + t["migration/tokens_moved"]  # moved: again
    assert_same_experience(exp, one_process)


def keep_busy(worker, prompts) -> None:
    """Queue a decode of other prompts on `worker` before the rollout's calls: Ray runs an actor's calls in order, so
    the rollout reaches this worker late and the other one gets ahead, as on a loaded machine."""
    worker.start.remote(prompts, list(range(100, 100 + len(prompts))), K, PARAMS, SEED + 1, None)
    worker.advance.remote(10**6, False)


def test_a_migrated_rollout_is_the_same_whichever_worker_is_late(rollout, prompts):
    # the migration is planned at pause points given up front and each waiting chunk is scored as one batch, so the
    # order in which the workers reply changes nothing: not the rows moved, not one bit of a log-prob or a score.
    # (Before, chunks ended on time and the migration on the counts last reported: with one worker late by 1 to 3
    # prompts' decoding, the same rollout migrated or not, and log-probs moved by 5e-7.)
    driver, _ = rollout
    driver = MultiWorkerRollout(driver.workers, dataclasses.replace(SETTINGS, migrate_below=0.5))
    want = driver.generate(prompts, K, PARAMS, SEED, lengths=LENGTHS, migrate=True)
    assert want.timing["migrated"] == 1
    for late, delay in ((0, 1), (1, 1), (0, 3), (1, 3)):
        keep_busy(driver.workers[late], prompts[:delay])
        got = driver.generate(prompts, K, PARAMS, SEED, lengths=LENGTHS, migrate=True)
        for key in ("migrated", "migration/rows_moved", "migration/tokens_moved", "migration/migrated_at_unfinished"):
            assert got.timing[key] == want.timing[key], (late, delay, key)
        assert got.response_ids == want.response_ids and torch.equal(got.prompt_index, want.prompt_index)
        for name in ("scores", "logprobs", "ref_logprobs", "values", "mask"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (late, delay, name)
