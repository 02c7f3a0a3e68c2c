"""The cost model (rlfuse/plan/cost.py) on hand-computed cases, the planner's choices on constructed problems,
`rlfuse plan` on the default config and placement.strategy=auto."""

import math
from dataclasses import replace

import pytest
import yaml

from rlfuse.config import load_config
from rlfuse.plan import cost
from rlfuse.plan.cost import MachineProfile, ModelShape, gpt2_shape
from rlfuse.plan.memory import sent_bytes
from rlfuse.plan.planner import best_plan, plan, problem_from_config
from rlfuse.plan.profiles import BUILTIN_CPU
from rlfuse.plan.spec import WorkerResources

TINY = ModelShape("tiny", layers=2, hidden=4, heads=2, ffn=16, vocab=10, context=8)
RATES = MachineProfile("test", "cpu", 1, flops=1e9, decode_flops=5e8, mem_bw=1e10, layer_call_s=1e-3,
                       decode_layer_call_s=1e-4, bwd_ratio=2.0, optimizer_bytes_s=1e9, sync_bytes_s=1e8,
                       sync_latency_s=0.01, allreduce_bytes_s=1e8, allreduce_latency_s=1e-3, runtime_bytes=0)


# ------------------------------------------------------------------------------------------ cost model


def test_forward_flops_by_hand():
    # matmul weights: 2 x 192 in the blocks + the 10 x 4 head = 424; 3 tokens attending to 2 positions each
    assert TINY.matmul_params == 424
    assert TINY.forward_flops(3, 2) == 3 * (2 * 424 + 4 * 2 * 4 * 2)


def test_forward_seconds_by_hand():
    # 2 calls x (2 layers x 1 ms + flops / 1e9 + 100 bytes / 1e10)
    flops = TINY.forward_flops(4 * 6, 3)
    assert cost.forward_seconds(RATES, TINY, 4, 6, 100, calls=2) == pytest.approx(2 * (2e-3 + flops / 1e9 + 1e-8))
    # shared prompts: the prompts' pass, then the continuations': each pass pays the layer calls and the weight reads,
    # the FLOPs are paid once
    assert cost.forward_seconds(RATES, TINY, 4, 6, 100, calls=2, passes=2) == pytest.approx(
        2 * (2 * (2e-3 + 1e-8) + flops / 1e9))


def test_train_seconds_lora_and_checkpointing():
    fwd = cost.forward_seconds(RATES, TINY, 2, 4, 0, 3)
    fixed, variable = 3 * 2 * 1e-3 * 3, 3 * TINY.forward_flops(8, 2) / 1e9  # 3 calls: 2 layers x 1 ms x (1 + 2)
    assert cost.train_seconds(RATES, TINY, 2, 4, 0, 3, False, False) == pytest.approx(3 * fwd)  # fwd + 2 fwd
    assert cost.train_seconds(RATES, TINY, 2, 4, 0, 3, True, False) == pytest.approx(4 * fwd)  # + a recompute
    assert cost.train_seconds(RATES, TINY, 2, 4, 0, 3, False, True) == pytest.approx(fixed + 2 * variable)  # no weight grads
    slow_autograd = replace(RATES, train_layer_call_s=5e-3)
    assert cost.train_seconds(slow_autograd, TINY, 2, 4, 0, 3, False, False) == pytest.approx(3 * (2 * 5e-3) + 3 * variable)
    # two passes per micro-batch: 3 calls x one more pass's fixed cost (2 layers x 1 ms x 3) and weight reads x 3
    one, two = (cost.train_seconds(RATES, TINY, 2, 4, 1e6, 3, False, False, passes=n) for n in (1, 2))
    assert two - one == pytest.approx(3 * (2 * 1e-3 * 3 + 3 * 1e6 / 1e10))


SMOLLM2 = cost.llama_shape("smollm2", 30, 576, 9, 1536, 2048, kv_heads=3, vocab=49152)


def test_page_faults_of_a_training_micro_batch_by_hand():
    # SmolLM2's widths: a hidden-width tensor (576 x 4 bytes a token) reaches glibc's 1 MiB at 456 tokens, the MLP's
    # (1536) at 171, the key/value width (192) at 1366; the head's 3 vocabulary-wide tensors at any scored count
    mapped = lambda tokens, scored=0, passes=1: cost.mapped_train_bytes(SMOLLM2, tokens, scored, True, passes)
    assert mapped(170) == 0
    assert mapped(416) == 30 * 9 * 416 * 1536 * 4  # the MLP's only: 0.96 MiB hidden-width tensors from the heap
    assert mapped(832) == 30 * 832 * 4 * (34 * 576 + 9 * 1536)  # the hidden width's as well
    assert mapped(832, passes=2) == 2 * mapped(416)  # two passes, each over its share of the tokens
    assert mapped(0, scored=10) == 3 * 10 * 49152 * 4
    assert cost.mapped_train_bytes(SMOLLM2, 832, 0, False) == 30 * 832 * 4 * (30 * 576 + 9 * 1536)  # full training
    # priced at fault_s a page, per call; nothing without a measured fault_s (a GPU, an older profile)
    faulting = replace(RATES, fault_s=2e-6)
    pages = math.ceil(mapped(832, 4 * 48) / 4096)
    assert cost.train_seconds(faulting, SMOLLM2, 4, 208, 0, 3, False, True, scored=48) - cost.train_seconds(
        RATES, SMOLLM2, 4, 208, 0, 3, False, True, scored=48) == pytest.approx(3 * pages * 2e-6)
    # the step at the threshold: 4 sequences of 208 tokens in one call cost more than in two calls of 2 by the
    # hidden-width tensors' pages, less the second call's fixed cost (30 layers x 1 ms x (1 + 2))
    one_call, two_calls = (cost.train_seconds(faulting, SMOLLM2, rows, 208, 0, 4 // rows, False, True, scored=48)
                           for rows in (4, 2))
    assert one_call - two_calls == pytest.approx(34 * 30 * 832 * 576 * 4 / 4096 * 2e-6 - 30 * 1e-3 * 3, rel=1e-3)
    assert replace(faulting, fault_s=1e-6).slowed(2).fault_s == 2e-6
    # run.cpu_heap=reuse: glibc's threshold at 32 MiB, so 832 tokens' activations (under 5 MiB) come from the heap
    # and only the head's vocabulary-wide tensors (48 x 4 positions: 37.5 MiB each) are fresh mappings
    reuse = cost.CPU_HEAP_THRESHOLDS["reuse"]
    assert reuse == 32 << 20
    assert cost.mapped_train_bytes(SMOLLM2, 832, 4 * 48, True, threshold=reuse) == 3 * 4 * 48 * 49152 * 4
    assert cost.mapped_train_bytes(SMOLLM2, 832, 4 * 8, True, threshold=reuse) == 0  # 6.25 MiB logits: the heap's
    assert cost.train_seconds(faulting, SMOLLM2, 4, 208, 0, 3, False, True, scored=48, mmap_threshold=reuse) == \
        pytest.approx(cost.train_seconds(RATES, SMOLLM2, 4, 208, 0, 3, False, True, scored=48)
                      + 3 * math.ceil(3 * 4 * 48 * 49152 * 4 / 4096) * 2e-6)


def test_unmerged_lora_adapters_by_hand():
    adapted = replace(RATES, lora_layer_call_s=2e-4, lora_train_layer_call_s=4e-3, lora_bwd_ratio=0.5)
    flops = TINY.forward_flops(4 * 6, 3)
    # a forward through adapters: 2 layers x (1 ms + 0.2 ms) per pass; without them the plain rate
    assert cost.forward_seconds(adapted, TINY, 4, 6, 100, calls=2, adapters=True) == pytest.approx(
        2 * (2 * 1.2e-3 + flops / 1e9 + 1e-8))
    assert cost.forward_seconds(adapted, TINY, 4, 6, 100, calls=2) == cost.forward_seconds(RATES, TINY, 4, 6, 100, 2)
    # a frozen base's training: the measured fixed cost (2 layers x 4 ms) and backward ratio (1 + 0.5), per call
    variable = TINY.forward_flops(8, 2) / 1e9
    assert cost.train_seconds(adapted, TINY, 2, 4, 0, 3, False, True) == pytest.approx(3 * (2 * 4e-3 + 1.5 * variable))
    # the adapters' work per token: the FLOPs term of a forward (and of a decode step) times lora_fwd_ratio
    per_token = replace(adapted, lora_fwd_ratio=1.25)
    assert cost.forward_seconds(per_token, TINY, 4, 6, 100, calls=2, adapters=True) == pytest.approx(
        2 * (2 * 1.2e-3 + 1.25 * flops / 1e9 + 1e-8))
    assert cost.forward_seconds(per_token, TINY, 4, 6, 100, calls=2) == cost.forward_seconds(RATES, TINY, 4, 6, 100, 2)
    # a fitted fixed cost under the adapted forward's, run forward and back, is raised to it: 2 layers x (1 ms + 0.2 ms)
    # x (1 + 0.5) per call
    floor_fit = replace(adapted, lora_train_layer_call_s=1e-7)
    assert cost.train_seconds(floor_fit, TINY, 2, 4, 0, 3, False, True) == pytest.approx(
        3 * (2 * 1.2e-3 * 1.5 + 1.5 * variable))
    # full fine-tuning ignores the LoRA rates
    assert cost.train_seconds(adapted, TINY, 2, 4, 0, 3, False, False) == cost.train_seconds(
        RATES, TINY, 2, 4, 0, 3, False, False)
    # decoding through adapters: every step's layer calls cost 0.2 ms more per layer (and the prefill's)
    lengths = cost.Lengths.from_mean(5, 5)
    steps = len(lengths.live_rows(4, 4))
    extra = (cost.decode_seconds(adapted, TINY, 4, 3, lengths, 5, 100, 4, 8, adapters=True)
             - cost.decode_seconds(adapted, TINY, 4, 3, lengths, 5, 100, 4, 8))
    assert extra == pytest.approx((steps + 1) * 2 * 2e-4)
    # slowed: the per-layer costs multiplied like every other per-call cost
    assert adapted.slowed(2).lora_layer_call_s == pytest.approx(4e-4)
    assert adapted.slowed(2).lora_train_layer_call_s == pytest.approx(8e-3)


def test_the_shared_base_decodes_and_scores_through_its_adapters():
    # configs/smollm2_hh.yaml's layout on the embedded model: one base, the actor decoding through its adapter, the
    # reward model and critic adapters on it, the reference the base with the adapters off
    from rlfuse.plan.planner import _generate_seconds, _score_seconds

    cfg = load_config(None, ["model.lora=true", "model.shared_base=true", "rl.algo=ppo", "rl.critic_init=rm"])
    prob = problem_from_config(cfg, RATES)
    m = prob.memory
    assert m.decodes_adapters and m.adapter_roles == {"actor", "reward", "critic"}
    adapted = replace(prob, profile=replace(RATES, lora_layer_call_s=1e-3))
    w = prob.workload
    assert w.k == 1 and w.score_singles == 8  # one pass a call; the fused tail's 8 one-sample calls
    calls = math.ceil((w.samples - 8) / w.score_micro_batch) + 8
    more = _score_seconds(adapted, 1) - _score_seconds(prob, 1)
    # two of the three scoring forwards (reward, critic) pay 1 ms more per layer and call; the reference does not
    assert more == pytest.approx(2 * calls * m.policy.layers * 1e-3)
    assert _generate_seconds(adapted, 1, 1) > _generate_seconds(prob, 1, 1)
    # without the shared base the generator is a merged copy: decoding pays no adapters
    plain = problem_from_config(load_config(None, ["model.lora=true", "model.shared_base=false"]), RATES)
    assert not plain.memory.decodes_adapters and plain.memory.adapter_roles == {"actor"}


def test_sync_allreduce_optimizer_by_hand():
    assert cost.sync_seconds(RATES, 1e8, receivers=2) == pytest.approx(2 * (0.01 + 1.0))
    assert cost.sync_seconds(RATES, 1e8, receivers=0) == 0
    assert cost.allreduce_seconds(RATES, 1e8, workers=4) == pytest.approx(1e-3 + 2 * 3 / 4 * 1.0)
    assert cost.allreduce_seconds(RATES, 1e8, workers=1) == 0
    assert cost.optimizer_seconds(RATES, 1e6, steps=3) == pytest.approx(3 * 16e6 / 1e9)


def test_round_trips_chunks_and_buckets_by_hand():
    p = replace(RATES, ray_round_trip_s=0.002, ray_sample_s=5e-4)
    assert cost.round_trip_seconds(p, 3, samples=16) == pytest.approx(3 * 0.002 + 16 * 5e-4)
    # a chunk ends after 16 finished samples, whatever the time (reproducible runs)
    assert cost.rollout_chunks(32, every=16) == 2 and cost.rollout_chunks(33, every=16) == 3
    assert cost.rollout_chunks(4, every=16) == 1 and cost.rollout_chunks(0, every=16) == 0
    # DDP: the first bucket holds 1 MiB, the others bucket_bytes
    assert cost.ddp_buckets(2**19, 32 * 2**20) == 1 and cost.ddp_buckets(2**20, 32 * 2**20) == 1
    assert cost.ddp_buckets(2**20 + 1, 32 * 2**20) == 2
    assert cost.ddp_buckets(2**20 + 64 * 2**20, 32 * 2**20) == 3


def test_distinct_prompt_lengths_and_prefill_calls_by_hand(default_problem):
    # 4 prompts of 2 lengths (2 each), 2 drawn: a length is missing with probability 2/4 x 1/3 = 1/6
    assert cost.distinct_values(2, 4, 2) == pytest.approx(2 * (1 - 1 / 6))
    assert cost.distinct_values(32, 32, 16) == pytest.approx(16)  # all distinct: as many as drawn
    assert cost.distinct_values(1, 32, 16) == 1 and cost.distinct_values(5, 32, 32) == 5
    # one worker, 32 prompts of 8 lengths: 8 prefill calls instead of 1, the same tokens: 7 more fixed costs
    one = replace(default_problem, workers=1, checkpointing=(False,), micro_batches=(16,))
    eight = replace(one, workload=replace(one.workload, prompt_lengths=8))
    p, shape = one.profile, one.memory.policy
    extra = 7 * (shape.layers * p.layer_call_s + 4 * shape.params / p.mem_bw)
    assert plan(eight)[0].seconds["generate"] - plan(one)[0].seconds["generate"] == pytest.approx(extra)
    # each prefill call's own cost (cache set-up, merging into the batch's buffer): 8 calls
    costly = replace(eight, profile=replace(p, prefill_call_s=0.01))
    assert plan(costly)[0].seconds["generate"] - plan(eight)[0].seconds["generate"] == pytest.approx(8 * 0.01)


def test_live_rows_match_the_mean_length():
    lam = cost.survival_scale(10, 48)
    assert lam * (1 - math.exp(-48 / lam)) == pytest.approx(10, rel=1e-6)
    rows = cost.live_rows(32, 10, 48)
    assert rows[0] == 32 and all(a > b for a, b in zip(rows, rows[1:]))
    # steps: the expected longest of 32 exponential lengths, lam x H_32 (41 here), or the cap when that is longer
    assert len(rows) == math.ceil(lam * sum(1 / i for i in range(1, 33))) == 41
    assert len(cost.live_rows(32, 17, 48)) == 48
    assert cost.live_rows(8, 48, 48) == [8.0] * 48  # every sample runs to the cap


def test_stragglers_by_hand():
    # lengths 2 + exponential(scale 3): the longest of n is 2 + 3 H_n (H_1 = 1, H_2 = 1.5, H_4 = 25/12, H_8 = 761/280)
    lengths = cost.Lengths(2.0, 3.0, 100)
    assert lengths.synced_max(4, 1) == lengths.expected_max(4) == pytest.approx(2 + 3 * 25 / 12)
    # two ranks of one 4-row micro-batch each: every step waits for the longer, the longest of the 8 rows
    assert lengths.synced_max(4, 2) == pytest.approx(2 + 3 * 761 / 280)
    # four micro-batches per rank and step: the slowest rank's excess over its own mean is half as large per call
    assert lengths.synced_max(4, 2, calls=4) == pytest.approx(2 + 3 * 25 / 12 + 3 * (761 / 280 - 25 / 12) / 2)
    # a decoder whose own 2 samples end at the expected longest of 2 (6.5 steps) waits for the longest of the 4 of
    # both decoders (8.25): its rows die out, the stage goes on
    own, waited = lengths.live_rows(2), lengths.live_rows(2, waited_for=4)
    assert (len(own), len(waited)) == (math.ceil(2 + 3 * 1.5), math.ceil(2 + 3 * 25 / 12))
    assert waited[: len(own)] == own and all(r < own[-1] for r in waited[len(own):])


def test_flattened_waits_for_the_slowest_worker():
    # the same work on 2 decoders of 16 samples each takes longer than one decoder's own 16 samples would: the
    # rollout ends with the longest of all 32; and 2 ranks stepping together pad to the longer rank's micro-batch
    cfg = load_config(None, ["placement.strategy=flattened", "placement.workers=2"])
    prob = problem_from_config(cfg, BUILTIN_CPU, workers=2, lengths=(12.0, 30))
    from rlfuse.plan import planner as pl

    w = prob.workload
    alone = cost.decode_seconds(prob.profile, prob.memory.policy, 16, w.prompt_tokens, w.lengths, w.response_mean,
                                pl._policy_bytes(prob.memory), prob.memory.act_bytes, w.max_rows, 1.0, w.k)
    waiting = cost.decode_seconds(prob.profile, prob.memory.policy, 16, w.prompt_tokens, w.lengths, w.response_mean,
                                  pl._policy_bytes(prob.memory), prob.memory.act_bytes, w.max_rows, 1.0, w.k, 32)
    assert waiting > alone
    assert w.padded_seq(8, 2) == pytest.approx(w.prompt_tokens + w.lengths.expected_max(16))
    assert w.padded_seq(8, 2) > w.padded_seq(8)


def test_lengths_from_a_run_are_one_iterations(tmp_path):
    # a run's figures for the planner are a typical iteration's: the median of each iteration's longest, not the
    # longest of all its iterations (that one iteration's outlier would set every iteration's decode steps)
    import json

    from rlfuse.metrics.tracker import measured_lengths

    (tmp_path / "rl").mkdir()
    rows = [{"rollout/length_mean": m, "rollout/length_max": x} for m, x in ((10, 20), (12, 48), (14, 30))]
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert measured_lengths(tmp_path) == (12, 30)
    assert measured_lengths(tmp_path / "nothing") is None


def test_decode_seconds_one_row_by_hand():
    # one sample always running to 3 tokens, prompt 2: prefill (one call over 2 tokens) + 3 steps at contexts 2, 3, 4
    p = replace(RATES, mem_bw=math.inf)
    got = cost.decode_seconds(p, TINY, 1, 2, cost.Lengths.from_mean(3, 3), 3, 0, 4, max_rows=8)
    prefill = 2e-3 + TINY.forward_flops(2, 1) / 1e9
    steps = sum(2e-4 + TINY.forward_flops(1, 2 + t) / 5e8 for t in range(3))
    assert got == pytest.approx(prefill + steps)


def test_a_prompt_is_prefilled_once_for_its_k_samples():
    # 8 samples of a 100-token prompt: with k = 4 the prefill runs 2 prompt rows, not 8 (the decode steps are the same)
    p, lengths = replace(RATES, mem_bw=math.inf), cost.Lengths.from_mean(3, 3)
    one, four = (cost.decode_seconds(p, TINY, 8, 100, lengths, 3, 0, 4, max_rows=8, k=k) for k in (1, 4))
    assert one - four == pytest.approx(cost.forward_seconds(p, TINY, 8, 100, 0) - cost.forward_seconds(p, TINY, 2, 100, 0))
    assert one - four > 0


def test_profile_json_round_trip(tmp_path):
    path = RATES.save(tmp_path / "p.json")
    assert MachineProfile.load(path) == RATES
    assert cost.device_profile("rtx4090").memory_bytes == 24e9


# ---------------------------------------------------------------------------------------- planner choices


CPU = MachineProfile("a 1-thread CPU worker", "cpu", 1, flops=5e10, decode_flops=2.8e10, mem_bw=3.5e10,
                     layer_call_s=4.5e-4, decode_layer_call_s=2.5e-4, decode_sample_s=1.2e-3, bwd_ratio=1.7,
                     optimizer_bytes_s=5e9, sync_bytes_s=5e8, sync_latency_s=0.02, allreduce_bytes_s=1e9,
                     allreduce_latency_s=1e-3, ray_call_s=0.03)
"""Fixed rates (not the built-in profile, which follows this machine) so the constructed choices below stay put."""


@pytest.fixture
def default_problem():
    return problem_from_config(load_config(None, []), CPU, workers=4, cores=4)


def _fixed(prob, **kw):
    # micro-batches of 4: each mini-batch of 16 is one micro-batch per rank on 4 workers
    return replace(prob, checkpointing=(False,), migrate_below=(0.0,), micro_batches=(4,), **kw)


def test_balanced_small_models_choose_flattened(default_problem):
    # every stage splits over all four workers and nothing waits: flattened, trained data-parallel on 4
    best = best_plan(_fixed(default_problem))
    assert best.strategy == "flattened" and best.spec.workers == 4


def test_gradient_sync_in_a_backward_at_its_own_rate(default_problem):
    # the same plan with DDP's gradient all-reduce measured at half the idle rate: each optimiser step of each model
    # moves its gradients (one buffer per DDP bucket) once more at the idle rate; a single worker pays nothing
    from rlfuse.plan import planner as pl

    prob = _fixed(default_problem)
    slow = replace(prob, profile=replace(CPU, ddp_allreduce_bytes_s=CPU.allreduce_bytes_s / 2))
    w, m = prob.workload, prob.memory
    steps = w.epochs * w.samples / w.mini_batch
    grads = 4.0 * (m.policy.params + m.critic.params)  # fp32 gradients of the actor and the critic
    extra = steps * grads / CPU.allreduce_bytes_s  # ring on 4 ranks: 2 x 3/4 of the buffer, at twice the time
    assert pl._train_seconds(slow, 4, 4, False) - pl._train_seconds(prob, 4, 4, False) == pytest.approx(1.5 * extra)
    assert pl._train_seconds(slow, 1, 4, False) == pl._train_seconds(prob, 1, 4, False)


def test_generation_dominating_chooses_a_scoring_group(default_problem):
    # decode steps 20 ms per layer (latency-bound: more workers do not shorten them) and a 12-layer reward model to
    # score: a layout with two groups hides the scoring under decoding and keeps three workers training (separated
    # 3 train + 1 generating, or interleaved 3 train-and-generate + 1 scoring: within 2% of each other). Decoders
    # report every 4 finished samples (rollout.score_every=4), so the scorers get their first batch early.
    slow_decode = replace(default_problem.profile, decode_layer_call_s=0.02)
    big_rm = replace(default_problem.memory, reward=gpt2_shape("rm", 12, 768, 12, 1024, 512))
    plans = plan(_fixed(default_problem, profile=slow_decode, memory=big_rm,
                        workload=replace(default_problem.workload, score_every=4)))
    best = plans[0]
    assert best.strategy in ("separated", "interleaved") and best.spec.group("train").workers == 3
    assert best.seconds["rollout"] < best.seconds["generate"] + best.seconds["score"] / 2  # scoring mostly hidden
    flattened = next(p for p in plans if p.strategy == "flattened")
    assert flattened.seconds["rollout"] == pytest.approx(flattened.seconds["generate"] + flattened.seconds["score"])
    assert best.seconds["rollout"] < flattened.seconds["rollout"]
    # the same problem with fast decoding goes back to flattened: the choice follows the costs
    assert best_plan(_fixed(default_problem, memory=big_rm)).strategy == "flattened"


def test_memory_binding_moves_the_big_frozen_model_off_the_trainers(default_problem):
    # a 24-layer reward model does not fit beside the actor, critic and reference: flattened and separated keep it
    # on the training workers, interleaved puts it on its own scoring group
    big_rm = replace(default_problem.memory, reward=gpt2_shape("rm", 24, 1024, 16, 1024, 512))
    prob = _fixed(default_problem, memory=big_rm, train_parallel=("data",))  # DDP replicas only
    unbounded = plan(prob)
    flat = next(p for p in unbounded if p.strategy == "flattened")
    inter = next(p for p in unbounded if p.strategy == "interleaved")
    budget = (flat.peak_bytes + inter.peak_bytes) / 2
    assert inter.peak_bytes < budget < flat.peak_bytes
    plans = plan(replace(prob, memory_budget=budget))
    assert plans[0].strategy == "interleaved" and plans[0].fits
    assert not any(p.fits for p in plans if p.strategy in ("flattened", "separated"))
    assert all(p.fits for p in plans[: sum(p.fits for p in plans)])  # those that fit rank first
    # with FSDP among the choices the trainers' states shard over the 4 workers instead: flattened fits again, and
    # the plan says so in its config (rl.train_parallel=fsdp)
    sharded = plan(replace(prob, memory_budget=budget, train_parallel=("data", "fsdp")))
    assert sharded[0].fits and sharded[0].train_parallel == "fsdp" and sharded[0].strategy == "flattened"
    assert sharded[0].config_block()["rl"]["train_parallel"] == "fsdp" and ", fsdp" in sharded[0].label()
    flat_data = next(p for p in sharded if p.strategy == "flattened" and p.train_parallel == "data")
    assert not flat_data.fits and sharded[0].peak_bytes < flat_data.peak_bytes


def test_memory_binding_turns_on_checkpointing(default_problem):
    long = replace(default_problem, workload=replace(default_problem.workload, response_mean=400, response_max=400,
                                                     response_longest=0, mini_batch=64))  # 16 rows on each of 4 ranks
    prob = replace(long, migrate_below=(0.0,), micro_batches=(16,), strategies=("flattened",))
    on, off = (next(p for p in plan(prob) if p.gradient_checkpointing == c) for c in (True, False))
    assert on.peak_bytes < off.peak_bytes and off.iteration_s < on.iteration_s
    assert not best_plan(prob).gradient_checkpointing  # without a budget the faster one wins
    assert best_plan(replace(prob, memory_budget=(on.peak_bytes + off.peak_bytes) / 2)).gradient_checkpointing


def test_data_parallel_ranks_split_every_mini_batch(default_problem):
    # a mini-batch of 16 in one micro-batch of 16 is cut into one of 8 per rank (spec.dp_micro_size), as two of 8 are:
    # the same work per rank, half the single rank's
    prob = replace(default_problem, workers=2, strategies=("flattened",), checkpointing=(False,), migrate_below=(0.0,))
    train = {p.micro_batch_size: p.seconds["train"] for p in plan(prob)}
    one = replace(prob, workers=1, resources=prob.resources)
    train_one = {p.micro_batch_size: p.seconds["train"] for p in plan(one)}
    assert 16 not in train and 8 in train  # micro 16 trains 8 rows per rank, as micro 8 does: one plan, not two
    assert train[8] < train_one[16]


def _flat2(prob, **profile):
    """The default problem on 2 flattened workers, micro-batches of 4, no migration, with these profile fields."""
    return replace(prob, workers=2, strategies=("flattened",), checkpointing=(False,), migrate_below=(0.0,),
                   micro_batches=(4,), profile=replace(prob.profile, **profile))


def test_training_micro_batch_and_all_reduce_terms_count_as_the_runtime(default_problem):
    # 32 samples, 4 epochs, mini-batches of 16: 8 steps; micro 4 on 2 ranks: ceil(4 / 2) = 2 micro-batches per rank
    # per step; actor and critic each: 16 micro-batches
    base = plan(_flat2(default_problem, train_micro_s=0.0, allreduce_latency_s=0.0))[0]
    micro = plan(_flat2(default_problem, train_micro_s=0.01, allreduce_latency_s=0.0))[0]
    assert micro.seconds["train"] - base.seconds["train"] == pytest.approx(2 * 16 * 0.01)
    # all-reduces per learner: 8 steps x 2 DDP buckets (4 bytes x 0.99 M parameters: the 1 MiB first bucket, then
    # one of 32 MiB) + 8 finite-loss checks + 2 for the stats (all_gather_object) = 26; actor and critic: 52
    params = default_problem.memory.policy.params
    assert cost.ddp_buckets(4 * params, 32 * 2**20) == 2
    latency = plan(_flat2(default_problem, train_micro_s=0.0, allreduce_latency_s=0.001))[0]
    assert latency.seconds["train"] - base.seconds["train"] == pytest.approx(52 * 0.001)
    # one rank: no all-reduce at all
    one = replace(_flat2(default_problem, allreduce_latency_s=0.0), workers=1)
    one_slow = replace(_flat2(default_problem, allreduce_latency_s=1.0), workers=1)
    assert plan(one)[0].seconds["train"] == pytest.approx(plan(one_slow)[0].seconds["train"])


def test_ray_round_trips_per_rollout_chunk_sync_and_update(default_problem):
    # flattened on 2 Ray workers: each decoding worker's chunks, the scorers' set_temperature, the weight-sync call,
    # the update call; the per-sample cost rides on every chunk's samples (16 per worker)
    base = plan(_flat2(default_problem, ray_round_trip_s=0.0, ray_sample_s=0.0, ray_call_s=0.0))[0]
    rt = plan(_flat2(default_problem, ray_round_trip_s=0.001, ray_sample_s=0.0, ray_call_s=0.0))[0]
    s = base.seconds
    chunks = cost.rollout_chunks(16, 16)
    assert chunks == 1
    assert rt.seconds["rollout"] - s["rollout"] == pytest.approx((chunks + 1) * 0.001)
    assert rt.seconds["sync"] - s["sync"] == pytest.approx(0.001)
    assert rt.seconds["train"] - s["train"] == pytest.approx(0.001)
    per_sample = plan(_flat2(default_problem, ray_round_trip_s=0.0, ray_sample_s=0.001, ray_call_s=0.0))[0]
    assert per_sample.seconds["rollout"] - s["rollout"] == pytest.approx(16 * 0.001)
    driver = plan(_flat2(default_problem, ray_round_trip_s=0.0, ray_sample_s=0.0, ray_call_s=0.005))[0]
    assert driver.seconds["iteration"] - s["iteration"] == pytest.approx(0.005)


def test_overlap_slowdown_by_hand():
    assert cost.overlap_slowdown(1.5, 1.0) == pytest.approx(1.5)  # every second overlaps: the whole pair slowdown
    assert cost.overlap_slowdown(1.5, 0.4) == pytest.approx(1.2)  # 1 + 0.5 x 0.4
    assert cost.overlap_slowdown(1.5, 0.0) == 1.0  # alone on its worker
    assert cost.overlap_slowdown(1.5, 3.0) == pytest.approx(1.5) and cost.overlap_slowdown(1.5, -1.0) == 1.0


def _compute_only(prob, **profile):
    """No Ray round trips, no all-reduce, decoding chunked by count only: every predicted second is compute."""
    quiet = dict(ray_round_trip_s=0.0, ray_sample_s=0.0, ray_call_s=0.0, allreduce_latency_s=0.0,
                 allreduce_bytes_s=1e30)
    return replace(prob, profile=replace(prob.profile, **(quiet | profile)))


def test_pair_slowdowns_slow_flattened_stages_where_both_workers_compute(default_problem):
    base = _compute_only(_flat2(default_problem))
    s = plan(base)[0].seconds
    slow = plan(_compute_only(_flat2(default_problem), pair_decode_slowdown=2.0, pair_train_slowdown=1.5))[0].seconds
    # flattened 2: both workers decode at once, score at once and train as DDP ranks at once
    assert slow["generate"] == pytest.approx(2 * s["generate"])
    assert slow["score"] == pytest.approx(1.5 * s["score"])
    assert slow["train"] == pytest.approx(1.5 * s["train"])
    single = replace(base, workers=1)
    slow_single = replace(single, profile=replace(single.profile, pair_decode_slowdown=2.0, pair_train_slowdown=1.5))
    assert plan(slow_single)[0].seconds == plan(single)[0].seconds  # one process: nothing computes beside it


def test_pair_slowdowns_slow_two_groups_only_where_they_overlap(default_problem):
    sep = lambda **p: _compute_only(replace(default_problem, workers=2, strategies=("separated",),
                                            checkpointing=(False,), migrate_below=(0.0,), micro_batches=(16,)), **p)
    s = plan(sep())[0].seconds
    slow = plan(sep(pair_decode_slowdown=2.0, pair_train_slowdown=1.5))[0].seconds
    gen, score = s["generate"], s["score"]
    assert score < gen  # this case: the scorer is busy for part of the decode only
    # the decoder is overlapped by the scorer for score / generate of its time; the scorer all of its time
    assert slow["generate"] == pytest.approx(gen * (1 + (2.0 - 1) * score / gen))
    assert slow["score"] == pytest.approx(1.5 * score)
    assert slow["train"] == pytest.approx(s["train"])  # one training worker, the generator waiting: alone


def test_a_scoring_group_starts_on_the_first_chunk(default_problem):
    # separated 1 + 1: the scorer waits for the decoder's first chunk (16 of its 32 samples finished: about half of
    # decoding), then scores chunk by chunk; the last chunk is scored after decoding ends
    prob = replace(default_problem, workers=2, strategies=("separated",), checkpointing=(False,),
                   migrate_below=(0.0,), micro_batches=(16,), profile=replace(default_problem.profile,
                                                                              ray_round_trip_s=0.0))
    best = plan(prob)[0]
    s = best.seconds
    generate, score = s["generate"], s["score"]
    calls = cost.rollout_chunks(32, 16)  # one scoring call per chunk
    assert calls == 2
    assert s["rollout"] == pytest.approx(max(generate + score / calls, generate * 16 / 32 + score))


def test_more_cpu_workers_than_cores_share_them():
    cfg = load_config(None, [])
    alone = problem_from_config(cfg, CPU, workers=4, cores=4).profile
    shared = problem_from_config(cfg, CPU, workers=4, cores=2).profile
    assert shared.flops == alone.flops / 2 and shared.layer_call_s == alone.layer_call_s * 2
    assert shared.sync_latency_s == alone.sync_latency_s  # not compute


def test_nothing_fits_is_one_user_error(default_problem):
    from rlfuse.errors import UserError

    with pytest.raises(UserError, match="nothing fits on 4 worker"):
        best_plan(replace(default_problem, memory_budget=1e3))


def test_lora_reference_cannot_be_interleaved_alone():
    # with LoRA the reference is the actor: interleaved still places the reward on its own group
    cfg = load_config(None, ["model.lora=true"])
    plans = plan(problem_from_config(cfg, BUILTIN_CPU, workers=2))
    inter = [p for p in plans if p.strategy == "interleaved"]
    assert inter and all(p.spec.group("score").roles == ("reward",) for p in inter)


# ------------------------------------------------------------------------------------------ CLI and auto


def test_rlfuse_plan_default_config(tmp_path, capsys, tiny_task):
    from conftest import TINY as TINY_RUN  # at the tests' sizes: the prompts are measured on the cached tiny task

    from rlfuse.cli import main

    out = tmp_path / "plan.yaml"
    assert main(["plan", *TINY_RUN, "--out", str(out), "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "| rank | strategy" in printed and "best: " in printed and "| base | adapters |" in printed
    block = yaml.safe_load(out.read_text())
    assert block["placement"]["strategy"] in ("single", "flattened", "interleaved", "separated")  # single: ranked too
    cfg = load_config(None, [f"{s}.{k}={v}" for s, d in block.items() for k, v in d.items()])  # runs as written
    assert cfg.placement.strategy == block["placement"]["strategy"]


def test_rlfuse_plan_bad_budget_is_one_line(tmp_path, capsys):
    from rlfuse.cli import main

    assert main(["plan", "--memory-per-worker", "0.001", "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlfuse plan: ") and "nothing fits" in err[-1]


def test_strategy_auto_resolves_before_the_run(capsys):
    import sys

    from rlfuse.plan.resolve import resolve

    as_written = load_config(None, ["placement.strategy=auto", "placement.workers=2"])
    assert as_written.placement.strategy == "auto"  # load_config returns what the file says
    cfg = resolve(as_written, log=lambda msg: print(msg, file=sys.stderr))
    assert cfg.placement.strategy in ("flattened", "interleaved", "separated", "custom")
    assert "placement.strategy=auto chose" in capsys.readouterr().err


def test_auto_built_in_code_is_planned_once_by_resolve_auto():
    from rlfuse.config import Config
    from rlfuse.errors import UserError
    from rlfuse.plan.planner import resolve_auto
    from rlfuse.plan.strategies import spec_from_config

    cfg = Config()
    cfg.placement.strategy, cfg.placement.workers = "auto", 2
    with pytest.raises(UserError, match="resolve_auto"):  # a spec alone would drop the plan's micro-batch
        spec_from_config(cfg)
    resolved = resolve_auto(cfg)
    assert spec_from_config(resolved).strategy in ("flattened", "interleaved", "separated", "custom")
    assert resolved.rl.micro_batch_size in (1, 2, 4, 8, 16)


def test_qlora_config_is_planned_as_it_runs():
    from rlfuse.plan.planner import memory_inputs
    from rlfuse.plan.cost import policy_shape
    from rlfuse.plan.roles import derive_roles

    cfg = load_config(None, ["model.lora=true", "model.quantization=4bit", "rl.optimizer=paged_adamw_8bit",
                             "rl.algo=ppo", "rl.critic_init=rm"])
    m = memory_inputs(cfg, derive_roles(cfg), policy_shape(cfg.model), CPU)
    assert (m.weight_dtype, m.optimizer, m.shared_base, m.generator_copy) == ("nf4-dq", "adamw8bit", True, False)
    assert m.critic is not None  # the critic's adapter on the shared base is counted


def test_planner_constants_match_the_runtime():
    # the pure planner keeps its own copy of the DDP bucket in cost.py (it may not import torch), which the runtime
    # imports: they must agree
    from rlfuse.plan.cost import DDP_BUCKET_BYTES

    pytest.importorskip("ray", reason="ray is not installed: the runtime's Ray modules import it")
    from rlfuse.runtime.ray_train import DEFAULT_BUCKET_BYTES

    assert DEFAULT_BUCKET_BYTES == DDP_BUCKET_BYTES


def test_decoding_the_shared_base_copies_no_weights(default_problem):
    # flattened: each worker's generator is its actor's replica; with a shared base the engine decodes the base
    # itself (no copy, sync/bytes 0 at run time), so only the driver's call is left
    from rlfuse.plan.planner import _sync_seconds

    one = replace(_fixed(default_problem), workers=1)
    spec = best_plan(one).spec
    copies = _sync_seconds(one, spec)
    shared = replace(one, memory=replace(one.memory, shared_base=True, generator_copy=False))
    assert _sync_seconds(shared, spec) == pytest.approx(copies - one.memory.policy.params * 4.0 / one.profile.mem_bw)
    assert _sync_seconds(shared, spec) < copies


def test_a_shared_base_is_planned_on_replicas_of_the_base():
    # every role is an adapter on the one base, so a worker holding it holds them all: flattened (each worker a
    # replica of the base, the adapters data-parallel) or single; never separated roles, never fsdp shards
    from rlfuse.plan.planner import plan_config

    shared = load_config(None, ["model.lora=true", "model.shared_base=true"])
    assert {p.strategy for p in plan_config(shared, workers=1)} == {"single"}
    two = plan_config(shared, workers=2)
    assert {p.strategy for p in two} == {"flattened"} and {p.train_parallel for p in two} == {"data"}
    separate = load_config(None, ["model.lora=true", "model.shared_base=false"])
    assert {p.strategy for p in plan_config(separate, workers=2)} > {"flattened"}
    assert "fsdp" in {p.train_parallel for p in plan_config(separate, workers=2)}


def test_shared_prompts_cost_their_share_per_sample(default_problem):
    # rl.share_prompt with k = 8: a micro-batch holding a prompt's 8 samples runs its 28 prompt tokens once, so each
    # sample costs 28 / 8 = 3.5 of them; a micro-batch of 2 holds 2 of a group (14 each); off, the whole prompt
    from rlfuse.plan.planner import Workload

    w = Workload(samples=128, prompt_tokens=28.0, response_mean=4.0, response_max=8, epochs=1, mini_batch=64,
                 score_micro_batch=32, max_rows=256, k=8, shared_prompt=True)
    assert w.prompt_per_sample(32) == 3.5 and w.prompt_per_sample(2) == 14.0 and w.prompt_per_sample(1) == 28.0
    assert w.scored_seq(32) == 7.5 and replace(w, shared_prompt=False).scored_seq(32) == 32.0
    assert w.memory_lengths(32) == {"seq": 36, "train_seq": 11.5, "score_seq": 11.5}
    # a measured longest prompt of 44 tokens: the peak's micro-batch holds it (44 / 8 = 5.5 a sample shared)
    assert replace(w, prompt_longest=44.0).memory_lengths(32) == {"seq": 52, "train_seq": 13.5, "score_seq": 13.5}
    assert replace(w, prompt_longest=44.0, shared_prompt=False).memory_lengths(32)["train_seq"] == 52.0
    assert replace(w, shared_prompt=False).prompt_per_sample(32) == 28.0
    assert w.passes(32) == 2 and w.passes(1) == 1 and replace(w, shared_prompt=False).passes(32) == 1
    # the models' token test (models/forward.py worth_sharing): 8 rows of one prompt, answers of 4 (longest 8 at the
    # cap, response_max): 28 + 8 x 7 = 84 token positions shared against 8 x 36 = 288 full; 200-token answers
    # (longest 200) after 28-token prompts: 28 + 8 x 199 = 1620 against 8 x 228 = 1824, 0.89 > 0.8: not shared
    assert w.lengths.expected_max(8) == 8 and w.shares(8)
    long_answers = replace(w, response_mean=150.0, response_max=200)
    assert long_answers.lengths.expected_max(8) == 200
    assert not long_answers.shares(8) and long_answers.passes(8) == 1 and long_answers.prompt_per_sample(8) == 28.0
    cfg = load_config(None, ["rl.algo=grpo", "rl.k=8", "rl.prompts_per_iter=4", "rl.mini_batch_size=32"])
    assert problem_from_config(cfg, CPU, workers=2).workload.shared_prompt
    assert not problem_from_config(load_config(None, ["rl.algo=grpo", "rl.k=8", "rl.prompts_per_iter=4",
                                                      "rl.mini_batch_size=32", "rl.share_prompt=false"]),
                                   CPU, workers=2).workload.shared_prompt
    # sharing trades tokens for a second pass: where FLOPs dominate it predicts a faster update; where the per-call
    # costs do (near-free FLOPs), a slower one, by the second pass's layer calls and weight reads (word problems'
    # lengths: the default task's 4-token prompts before answers of up to 48 do not pass the token test)
    default = problem_from_config(cfg, CPU, workers=2)
    assert not default.workload.shares(8)
    shared = replace(default, workload=replace(default.workload, prompt_tokens=28.0, response_mean=4.0, response_max=8),
                     strategies=("flattened",), micro_batches=(8,), checkpointing=(False,), migrate_below=(0.0,))
    assert shared.workload.shares(8)
    alone = replace(shared, workload=replace(shared.workload, shared_prompt=False))
    flops_bound = replace(shared.profile, layer_call_s=1e-12, train_layer_call_s=1e-12, mem_bw=1e18)
    calls_bound = replace(shared.profile, flops=1e18)
    for profile, faster in ((flops_bound, True), (calls_bound, False)):
        train = [plan(replace(pr, profile=profile))[0].seconds["train"] for pr in (shared, alone)]
        assert (train[0] < train[1]) == faster


def test_an_async_plan_takes_the_longer_side(default_problem):
    # separated 1 + 1, compute only: synchronous, the iteration is sync + rollout + train; asynchronous (max_staleness
    # 1), decoding the next batch overlaps scoring and training this one, so it takes the longer side: with fast
    # decoding the training side (its scoring with a forward of the policy for the proximal log-probs), with slow
    # decoding the generating side, the trainer waiting the difference
    from rlfuse.plan import planner as pl

    for decode_layer_call_s in (2.5e-4, 0.05):
        prob = _compute_only(replace(default_problem, workers=2, strategies=("separated",), checkpointing=(False,),
                                     migrate_below=(0.0, 0.2), micro_batches=(16,), staleness=(0, 1)),
                             decode_layer_call_s=decode_layer_call_s)
        plans = plan(prob)
        assert sorted(p.max_staleness for p in plans) == [0, 1]  # one decoder: no migration to vary
        sync, stale = (next(p for p in plans if p.max_staleness == n) for n in (0, 1))
        s = stale.seconds
        train_side = s["sync"] + s["score"] + s["train"] + s["overhead"]
        assert s["iteration"] == pytest.approx(max(train_side, s["generate"]))
        assert s["rollout"] == pytest.approx(s["score"] + max(0.0, s["generate"] - train_side))
        # the proximal log-probs are one more forward in the scoring pass; training is the synchronous plan's
        assert s["train"] == pytest.approx(sync.seconds["train"])
        assert 0 < pl._proximal_seconds(prob, 1) < s["score"]
        # an update of one optimiser step takes them from its own forward: no scoring pass
        one_step = replace(prob, workload=replace(prob.workload, epochs=1, mini_batch=prob.workload.samples))
        assert pl._proximal_seconds(one_step, 1) == 0.0
        assert stale.iteration_s < sync.iteration_s
        assert stale.config_block()["rl"]["max_staleness"] == 1 and "async (max_staleness 1)" in stale.label()
    assert s["generate"] > train_side  # the slow-decoding case: generation is the longer side


def test_auto_placement_plans_async_only_where_the_config_asks():
    assert problem_from_config(load_config(None, []), CPU, workers=2, cores=2).staleness == (0,)
    asked = load_config(None, ["rl.max_staleness=2", "placement.strategy=separated", "placement.workers=2"])
    assert problem_from_config(asked, CPU, cores=2).staleness == (0, 2)


def test_fused_tail_singles_score_in_one_pass():
    # shared prompts make a scoring micro-batch two passes, but the fused tail's one-sample calls repeat no prompt:
    # the per-call costs (what a profile with free FLOPs leaves) are 2 passes per micro-batch and 1 per single
    from rlfuse.plan import planner as pl

    cfg = load_config(None, ["rl.algo=grpo", "rl.k=8", "rl.prompts_per_iter=4", "rl.mini_batch_size=32"])
    prob = problem_from_config(cfg, replace(CPU, flops=1e30), workers=1)
    w = replace(prob.workload, prompt_tokens=28.0, response_mean=4.0, response_max=8)  # word problems' lengths
    assert w.shared_prompt and w.samples == 32 and w.shares(w.score_micro_batch)
    mixed = replace(prob, workload=replace(w, score_singles=16))
    batched = math.ceil(16 / w.score_micro_batch)
    unshared = replace(mixed, workload=replace(mixed.workload, shared_prompt=False))
    calls_cost = lambda pr: pl._score_seconds(pr, 1) - (batched + 16) * pr.profile.score_call_s
    assert calls_cost(mixed) / calls_cost(unshared) == pytest.approx((2 * batched + 16) / (batched + 16))


def test_fsdp_collectives_are_priced_at_their_own_measured_rate(default_problem):
    # FSDP's per-block all-gathers and reduce-scatters ran ~5x slower than DDP's bucketed all-reduce on 2 CPU
    # workers; the profile measures their rate (fsdp_bytes_s) and a sharded update is priced at it
    prob = _fixed(default_problem, train_parallel=("data", "fsdp"))
    fsdp_of = lambda pr: next(p for p in plan(pr) if p.strategy == "flattened" and p.train_parallel == "fsdp")
    unmeasured = fsdp_of(prob)  # 0: DDP's rate
    p = prob.profile
    same = fsdp_of(replace(prob, profile=replace(p, fsdp_bytes_s=p.ddp_allreduce_bytes_s or p.allreduce_bytes_s)))
    slow = fsdp_of(replace(prob, profile=replace(p, fsdp_bytes_s=(p.ddp_allreduce_bytes_s or p.allreduce_bytes_s) / 5)))
    assert same.seconds["train"] == pytest.approx(unmeasured.seconds["train"])
    assert slow.seconds["train"] > unmeasured.seconds["train"]


def test_a_separated_plan_charges_the_weight_syncs_pages_to_both_sides(default_problem):
    # on CPU workers the actor's weights pass through Ray's object store to the decoding group and stay in both
    # groups' RSS; GPU workers' budgets are device memory, which the store is not
    sep_of = lambda pr: next(p for p in plan(_fixed(pr, train_parallel=("data",))) if p.strategy == "separated")
    cpu, gpu = sep_of(default_problem), sep_of(replace(default_problem, resources=WorkerResources(1.0, 1.0)))
    assert cpu.label() == gpu.label()
    sent = sent_bytes(default_problem.memory, "actor")
    for g in cpu.spec.groups:
        assert cpu.memory[g.name]["base"] - gpu.memory[g.name]["base"] == pytest.approx(sent), g.roles
