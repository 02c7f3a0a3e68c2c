"""Figures and report.html from metrics files with known values, from a killed run's partial metrics, from odd values
(1e30, inf, NaN, missing metrics, one iteration), on a read-only folder, and in a real headless Chromium (every
figure decodes, nothing is fetched). Run folders are written by hand: the keys are those real runs log."""

import builtins
import errno
import html
import io
import json
import math
import os
import re
import shutil
import subprocess

import pytest

from rlfuse.cli import main
from rlfuse.errors import UserError
from rlfuse.metrics.plots import summary_numbers
from rlfuse.metrics.report import FIGURES, draw_figures, write_report
from rlfuse.metrics.tracker import read_metrics


def fake_run(path, sps, torn=False, with_eval=True):
    (path / "rl").mkdir(parents=True)
    (path / "config.yaml").write_text("run:\n  seed: 0\n")
    lines = []
    for i, v in enumerate(sps, 1):
        lines.append(json.dumps({
            "step": i, "rollout/samples_per_s": v, "reward/mean": 0.1 * i, "reward/kl": 0.5, "time/iteration": 2.0,
            "time/generation": 1.0, "time/scoring": 0.5, "time/training": 0.4, "train/policy_loss": -0.01 * i,
            "train/value_loss": 1.0 / i, "mem/rss_mb": 400.0 + i, "mem/rss_peak_mb": 450.0 + i,
            "rollout/length_mean": 20.0}))
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"step": 99, "rollout/sampl'  # killed mid-write
    (path / "rl" / "metrics.jsonl").write_text(text)
    (path / "rl" / "last_rewards.json").write_text(json.dumps([0.1, 0.4, 0.3]))
    if with_eval:
        (path / "eval.json").write_text(json.dumps({"before": {"gold_positive_rate": 0.5}, "after": {"gold_positive_rate": 0.9}}))
        (path / "rl" / "eval_before.json").write_text(json.dumps({"samples": ["the acting was bad."]}))
        (path / "rl" / "samples_after.json").write_text(json.dumps(["the acting was great."]))
    return path


def test_dashboard_numbers_are_the_logged_values(tmp_path):
    rows = read_metrics(fake_run(tmp_path / "r", [10.0, 20.0, 30.0, 40.0]) / "rl" / "metrics.jsonl")
    n = summary_numbers(rows, {"before": {"gold_positive_rate": 0.5}, "after": {"gold_positive_rate": 0.9}})
    assert n["avg_samples_per_s"] == 25.0 and n["iterations"] == 4 and n["total_time_s"] == 8.0
    assert n["peak_memory_mb"] == 454.0 and n["memory_kind"] == "process RSS"
    assert n["gold_positive_before"] == 0.5 and n["gold_positive_after"] == 0.9
    assert "measured_speedup" not in n


def test_speedup_only_from_a_measured_baseline(tmp_path):
    run, base = fake_run(tmp_path / "fused", [30.0, 30.0]), fake_run(tmp_path / "unfused", [10.0, 20.0])
    figs = draw_figures(run)
    assert isinstance(figs["speedup_comparison"], str) and "no baseline" in figs["speedup_comparison"]
    assert not (run / "figures" / "speedup_comparison.png").exists()
    figs = draw_figures(run, base)
    assert figs["speedup_comparison"].stat().st_size > 0
    n = summary_numbers(read_metrics(run / "rl" / "metrics.jsonl"), None, read_metrics(base / "rl" / "metrics.jsonl"))
    assert n["measured_speedup"] == pytest.approx(2.0)


def test_killed_runs_partial_metrics_still_render(tmp_path):
    run = fake_run(tmp_path / "killed", [5.0, 6.0], torn=True, with_eval=False)
    assert main(["report", str(run)]) == 0
    for name in FIGURES[:-1]:  # all but the speedup, which needs a baseline
        assert (run / "figures" / f"{name}.png").stat().st_size > 1000
    page = (run / "report.html").read_text()
    assert "in progress or stopped early" in page and "2 RL iterations" in page


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not an rlfuse run folder" in err and "\n" not in err


def test_report_is_self_contained(tmp_path):
    page = write_report(fake_run(tmp_path / "r", [1.0, 2.0])).read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    assert page.count("data:image/png;base64,") == len(FIGURES) - 1  # no speedup figure without a baseline
    assert "the acting was </span><b>great.</b>" in page and "seed: 0" in page


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(chromium() is None, reason="no Chromium on this machine (CI installs Debian's chromium package)")
def test_report_in_headless_chromium(tmp_path):
    run, base = fake_run(tmp_path / "r", [3.0, 4.0]), fake_run(tmp_path / "b", [1.0, 2.0])
    page = write_report(run, base)
    out = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
                          page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    body = re.search(r"<body[^>]*>", out.stdout)
    assert body, out.stderr[-2000:]
    tag = body.group(0)
    assert f'data-images="{len(FIGURES)}"' in tag
    assert 'data-images-loaded="true"' in tag
    assert 'data-external-requests="0"' in tag


# ------------------------------------------------------------------------------------------- the dashboard


def write_rows(run, rows, eval_result=None):
    (run / "rl").mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("rl:\n  algo: ppo\n")
    (run / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if eval_result is not None:
        (run / "eval.json").write_text(json.dumps(eval_result))
    return run


def dashboard_alt(page):
    alt = re.search(r'<img alt="dashboard: ([^"]*)"', page)
    assert alt, "no dashboard image on the page"
    return html.unescape(alt.group(1)).split(", ")


def test_the_page_draws_the_critic_only_for_a_run_with_one(tmp_path):
    base = {"reward/mean": 0.5, "reward/std": 0.2, "reward/kl": 0.1, "train/entropy": 2.0, "time/iteration": 1.0,
            "rollout/samples_per_s": 10.0}
    ppo = [{"step": i, **base, "train/value_loss": 1.0 / i} for i in (1, 2, 3)]
    grpo = [{"step": i, **base, "reward/frac_zero_spread": 0.1 * i} for i in (1, 2, 3)]
    ppo_page = write_report(write_rows(tmp_path / "ppo", ppo)).read_text()
    grpo_page = write_report(write_rows(tmp_path / "grpo", grpo)).read_text()
    common = ["reward ± std", "KL to reference", "entropy"]
    assert dashboard_alt(ppo_page) == common + ["value loss", "samples / s"]
    assert dashboard_alt(grpo_page) == common + ["zero-spread", "samples / s"]


def test_odd_values_still_make_a_report(tmp_path, capsys):
    """A reward of 1e30 (and 1.7e308, whose band overflows), inf and NaN (the tracker writes them as strings), a
    metric missing in some rows, a row of the wrong shape, no eval.json (a killed run)."""
    rows = [{"step": 1, "reward/mean": 0.2, "reward/std": 0.1, "time/iteration": 1.0, "train/entropy": 2.0},
            {"step": 2, "reward/mean": 1e30, "reward/std": 1e30, "time/iteration": "nan", "train/entropy": "inf"},
            {"step": 3, "reward/mean": "inf", "reward/std": "nan", "time/iteration": 1.0},
            {"step": 4, "reward/mean": 1.7e308, "reward/std": 1.7e308, "time/iteration": 1e30},
            {"step": 5, "reward/mean": "nan", "rollout/samples_per_s": "inf"},
            {"no step": True}]
    run = write_rows(tmp_path / "odd", rows)
    # json.dumps writes Infinity and NaN for the last iteration's rewards, as the trainer's does
    (run / "rl" / "last_rewards.json").write_text(json.dumps([0.1, 1e30, math.inf, -math.inf, math.nan, 1.7e308]))
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    page = (run / "report.html").read_text()
    assert dashboard_alt(page)[:2] == ["reward ± std", "entropy"]
    for name in FIGURES[:-1]:
        assert (run / "figures" / f"{name}.png").stat().st_size > 1000
    assert "4 RL iterations logged" in page and "in progress or stopped early" in page  # 5 has no time/iteration


def test_a_one_iteration_run(tmp_path):
    run = write_rows(tmp_path / "one", [{"step": 1, "reward/mean": 0.3, "time/iteration": 2.0,
                                         "mem/rss_peak_mb": 900.0}])
    page = write_report(run).read_text()
    assert dashboard_alt(page) == ["reward ± std", "memory (RL)"] and "1 RL iterations logged" in page


def test_the_memory_card_is_the_rl_stages_own_peak(tmp_path):
    """mem/rss_peak_mb of rl/metrics.jsonl is the RL stage's peak (stage_tracker restarts it,
    tests/unit/test_report_panels.py): the report reads that series, never a process-wide figure."""
    rows = [{"step": i, "reward/mean": 0.1, "time/iteration": 1.0, "mem/rss_mb": 500.0 + i,
             "mem/rss_peak_mb": 600.0 + 10 * i} for i in (1, 2, 3)]
    page = write_report(write_rows(tmp_path / "mem", rows)).read_text()
    assert re.search(r"peak memory, RL stage</div><div class=value>630 MiB RSS<", page)
    assert "memory (RL)" in dashboard_alt(page)


# ------------------------------------------------------------------------------------------- reward vs gold


WARNING = "Reward and gold score disagree"


@pytest.mark.parametrize("after, warned", [({"reward_mean": 0.22, "gold_positive_rate": 0.31}, True),
                                           ({"reward_mean": 0.22, "gold_positive_rate": 0.60}, False),
                                           ({"reward_mean": -0.2, "gold_positive_rate": 0.31}, False)])
def test_the_warning_box_when_the_reward_rose_while_the_gold_score_fell(tmp_path, after, warned):
    rows = [{"step": i, "reward/mean": 0.1, "time/iteration": 1.0} for i in (1, 2)]
    before = {"reward_mean": -0.09, "gold_positive_rate": 0.53}
    run = write_rows(tmp_path / "r", rows, {"before": before, "after": after})
    page = write_report(run).read_text()
    assert (WARNING in page) is warned
    if warned:  # at the top, before the numbers and the curves
        assert "rose from -0.09 to 0.22" in page and "fell from 0.53 to 0.31" in page
        assert page.index(WARNING) < page.index("class=cards") < page.index("dashboard:")


def test_the_warning_from_the_series_of_a_killed_run(tmp_path):
    rows = [{"step": i, "reward/mean": 0.1 * i, "reward/gold_mean": 0.5 - 0.1 * i, "time/iteration": 1.0}
            for i in range(1, 7)]
    assert WARNING in write_report(write_rows(tmp_path / "r", rows)).read_text()


def test_the_health_panel_points_to_the_gold_warning_rather_than_repeating_it(tmp_path):
    rows = [{"step": i, "reward/mean": 0.1 * i, "reward/gold_mean": 0.9 - 0.1 * i, "time/iteration": 1.0}
            for i in range(1, 10)]
    page = write_report(write_rows(tmp_path / "r", rows)).read_text()
    assert WARNING in page and "<b>Reward up, gold down</b> from iteration" in page  # the detector fired too
    assert "see the warning above." in page and page.lower().count("read the samples") == 1  # advice said once


def test_the_health_panel_lists_findings_and_marks_their_onset(tmp_path):
    rows = [{"step": i, "reward/mean": 0.1, "time/iteration": 1.0, "train/entropy": 0.8 if i <= 3 else 0.001}
            for i in range(1, 12)]
    sick = write_report(write_rows(tmp_path / "sick", rows)).read_text()
    assert "Health: 1 of 8 detectors fired" in sick and "<b>Entropy collapse</b> from iteration 6" in sick
    healthy = [dict(r, **{"train/entropy": 0.8}) for r in rows]
    assert "Health: none of the 8 detectors fired" in write_report(write_rows(tmp_path / "ok", healthy)).read_text()


# ------------------------------------------------------------------------------------------- tables and samples


def test_stages_table_and_marked_prompts(tmp_path):
    run = fake_run(tmp_path / "r", [1.0, 2.0])
    (run / "sft").mkdir()
    (run / "sft" / "summary.json").write_text(json.dumps({"val_loss": 2.81, "perplexity": 16.7, "seconds": 12.0,
                                                          "model_dir": "/x/sft/model"}))
    (run / "rm").mkdir()
    (run / "rm" / "summary.json").write_text(json.dumps({"accuracy": 0.793, "margin": 0.99, "seconds": 20.0}))
    (run / "rl" / "samples.jsonl").write_text(json.dumps({"step": 1, "prompt": "soon, the sailor", "completion":
                                                          " sings.", "reward": 0.3, "finish": "eos"}) + "\n")
    page = write_report(run).read_text()
    assert "<td>reward model</td><td>20</td><td>held-out pair accuracy 0.793, mean margin 0.99</td>" in page
    assert "<td>SFT</td><td>12</td><td>held-out loss 2.81, perplexity 16.7</td>" in page
    assert "model_dir" not in page.split("<h2>Config</h2>")[0]
    assert "<span class=prompt>soon, the sailor</span><b> sings.</b>" in page
    # the held-out samples before and after share their prompt "the acting was "
    assert "<span class=prompt>the acting was </span><b>bad.</b>" in page


# ------------------------------------------------------------------------------------------- read-only folders


def deny_writes_under(folder, monkeypatch):
    """Root writes into a chmod'ed folder anyway: refuse every write under `folder` as a read-only mount would."""
    def inside(path):
        return str(os.path.abspath(os.fspath(path))).startswith(str(folder))

    def refuse(path):
        raise PermissionError(errno.EROFS, "Read-only file system", os.fspath(path))

    real_open, real_io_open = builtins.open, io.open
    def guarded(opener):
        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
                refuse(file)
            return opener(file, mode, *args, **kwargs)
        return open_
    monkeypatch.setattr(builtins, "open", guarded(real_open))
    monkeypatch.setattr(io, "open", guarded(real_io_open))
    for name in ("mkdir", "unlink", "replace", "rename"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda p, *a, _real=real, **k: refuse(p) if inside(p) else _real(p, *a, **k))


def test_a_read_only_run_folder_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "ro", [1.0, 2.0])
    write_report(run)  # figures/ and report.html exist: a redraw must replace them
    for d in (run, run / "figures", run / "rl"):
        d.chmod(0o555)
    try:
        probe = run / "probe"
        try:
            probe.write_text("")
            probe.unlink()
            deny_writes_under(run, monkeypatch)  # running as root: chmod alone does not stop writes
        except PermissionError:
            pass
        with pytest.raises(UserError, match=r"cannot write report.html into .*ro .*copy the run folder somewhere"):
            write_report(run)
        assert main(["report", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert str(run) in err and "\n" not in err and "Traceback" not in err
    finally:
        monkeypatch.undo()
        for d in (run, run / "figures", run / "rl"):
            d.chmod(0o755)
