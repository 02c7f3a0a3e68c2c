"""The report's dashboard and health checks as pure functions of metric rows: which panels a run's metrics fill, the
reward-rose-while-gold-fell warning, where a sample's prompt ends, and the RL stage's own peak memory."""

import math

import pytest

from rlfuse.metrics.health import GOLD_FALL, from_evaluation, from_series, reward_gold_divergence
from rlfuse.metrics.panels import OFF_CHART, select_panels, series, with_evaluations
from rlfuse.metrics.plots import dashboard_grid
from rlfuse.metrics.report import prompt_end

# the keys of rl/metrics.jsonl of real runs (`rlfuse run ... rl.iterations=6`, then rl.algo=grpo rl.k=4 with two
# reward functions, rl.eval_every=2 and a linear temperature schedule), less the ones no panel reads
PPO_KEYS = ["reward/mean", "reward/std", "reward/kl", "reward/kl_coef", "rollout/length_mean", "rollout/length_p95",
            "rollout/length_max", "rollout/hit_limit", "train/explained_variance", "train/policy_loss",
            "train/clip_frac", "train/approx_kl", "train/entropy", "train/grad_norm", "train/value_loss",
            "train/value_clip_frac", "train/critic_grad_norm", "mem/rss_mb", "mem/rss_peak_mb", "reward/gold_mean",
            "reward/gold_positive_rate", "perf/compute_fraction", "rollout/temperature", "time/iteration",
            "rollout/samples_per_s", "rollout/tokens_per_s"]
GRPO_KEYS = ["reward/mean", "reward/std", "reward/kl", "reward/kl_coef", "rollout/length_mean", "rollout/length_p95",
             "rollout/length_max", "rollout/hit_limit", "train/policy_loss", "train/clip_frac", "train/approx_kl",
             "train/entropy", "train/grad_norm", "mem/rss_mb", "mem/rss_peak_mb", "reward/gold_mean",
             "reward/gold_positive_rate", "reward/fn/gold_reward", "reward/fn/brevity", "perf/compute_fraction",
             "reward/frac_zero_spread", "rollout/temperature", "time/iteration", "rollout/samples_per_s",
             "rollout/tokens_per_s"]
EVAL = {"eval/reward_mean": 0.3, "eval/gold_mean": 0.01, "eval/gold_positive_rate": 0.4}
COMMON = ["reward", "gold", "kl", "kl_coef", "entropy", "clip_frac", "approx_kl", "grad_norm", "policy_loss",
          "length", "truncated"]
SPEED = ["samples_per_s", "tokens_per_s", "compute_fraction", "memory"]


def rows_of(keys, n=4, temperature=lambda i: 0.7, extra=lambda i: {}):
    """n rows of `keys`, each metric moving with the iteration (the KL coefficient too: an adaptive controller)."""
    return [{"step": i, **{k: 1.0 + 0.1 * i for k in keys}, "rollout/temperature": temperature(i), **extra(i)}
            for i in range(1, n + 1)]


def names(rows):
    return [p.name for p in select_panels(rows)]


def test_ppo_panels_include_the_critic_and_no_group_panels():
    assert names(rows_of(PPO_KEYS)) == COMMON[:-2] + ["value_loss", "explained_variance"] + COMMON[-2:] + SPEED


def test_grpo_panels_have_no_critic_but_groups_functions_evaluations_and_the_schedule():
    rows = rows_of(GRPO_KEYS, temperature=lambda i: 0.7 - 0.05 * i, extra=lambda i: EVAL if i % 2 == 0 else {})
    expected = COMMON[:2] + ["reward_fn"] + COMMON[2:] + ["zero_spread", "eval_reward", "eval_gold"] + SPEED
    assert names(rows) == expected + ["temperature"]


def test_constant_and_missing_metrics_draw_no_panel():
    rows = rows_of(["reward/mean", "reward/fn/only", "train/entropy"], extra=lambda i: {
        "reward/kl_coef": 0.2, "train/value_loss": "nan", "train/clip_frac": None})
    # a fixed KL coefficient and temperature are notes, one reward function is the reward panel again, a metric that
    # is only NaN (or null) has nothing to draw
    assert names(rows) == ["reward", "entropy"]
    assert names([{"step": 1, "reward/mean": 1.0}]) == ["reward"]  # a one-iteration run
    assert names([]) == []


def test_a_metric_missing_in_some_rows_keeps_its_panel_and_its_points():
    rows = rows_of(PPO_KEYS)
    del rows[1]["train/entropy"]
    rows[2]["train/entropy"] = "inf"  # the tracker writes a non-finite value as a string
    assert "entropy" in names(rows) and series(rows, "train/entropy")[0] == [1, 4]


def test_evaluation_curves_start_before_and_end_after_rl():
    rows = rows_of(GRPO_KEYS, extra=lambda i: EVAL if i == 2 else {})
    ev = {"before": {"reward_mean": 0.1, "gold_mean": 0.0}, "after": {"reward_mean": 0.5, "gold_mean": "nan"}}
    out = with_evaluations(rows, ev)
    assert series(out, "eval/reward_mean") == ([0, 2, 4], [0.1, 0.3, 0.5])
    assert series(out, "eval/gold_mean") == ([0, 2], [0.0, 0.01])
    plain = rows_of(PPO_KEYS)  # rl.eval_every=0: the before/after pair is a table, not a curve
    assert with_evaluations(plain, ev) is plain


def test_dashboard_grid_leaves_no_mostly_empty_row():
    assert dashboard_grid(17) == (3, 6)
    assert dashboard_grid(20) == (4, 5)
    assert dashboard_grid(12) == (2, 6)
    assert dashboard_grid(1) == (1, 1)


# ------------------------------------------------------------------------------------------- reward vs gold


def evals(reward, gold, key="gold_positive_rate"):
    return {"before": {"reward_mean": reward[0], key: gold[0]}, "after": {"reward_mean": reward[1], key: gold[1]}}


def test_warns_when_the_reward_rose_while_the_gold_score_fell():
    found = from_evaluation(evals((-0.09, 0.22), (0.53, 0.31)))
    assert found is not None and found.gold_name == "gold positive rate"
    text = found.message()
    assert "rose from -0.09 to 0.22" in text and "fell from 0.53 to 0.31" in text and "exploiting" in text


@pytest.mark.parametrize("reward, gold", [
    ((-0.09, 0.22), (0.31, 0.53)),                         # both rose: the run worked
    ((0.22, -0.09), (0.53, 0.31)),                         # both fell: a bad run, not reward hacking
    ((-0.09, 0.22), (0.53, 0.53 - GOLD_FALL / 2)),         # gold within noise
    ((-0.09, math.inf), (0.53, 0.31)),                     # a non-finite reward decides nothing
])
def test_no_warning_where_reward_and_gold_agree(reward, gold):
    assert from_evaluation(evals(reward, gold)) is None


def test_a_fall_within_the_noise_of_few_held_out_prompts_is_no_warning():
    ev = evals((-0.09, 0.22), (0.53, 0.45))  # 0.08 lower: beyond the noise of 400 prompts, within that of 16
    assert from_evaluation(ev) is not None
    assert from_evaluation({w: {**part, "n": 400} for w, part in ev.items()}) is not None
    assert from_evaluation({w: {**part, "n": 16} for w, part in ev.items()}) is None


def test_the_warning_reads_gold_mean_too_and_survives_malformed_files():
    assert from_evaluation(evals((0.1, 0.9), (0.2, -0.2), key="gold_mean")).gold_name == "gold score"
    for bad in (None, {}, [], {"before": [1], "after": "x"}, {"before": {"reward_mean": "nan"}, "after": {}}):
        assert from_evaluation(bad) is None


def test_the_warning_from_the_training_series_without_an_evaluation():
    rising = [{"step": i, "reward/mean": 0.1 * i, "reward/gold_mean": 0.5 - 0.05 * i} for i in range(1, 7)]
    found = reward_gold_divergence(rising, None)
    assert found is not None and found.where.startswith("training samples")
    assert found.reward == pytest.approx((0.15, 0.55)) and found.gold == pytest.approx((0.425, 0.225))
    honest = [{**r, "reward/gold_mean": 0.05 * r["step"]} for r in rising]
    assert from_series(honest) is None and from_series(rising[:2]) is None


# ------------------------------------------------------------------------------------------- samples


def test_the_prompt_ends_where_the_samples_part():
    assert prompt_end("the strange pilot meets", "the strange sequel was") == len("the strange ")
    # a shared word both completions began with stays with the prompt, but a half-shared word does not
    assert prompt_end("i liked this. the lead", "i liked this. the plot") == len("i liked this. the ")
    assert prompt_end("the sailor carries a box", "the sailor carried it") == len("the sailor ")
    assert prompt_end("same text", "same text") == 0 and prompt_end("abc", None) == 0
    assert prompt_end("the strange pilot", "the strange sequel", prompt="the strange") == len("the strange")


def test_off_chart_is_beyond_any_metric_the_panels_draw():
    assert 1e30 > OFF_CHART > 1e9  # tokens/s, MiB and grad norms stay drawn; a reward of 1e30 is marked


# ------------------------------------------------------------------------------------------- memory


def test_a_stage_tracker_restarts_the_peak_memory_so_rl_reads_its_own(tmp_path):
    from rlfuse.config import load_config
    from rlfuse.metrics.tracker import memory_metrics, peak_rss_mb, reset_peak_rss, stage_tracker

    if not reset_peak_rss():
        pytest.skip("this kernel keeps no resettable peak (/proc/self/clear_refs): the lifetime peak is logged")
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.report_to=[]"])
    memory_metrics("cpu")  # torch imported before the block: its memory is not what the test compares
    block = bytearray(400 * 2**20)  # an earlier stage's peak (SFT and RM run in the same `rlfuse run` process)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident
    del block
    earlier_peak = peak_rss_mb()
    stage_tracker(cfg, tmp_path / "rl").close()
    rl_peak = memory_metrics("cpu")["mem/rss_peak_mb"]
    assert rl_peak < earlier_peak - 300, (rl_peak, earlier_peak)
