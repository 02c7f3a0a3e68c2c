"""FLOPs of an iteration's work against a hand count, and the compute fraction (rlfuse/metrics/flops.py)."""

import pytest

from rlfuse.metrics.flops import (Passes, compute_fraction, decode_flops, iteration_flops, measure_matmul_rate,
                                  prefill_flops, sequence_flops)
from rlfuse.plan.cost import ModelShape

# 1 layer, hidden 2, ffn 8, vocabulary 3: weights that multiply each token = c_attn 2x6 + c_proj 2x2 + c_fc 2x8
# + mlp.c_proj 8x2 + head 3x2 = 12 + 4 + 16 + 16 + 6 = 54, so 108 FLOPs per token, plus 4 x 1 x 2 = 8 per attended
# position
SHAPE = ModelShape("hand", layers=1, hidden=2, heads=1, ffn=8, vocab=3, context=16)


def test_hand_count_of_one_prompt_with_two_samples():
    assert SHAPE.matmul_params == 54
    # prefill of 2 tokens attending to 1 and 2 positions: 2 x 108 + 8 x 3
    assert prefill_flops(SHAPE, 2) == 240
    # 3 response tokens: the prefill gives the first, then 2 single-token forwards attending to 3 and 4 positions
    assert decode_flops(SHAPE, 2, 3) == 2 * 108 + 8 * 7
    assert decode_flops(SHAPE, 2, 1) == 0
    # full sequences of 5 and 3 tokens: 5 x 108 + 8 x 15 and 3 x 108 + 8 x 6
    assert sequence_flops(SHAPE, 2, 3) == 660
    assert sequence_flops(SHAPE, 2, 1) == 372
    f = iteration_flops(SHAPE, [2, 2], [3, 1], k=2, passes=Passes(scoring=2, trained=1, epochs=2, backward_ratio=2.0))
    # the prompt is prefilled once for its 2 samples; 2 scoring forwards; 2 epochs of forward + 2x backward
    assert f == {"generation": 240 + 272, "scoring": 2 * 1032, "training": 2 * 3 * 1032, "total": 512 + 2064 + 6192}


def test_prefill_and_decode_add_up_to_one_forward_over_the_sequence():
    # generating L + 1 tokens runs every position of prompt + L tokens once, as a full forward does
    assert prefill_flops(SHAPE, 7) + decode_flops(SHAPE, 7, 5 + 1) == sequence_flops(SHAPE, 7, 5)
    assert prefill_flops(SHAPE, 7) + decode_flops(SHAPE, 7, 5) != sequence_flops(SHAPE, 7, 5)


def test_k_groups_share_a_prefill_and_a_frozen_base_backward_is_one_forward():
    one = iteration_flops(SHAPE, [4] * 4, [2] * 4, k=4, passes=Passes(1, 1))
    own = iteration_flops(SHAPE, [4] * 4, [2] * 4, k=1, passes=Passes(1, 1))
    assert own["generation"] - one["generation"] == 3 * prefill_flops(SHAPE, 4)
    lora = iteration_flops(SHAPE, [4] * 4, [2] * 4, k=4, passes=Passes(1, 1, backward_ratio=1.0))
    assert lora["training"] == 2 * 4 * sequence_flops(SHAPE, 4, 2)
    with pytest.raises(ValueError):
        iteration_flops(SHAPE, [4] * 3, [2] * 3, k=2, passes=Passes(1, 1))


def test_compute_fraction():
    assert compute_fraction(50e9, 2.0, 100e9) == 0.25
    assert compute_fraction(50e9, 0.0, 100e9) == 0.0


def test_meter_counts_no_training_for_a_skipped_update():
    from rlfuse.metrics.flops import ComputeMeter

    meter = ComputeMeter(SHAPE, Passes(scoring=2, trained=1, epochs=2), k=2, matmul_flops_s=8768.0)
    done = meter.metrics([2, 2], [3, 1], seconds=1.0)
    assert done["perf/flops"] == 8768 and done["perf/compute_fraction"] == 1.0
    skipped = meter.metrics([2, 2], [3, 1], seconds=1.0, trained=False)
    assert skipped["perf/flops"] == 512 + 2064 and skipped["perf/flops_training"] == 0.0


def test_matmul_rate_is_a_plausible_cpu_rate():
    # FLOP/s, not seconds or FLOPs: above 10 MFLOP/s (a core shared with a dozen busy processes still gives ~0.5
    # GFLOP/s) and below 10 TFLOP/s (far beyond any CPU) for fp32 on this process's threads
    rate = measure_matmul_rate("cpu", n=256, repeats=2)
    assert 1e7 < rate < 1e13


@pytest.mark.parametrize("overrides,scoring,trained,ratio", [
    (["rl.algo=rloo", "rl.k=2", "rl.reward=rlfuse.data.gold:gold_reward"], 1, 1, 2.0),  # reference only; the actor trains
    (["rl.algo=ppo", "rl.critic_init=rm", "rl.epochs=2"], 3, 2, 2.0),  # + reward model and critic; critic trains
    (["rl.algo=ppo", "rl.critic_init=actor"], 3, 1, 2.0),  # a value head on the actor: one model trains
    (["rl.algo=rloo", "rl.k=2", "model.lora=true"], 2, 1, 1.0),  # reward model scores; a frozen base: backward = 1 forward
])
def test_a_runs_passes_follow_its_roles(overrides, scoring, trained, ratio):
    from types import SimpleNamespace

    from transformers import GPT2Config

    from rlfuse.config import load_config
    from rlfuse.metrics.flops import compute_meter_for_run
    from rlfuse.plan.roles import derive_roles

    cfg = load_config(None, overrides)
    roles = derive_roles(cfg)
    critic = object() if "critic" in roles.names else None
    gen = __import__("torch").nn.Linear(2, 2)
    gen.config = GPT2Config(n_layer=1, n_embd=2, n_head=1, n_inner=8, vocab_size=3, n_positions=16)
    models = SimpleNamespace(generator=gen, actor=gen, critic=critic, roles=roles, compute_dtype=None)
    meter = compute_meter_for_run(cfg, models, "cpu")
    assert (meter.passes.scoring, meter.passes.trained, meter.passes.backward_ratio) == (scoring, trained, ratio)
    assert meter.passes.epochs == cfg.rl.epochs and meter.shape.matmul_params == SHAPE.matmul_params
    assert meter.matmul_flops_s > 1e7
