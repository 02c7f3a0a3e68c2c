"""Figures and report.html from metrics files with known values, from a killed run's partial metrics, and in a real
headless Chromium (every figure decodes, nothing is fetched)."""

import json
import re
import shutil
import subprocess

import pytest

from rlfuse.cli import main
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
    for name in FIGURES[:-1]:
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
    assert "the acting was great." in page and "seed: 0" in page


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
