"""A partial rollout on one generation worker, in this process: the first part decodes until a count of samples has
finished and parks the rest; the continuation re-prefills it and goes on. Under unchanged weights the two parts give
the whole batch's samples exactly (each sample's random stream goes on), and each sample records where the next
weights took over: None for those finished before, the tokens drawn so far for live rows, 0 for samples not yet
started (rows are limited, so some wait)."""

from collections import Counter

import pytest
import torch

from rlfuse.data.collate import encode
from rlfuse.models.load import load_tokenizer
from rlfuse.rollout.engine import SamplingParams

pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' for the placement tests")
from rlfuse.runtime.ray_rollout import GenerationWorker, RolloutSettings, WorkerModels  # noqa: E402

PROMPTS = ["the acting", "the old detective finds the", "i really", "this film was", "later, the thief"]


def stop_token_ending_some(worker, prompts, ids) -> SamplingParams:
    """Sampling settings under which some samples end early (a token the tiny model draws often ends a sample): the
    first to finish then leaves the others mid-way."""
    whole = worker.decode_batch(prompts, ids, 2, SamplingParams(16), 11).unscored
    for token, _ in Counter(t for s in whole for t in s.token_ids[1:]).most_common(8):
        params = SamplingParams(16, stop_token_ids=(token,))
        if any(len(s.token_ids) < 16 for s in worker.decode_batch(prompts, ids, 2, params, 11).unscored):
            return params
    pytest.fail("no token ends a sample early")


def test_the_two_parts_of_a_partial_rollout_are_the_whole_batch(tiny_task):
    folder = str(tiny_task.model_dir)
    tok = load_tokenizer(folder)
    # 8 rows for 5 prompts x 2 samples: the fifth prompt waits for two rows to free
    worker = GenerationWorker(WorkerModels(folder, None, None), RolloutSettings(max_rows=8))
    prompts, ids = [encode(tok, p) for p in PROMPTS], [3, 4, 5, 6, 7]
    params = stop_token_ending_some(worker, prompts, ids)
    whole = {(s.prompt_id, s.sample_index): s for s in worker.decode_batch(prompts, ids, 2, params, 11).unscored}
    first = worker.decode_until(9, prompts, ids, 2, params, 11, finished=1)
    assert worker.parked(9) is not None
    rest = worker.continue_batch(9)
    assert worker.parked(9) is None and len(first.unscored) >= 1
    parts = first.unscored + rest.unscored
    assert sorted((s.prompt_id, s.sample_index) for s in parts) == sorted(whole)
    for s in parts:
        want = whole[(s.prompt_id, s.sample_index)]
        assert s.token_ids == want.token_ids
        torch.testing.assert_close(s.logprobs, want.logprobs, atol=1e-4, rtol=0)  # re-prefilled: the same to 1e-4
    assert all(s.switch_at is None for s in first.unscored)
    switched = [s.switch_at for s in rest.unscored]
    assert 0 in switched and any(x and x > 0 for x in switched)  # the waiting prompt, and rows caught mid-way
    assert all(x is None or x <= len(s.token_ids) for x, s in zip(switched, rest.unscored))
    assert worker.continue_batch(12).unscored == []  # nothing parked for that batch: nothing to continue
