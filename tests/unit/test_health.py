"""The run-health detectors on hand-made series: each rule flags the series it is for, at the right onset, and leaves
alone the healthy series that look like it (a concave KL, entropy halving as the policy sharpens, groups often
alike); `rlfuse audit` on run folders (exit status, old and killed runs), the live watch saying each finding once."""

import json
import math

import pytest

from rlfuse.cli import main
from rlfuse.metrics.audit import health_watch, reward_weights
from rlfuse.metrics.health import (DETECTORS, HealthWatch, RunFacts, audit, clip_runaway, entropy_collapse,
                                   first_sustained, group_collapse, kl_acceleration, length_drift,
                                   proxy_gold_divergence, reward_dominance, smoothed, value_loss_blowup)


def rows_of(**curves) -> list[dict]:
    """Rows with step 1..n, one key per curve (the keyword's double underscores are slashes)."""
    n = max(len(v) for v in curves.values())
    return [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in curves.items() if i < len(v)}}
            for i in range(n)]


def test_smoothing_and_sustain():
    xs, ys = smoothed(rows_of(a=[3.0, 6.0, 9.0, 0.0]), "a")
    assert xs == [1, 2, 3, 4] and ys == [3.0, 4.5, 6.0, 5.0]
    assert first_sustained([1, 2, 3, 4, 5], [False, True, False, True, True]) == 4  # one point alone is noise
    assert first_sustained([1, 2, 3], [True, True, True], start=1) == 2


def test_length_drift_flags_growth_and_piling_at_the_limit():
    grow = rows_of(rollout__length_mean=[10.0] * 5 + [12.0, 16.0, 20.0, 24.0, 28.0, 30.0])
    at, strength = length_drift(grow, RunFacts())
    # smoothed: iteration 9 is (16+20+24)/3 = 20 = 2x 10 and 10 tokens away; 8: (12+16+20)/3 = 16 = 1.6x
    assert at == 9 and "10.0 -> 27.3 tokens" in strength  # last: (24+28+30)/3
    pile = rows_of(rollout__length_mean=[40.0] * 10, rollout__hit_limit=[0.1] * 4 + [0.9] * 6)
    assert length_drift(pile, RunFacts())[0] == 6  # smoothed (0.1+0.9+0.9)/3 = 0.63 at 6, then 7
    # a 3-token answer that becomes 5 tokens (1.7x but 2 tokens), and a run whose length wobbles: healthy
    assert length_drift(rows_of(rollout__length_mean=[3.0] * 3 + [5.0] * 10), RunFacts()) is None
    assert length_drift(rows_of(rollout__length_mean=[20, 24, 17, 22, 26, 18, 21, 25, 19] * 2), RunFacts()) is None
    # truncation from the start is the config's limit, not drift
    assert length_drift(rows_of(rollout__hit_limit=[0.8] * 12), RunFacts()) is None


def test_kl_acceleration_flags_convex_growth_not_a_concave_rise():
    convex = [0.1 * 1.5 ** i for i in range(16)]  # 0.1 ... 43.8 nats
    at, _ = kl_acceleration(rows_of(reward__kl=convex), RunFacts())
    assert 10 <= at <= 14
    concave = [6 * (1 - math.exp(-i / 5)) for i in range(40)]  # the adaptive controller's rise, levelling at 6
    assert kl_acceleration(rows_of(reward__kl=concave), RunFacts()) is None
    noisy = [0.5, 1.4, 0.3, 1.9, 0.6, 1.2, 0.4, 2.1, 0.9, 1.5] * 3  # a short-answer task's jumpy sequence KL
    assert kl_acceleration(rows_of(reward__kl=noisy), RunFacts()) is None
    # an adaptive controller's climb past its target accelerates too, but stays under 1 nat per token of 12
    climb = [0.0, 0.2, 0.5, 0.8, 1.1, 1.2, 1.3, 1.4, 1.4, 1.5, 2.5, 4.5, 6.5, 7.0, 7.2]
    assert kl_acceleration(rows_of(reward__kl=climb, rollout__length_mean=[12.0] * 15), RunFacts()) is None
    assert kl_acceleration(rows_of(reward__kl=climb), RunFacts()) is not None  # per sequence, without lengths
    assert kl_acceleration(rows_of(reward__kl=convex, rollout__length_mean=[12.0] * 16), RunFacts()) is not None


def test_entropy_collapse_not_sharpening():
    collapse = [0.8, 0.8, 0.8, 0.5, 0.2, 0.05, 0.01, 0.005, 0.003, 0.002]
    at, strength = entropy_collapse(rows_of(train__entropy=collapse), RunFacts())
    assert at == 8 and "0.0033" in strength  # smoothed (0.01+0.005+0.003)/3 = 0.006 at 9; 8: 0.0217 <= 0.05, 0.12
    learned = rows_of(train__entropy=collapse, reward__mean=[0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0])
    assert "reward/mean 0.967 (from 0.3)" in entropy_collapse(learned, RunFacts())[1]  # at 9: (0.9+1+1)/3
    sharpening = [0.45, 0.4, 0.42, 0.3, 0.25, 0.2, 0.12, 0.1, 0.09, 0.1, 0.08, 0.11]  # -> 20% of the start, 0.09
    assert entropy_collapse(rows_of(train__entropy=sharpening), RunFacts()) is None


def test_group_collapse_needs_almost_every_group_for_three_iterations():
    cold = rows_of(reward__frac_zero_spread=[1.0] * 10)
    assert group_collapse(cold, RunFacts())[0] == 1
    easy = rows_of(reward__frac_zero_spread=[0.4, 0.6, 0.8, 0.9, 0.94, 1.0, 0.88, 0.94, 0.81, 1.0, 0.88])
    assert group_collapse(easy, RunFacts()) is None
    assert group_collapse(rows_of(reward__mean=[1.0] * 5), RunFacts()) is None  # PPO: no groups


def test_group_collapse_says_whether_the_prompts_were_learned_or_the_policy_is_stuck():
    spread = [0.5, 0.7, 0.9, 1.0, 1.0, 1.0, 1.0]  # smoothed >= 0.95 from iteration 5; sustained 3: onset 5, at 7
    solved = rows_of(reward__frac_zero_spread=spread, reward__mean=[0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0])
    at, strength = group_collapse(solved, RunFacts())
    # the reward at 7 (smoothed, 1.0) rose from 0.6 and is its best so far
    assert at == 5 and "reward/mean 1 (from 0.6)" in strength and "solved" in strength
    stuck = rows_of(reward__frac_zero_spread=spread, reward__mean=[0.0] * 7)
    assert group_collapse(stuck, RunFacts())[1].endswith("no reward spread, reward/mean 0")
    fell = rows_of(reward__frac_zero_spread=spread, reward__mean=[0.2, 0.9, 0.9, 0.9, 0.2, 0.2, 0.2])
    assert "solved" not in group_collapse(fell, RunFacts())[1]  # 0.2 now, 0.9 at best: not near it


def test_reward_dominance_reads_the_weights_and_the_reward_spread():
    fns = dict(reward__fn__gold=[0.5] * 12, reward__fn__bonus=[0.1, 0.1, 0.1, 0.5, 1, 2, 4, 6, 8, 8, 8, 8],
               reward__std=[1.0] * 12)
    at, strength = reward_dominance(rows_of(**fns), RunFacts({"bonus": 1.0}))
    # bonus smoothed 6: (0.5+1+2)/3 = 1.17, 1.07 above its start (>= 1 std); 5: 0.53, 0.43 above: too small
    assert at == 6 and strength.startswith("bonus made 100%")
    assert reward_dominance(rows_of(**fns), RunFacts({"bonus": 0.01})) is None  # weighted, it moves 0.08
    both = dict(fns, reward__fn__gold=[0.1 * i for i in range(12)])  # gold moves 1.0 beside bonus' 7.9: 89%
    assert reward_dominance(rows_of(**both), RunFacts({"bonus": 1.0, "gold": 1.0}))[0] >= 6
    fair = dict(fns, reward__fn__gold=fns["reward__fn__bonus"])  # gold moves alike: no one dominates
    assert reward_dominance(rows_of(**fair), RunFacts()) is None
    assert reward_dominance(rows_of(reward__fn__a=[0.1] * 10, reward__fn__b=[0.9] * 10, reward__std=[1.0] * 10),
                            RunFacts()) is None  # nothing moves
    assert reward_dominance(rows_of(reward__fn__only=[0.1 * i for i in range(10)]), RunFacts()) is None


def both_up_gold() -> list[float]:
    return [0.2 + 0.05 * i for i in range(12)]


def test_proxy_gold_divergence_on_the_series_and_on_eval():
    reward = [0.1 * i for i in range(12)]
    gold = [0.2, 0.3, 0.4, 0.5, 0.5, 0.45, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2]
    at, _ = proxy_gold_divergence(rows_of(reward__mean=reward, reward__gold_mean=gold), RunFacts())
    # smoothed best 0.4833 at 5; 8: (0.45+0.3+0.2)/3 = 0.317, 0.167 below; 7: 0.417, 0.067 below
    assert at == 8
    grammar = [1.0, 1.0, 1.0, 0.95, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.1, 0.0]  # sentiment up, sentences broken
    found = proxy_gold_divergence(rows_of(reward__mean=reward, reward__gold_mean=both_up_gold(),
                                          reward__gold_grammatical_rate=grammar), RunFacts())
    assert found[0] == 6 and found[1].startswith("reward/gold_grammatical_rate fell")  # 6: (0.95+0.9+0.7)/3 = 0.85
    early_dip = [0.17, 0.0, -0.05, 0.02, 0.04, 0.1, 0.2, 0.3, 0.3, 0.4, 0.5, 0.5]  # the first points average fewer
    assert proxy_gold_divergence(rows_of(reward__mean=[0.3] * 12, reward__gold_mean=early_dip), RunFacts()) is None
    both_up = [0.2 + 0.05 * i for i in range(12)]
    assert proxy_gold_divergence(rows_of(reward__mean=reward, reward__gold_mean=both_up), RunFacts()) is None
    falling = [1.2 - 0.1 * i for i in range(12)]  # gold falls with the reward: a bad run, not a hack
    assert proxy_gold_divergence(rows_of(reward__mean=falling, reward__gold_mean=gold[::-1][::-1][:12]),
                                 RunFacts()) is None
    ev = {"before": {"reward_mean": 0.1, "gold_mean": 0.6, "n": 400}, "after": {"reward_mean": 0.9, "gold_mean": 0.2}}
    assert proxy_gold_divergence(rows_of(reward__mean=[0.5] * 6), RunFacts(eval_result=ev))[0] == 6


def test_value_loss_blowup_and_clip_runaway():
    loss = [5, 3, 1, 0.5, 0.4, 0.4, 0.5, 2, 9, 20, 30]
    at, _ = value_loss_blowup(rows_of(train__value_loss=loss), RunFacts())
    assert at == 10  # smoothed: lowest 0.433 at 6; 9: (0.5+2+9)/3 = 3.83 < 4.33; 10: 10.33
    assert value_loss_blowup(rows_of(train__value_loss=[5, 3, 1, 0.8, 0.9, 1.1, 0.7, 1.2]), RunFacts()) is None
    clip = [0.17, 0.03, 0.02, 0.03, 0.1, 0.3, 0.5, 0.6, 0.6]
    assert clip_runaway(rows_of(train__clip_frac=clip), RunFacts())[0] == 7
    assert clip_runaway(rows_of(train__clip_frac=[0.17, 0.03, 0.04, 0.02, 0.05] * 3), RunFacts()) is None
    weights = rows_of(train__behaviour_weight_max=[1.2] * 3 + [30.0] * 4)
    assert clip_runaway(weights, RunFacts())[0] == 4  # smoothed (1.2 + 1.2 + 30) / 3 = 10.8


def test_audit_orders_findings_and_every_detector_names_a_panel_and_a_fix():
    from rlfuse.metrics.panels import PANELS

    names = {p.name for p in PANELS}
    assert all(d.panel in names and d.advice.endswith(".") for d in DETECTORS)
    rows = rows_of(train__entropy=[0.8] * 3 + [0.001] * 8, reward__frac_zero_spread=[1.0] * 11)
    found = audit(rows)
    assert [f.detector for f in found] == ["group_collapse", "entropy_collapse"]
    assert audit([]) == [] and audit(rows_of(reward__mean=["nan", None, 1.0])) == []


def test_live_watch_says_each_finding_once_and_not_again_after_resume():
    rows = rows_of(reward__frac_zero_spread=[1.0] * 8)
    watch, said = HealthWatch(), []
    for r in rows:
        said += watch.update(r)
    assert [f.detector for f in said] == ["group_collapse"]
    resumed = HealthWatch(rows=rows[:5])
    assert all(resumed.update(r) == [] for r in rows[5:])


def test_health_watch_reads_the_rows_before_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_of(reward__frac_zero_spread=[1.0] * 6)))

    class RL:
        reward, reward_weights = "m:gold,m:bonus", [1.0, 0.25]

    watch = health_watch(RL, path, 4)
    assert len(watch.rows) == 4 and watch.seen == {"group_collapse"} and watch.facts.reward_weights["bonus"] == 0.25
    assert health_watch(RL, path, 0).rows == []
    assert reward_weights({"rl": {"reward": "rm"}}) == {}
    assert reward_weights({"rl": {"reward": "a:f, b:g", "reward_weights": [2, "x"]}}) == {"f": 2.0, "g": 1.0}


def _run(path, rows, config="run:\n  seed: 0\n"):
    (path / "rl").mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    (path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "rew')
    return path


def test_audit_command_exit_status(tmp_path, capsys):
    healthy = _run(tmp_path / "ok", rows_of(reward__mean=[0.1 * i for i in range(10)], train__entropy=[0.5] * 10))
    assert main(["audit", str(healthy)]) == 0
    assert "healthy: none of the 8 detectors fired over 10 RL iterations" in capsys.readouterr().out
    sick = _run(tmp_path / "sick", rows_of(train__entropy=[0.8] * 3 + [0.001] * 8))
    assert main(["audit", str(sick / "rl")]) == 1  # the rl/ folder itself is accepted
    out = capsys.readouterr().out
    assert "Entropy collapse from iteration 6" in out and "rl.lr" in out
    empty = tmp_path / "empty"
    (empty / "rl").mkdir(parents=True)
    (empty / "config.yaml").write_text("run: {}\n")
    assert main(["audit", str(empty)]) == 0 and "no RL iterations logged yet" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["missing", "file", "not_a_run"])
def test_audit_command_refuses_what_is_not_a_run_folder_in_one_line(tmp_path, capsys, where):
    target = tmp_path / "x"
    if where == "file":
        target.write_text("hello")
    elif where == "not_a_run":
        target.mkdir()
    assert main(["audit", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlfuse audit: ") and "run folder" in err[0]
