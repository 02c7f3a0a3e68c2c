"""`rlfuse report RUN_DIR [--baseline RUN_DIR]`: redraw a run's figures and write its self-contained report.html.

Works on finished, running and killed runs alike: everything comes from the files the run has written so far. The
page reads top down as a practitioner checks a run: a warning where the reward and the gold score disagree, the key
numbers, every logged curve on one screen (rlfuse/metrics/panels.py), then the evaluations, stages and samples, and
the details (time per stage, memory per component, workers) below."""

from __future__ import annotations

import base64
import errno
import html
import json
import os
from pathlib import Path

import yaml

from rlfuse.errors import WRITE_ERRNOS, UserError
from rlfuse.files import write_text_atomic
from rlfuse.metrics import plots
from rlfuse.metrics.audit import metric_rows, run_facts
from rlfuse.metrics.health import DETECTORS, audit, reward_gold_divergence
from rlfuse.metrics.panels import finite, moves, select_panels, with_evaluations
from rlfuse.metrics.schedule_chart import draw_record

FIGURES = ["summary_dashboard", "stage_breakdown", "reward_distribution", "speedup_comparison"]
RETIRED_FIGURES = ["training_metrics", "throughput_over_time", "memory_usage"]
"""Figures of earlier versions, now panels of the dashboard: removed when a run folder is redrawn, so its figures/
holds no stale copies."""


def require_run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.yaml").is_file():
        raise UserError(f"report: {p} is not an rlfuse run folder (no config.yaml); give the folder a run printed as "
                        "'run folder: ...'")
    return p


def _json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def draw_figures(run_dir: Path, baseline_dir: Path | None = None) -> dict[str, Path | str]:
    """name -> PNG path, or name -> the reason it was not drawn."""
    rows = metric_rows(run_dir / "rl" / "metrics.jsonl")
    out_dir = run_dir / "figures"
    for name in RETIRED_FIGURES:
        (out_dir / f"{name}.png").unlink(missing_ok=True)
    if not rows:
        return {name: "no RL iterations logged yet" for name in FIGURES}
    eval_rows = with_evaluations(rows, _dict(_json(run_dir / "eval.json")))
    last_rewards = _json(run_dir / "rl" / "last_rewards.json")
    marks: dict[str, list[tuple[int, str]]] = {}
    for f in audit(rows, run_facts(run_dir)):
        marks.setdefault(f.panel, []).append((f.onset, f.title))
    figs: dict[str, Path | str] = {
        "summary_dashboard": plots.summary_dashboard(eval_rows, out_dir / "summary_dashboard.png", marks=marks),
        "stage_breakdown": plots.stage_breakdown(rows, out_dir / "stage_breakdown.png"),
        "reward_distribution": (plots.reward_distribution(last_rewards, out_dir / "reward_distribution.png")
                                if isinstance(last_rewards, list) and last_rewards else
                                "not drawn: no rl/last_rewards.json (written after each iteration)"),
    }
    if plots.worker_ranks(rows):  # placement on Ray: per-worker time and memory (not in FIGURES: optional)
        figs["worker_usage"] = plots.worker_usage(rows, out_dir / "worker_usage.png")
    if plots.is_async(rows):  # rl.max_staleness: staleness, importance weights, length bias
        figs["async_training"] = plots.async_training(rows, out_dir / "async_training.png")
    schedule = _json(run_dir / "rl" / "pipeline_schedule.json")
    if schedule:  # rl.train_parallel=pipeline_*: the executed schedule beside the simulated one
        figs["pipeline_schedule"] = draw_record(schedule, out_dir / "pipeline_schedule.png")
    base_rows = metric_rows(require_run_dir(baseline_dir) / "rl" / "metrics.jsonl") if baseline_dir else []
    if base_rows:
        figs["speedup_comparison"] = plots.speedup_comparison(rows, base_rows, out_dir / "speedup_comparison.png",
                                                              (run_dir.name, Path(baseline_dir).name))
    else:
        (out_dir / "speedup_comparison.png").unlink(missing_ok=True)
        figs["speedup_comparison"] = ("not drawn: no baseline run given (rlfuse report RUN_DIR --baseline OTHER_RUN, "
                                      "e.g. the same config with rollout.fusion=true); a speedup is only ever measured")
    return figs


# ------------------------------------------------------------------------------------------- HTML pieces


def _img(path: Path, alt: str, caption: str = "") -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f'<figcaption>{html.escape(caption or alt)}</figcaption></figure>')


def _table(rows: list[tuple]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{cells}</table>"


def _fmt(v) -> str:
    return plots.short(v) if isinstance(v, float) else str(v)


def _change(a, b) -> str:
    return f"{_fmt(a)} → {_fmt(b)}"


def key_numbers(rows: list[dict], eval_result: dict, base_rows: list[dict] | None) -> list[tuple[str, str]]:
    """(label, value) cards, one row of them: each number once, where the run logged it (the last value of every
    curve is on its panel; time and iterations are in the status line)."""
    n = plots.summary_numbers(rows, eval_result, base_rows)
    cards = []
    for key, label in (("reward/mean", "reward"), ("reward/gold_mean", "gold score")):
        xs, ys = plots.series(rows, key)
        if ys:
            cards.append((f"{label}, iteration {xs[0]} → {xs[-1]}", _change(ys[0], ys[-1])))
    before, after = _dict(eval_result.get("before")), _dict(eval_result.get("after"))
    for key, label in (("reward_mean", "held-out reward"), ("gold_positive_rate", "held-out gold positive rate")):
        if finite(before.get(key)) and finite(after.get(key)):
            cards.append((f"{label}, before → after RL", _change(before[key], after[key])))
    if finite(n["avg_samples_per_s"]):
        tokens = f" · {_fmt(n['avg_tokens_per_s'])} tokens/s" if finite(n["avg_tokens_per_s"]) else ""
        cards.append(("throughput, mean", f"{_fmt(n['avg_samples_per_s'])} samples/s{tokens}"))
    if finite(n["peak_memory_mb"]):
        kind = n["memory_kind"].removeprefix("process ")
        cards.append(("peak memory, RL stage", f"{n['peak_memory_mb']:,.0f} MiB {kind}"))
    if "measured_speedup" in n:
        cards.append(("measured speedup vs baseline", f"{n['measured_speedup']:.2f}x"))
    return cards


def _cards(cards: list[tuple[str, str]]) -> str:
    items = "".join(f"<div class=card><div class=label>{html.escape(label)}</div>"
                    f"<div class=value>{html.escape(v)}</div></div>" for label, v in cards)
    return f"<div class=cards>{items}</div>"


def run_settings(run_dir: Path) -> dict:
    """The run's config.yaml as a dict ({} where it cannot be read: the report still draws the metrics)."""
    try:
        return _dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    except (OSError, yaml.YAMLError):
        return {}


def status_line(run_dir: Path, rows: list[dict], settings: dict) -> str:
    """Finished or not, algorithm, iterations, and the sampling temperature where it is one number (a constant drawn
    as a line would read as a threshold; a schedule gets its own panel)."""
    done = (run_dir / "rl" / "model").exists()
    rl = _dict(settings.get("rl"))
    _, seconds = plots.series(rows, "time/iteration")
    logged = sum("time/iteration" in r for r in rows)  # an iteration whose time is NaN was logged all the same
    parts = ["finished" if done else "in progress or stopped early",
             f"{logged} RL iterations logged" + (f" in {sum(seconds):.0f} s" if seconds else "")]
    if rl.get("algo"):
        parts.insert(1, f"{rl['algo']}, k={rl.get('k', 1)}")
    _, temps = plots.series(rows, "rollout/temperature")
    if temps and not moves("rollout/temperature")(rows):
        parts.append(f"sampling temperature {_fmt(temps[0])} (constant)")
    elif temps:
        parts.append(f"sampling temperature {_fmt(temps[0])} → {_fmt(temps[-1])} (schedule: its own panel)")
    return "<p class=status>" + html.escape(" · ".join(parts)) + ".</p>"


def warnings_section(rows: list[dict], eval_result: dict) -> list[str]:
    found = reward_gold_divergence(rows, eval_result)
    if found is None:
        return []
    return [f"<div class=warning role=alert><b>Reward and gold score disagree.</b> {html.escape(found.message())}"
            "</div>"]


GOLD_DETECTOR = "proxy_gold_divergence"
"""The health detector whose finding the reward-and-gold warning above it already spells out."""


def health_section(run_dir: Path, rows: list[dict], gold_warned: bool = False) -> list[str]:
    """The health detectors' findings (rlfuse audit): each one's onset (marked on the dashboard), strength and fix;
    with gold_warned, the reward-versus-gold finding points to the warning above instead of repeating it."""
    if not rows:
        return []
    findings = audit(rows, run_facts(run_dir))
    if not findings:
        return [f"<p class=status>Health: none of the {len(DETECTORS)} detectors fired (<code>rlfuse audit</code>, "
                "docs/health.md).</p>"]
    said = lambda f: ("see the warning above." if gold_warned and f.detector == GOLD_DETECTOR
                      else f"{html.escape(f.strength)}. {html.escape(f.advice)}")
    items = "".join(f"<li><b>{html.escape(f.title)}</b> from iteration {f.onset}: {said(f)}</li>" for f in findings)
    return [f"<div class=warning role=alert><b>Health: {len(findings)} of {len(DETECTORS)} detectors fired</b> "
            f"(onsets marked on the dashboard; <code>rlfuse audit</code>, docs/health.md)<ul>{items}</ul></div>"]


STAGES = (
    ("sft", "SFT", (("val_loss", "held-out loss {}"), ("perplexity", "perplexity {}"),
                    ("gold_positive_rate", "gold positive rate of samples {}"))),
    ("rm", "reward model", (("accuracy", "held-out pair accuracy {}"), ("margin", "mean margin {}"))),
    ("rl", "RL", ()),  # its result is the held-out evaluation before and after it (eval.json)
)
"""Per stage: its folder, its name, and the summary.json keys that say how it went, in the words of its headline."""


def rl_result(eval_result: dict) -> str:
    before, after = _dict(eval_result.get("before")), _dict(eval_result.get("after"))
    parts = [f"{label} {_change(before[k], after[k])}" for k, label in
             (("reward_mean", "held-out reward"), ("gold_positive_rate", "gold positive rate"))
             if finite(before.get(k)) and finite(after.get(k))]
    if finite(after.get("kl")):
        parts.append(f"KL {_fmt(after['kl'])}")
    return ", ".join(parts) or "no evaluation yet"


def stages_section(run_dir: Path, eval_result: dict) -> list[str]:
    """One row per stage the run has finished: seconds and headline result, not its summary.json's every key."""
    rows = [("stage", "seconds", "result")]
    for folder, name, results in STAGES:
        summary = _json(run_dir / folder / "summary.json")
        if isinstance(summary, dict):
            seconds = f"{summary['seconds']:.0f}" if finite(summary.get("seconds")) else "-"
            result = (rl_result(eval_result) if folder == "rl" else
                      ", ".join(text.format(_fmt(summary[k])) for k, text in results if k in summary) or "-")
            rows.append((name, seconds, result))
    return ["<div><h2>Stages</h2>", _table(rows), "</div>"] if len(rows) > 1 else []


def evaluation_section(eval_result: dict) -> list[str]:
    before, after = _dict(eval_result.get("before")), _dict(eval_result.get("after"))
    keys = sorted((set(before) | set(after)) - {"samples", "n"})
    if not keys:
        return []
    n = after.get("n", before.get("n"))
    return [f"<div><h2>Held-out evaluation, before and after RL{f' ({n} prompts)' if finite(n) else ''}</h2>",
            _table([("metric", "before", "after")]
                   + [(k, _fmt(before.get(k, "")), _fmt(after.get(k, ""))) for k in keys]),
            "</div>"]


def worker_table(rows: list[dict]) -> list[tuple]:
    """Per worker: mean rollout busy seconds per iteration and their share of the rollout's wall time, mean training
    seconds per iteration (workers of the actor's group), peak resident memory."""
    wall = plots.mean(plots.series(rows, "time/rollout")[1])
    out = [("worker", "rollout busy s / iteration", "share of rollout wall time", "training s / iteration",
            "peak RSS (MiB)")]
    for rank in plots.worker_ranks(rows):
        busy = plots.mean(plots.series(rows, f"worker/{rank}/busy_s")[1])
        train = plots.series(rows, f"worker/{rank}/train_s")[1]
        rss = max(plots.series(rows, f"worker/{rank}/rss_peak_mb")[1] or plots.series(rows, f"worker/{rank}/rss_mb")[1]
                  or [float("nan")])
        out.append((rank, f"{busy:.2f}", f"{busy / wall:.0%}" if wall else "",
                    f"{plots.mean(train):.2f}" if train else "-", f"{rss:.0f}"))
    driver = max(plots.series(rows, "mem/rss_peak_mb")[1] or [float("nan")])
    return out + [("driver (loop, evaluation)", "", "", "", f"{driver:.0f}")]


def memory_section(run_dir: Path) -> list[str]:
    """The RL stage's measured memory per component (rl/memory.json, rlfuse/metrics/memory.py), beside the planner's
    prediction where the run has one (rl/memory_predicted.json: {"bytes": {component: bytes}})."""
    measured = _json(run_dir / "rl" / "memory.json")
    if not isinstance(measured, dict) or not isinstance(measured.get("bytes"), dict):
        return []
    from rlfuse.metrics.memory import format_table  # torch: only a run that measured memory has this table

    predicted = _dict(_json(run_dir / "rl" / "memory_predicted.json")).get("bytes")
    note = (f"<p class=note>Quantisation: {html.escape(str(measured.get('quantization', 'none')))}. Weights, adapters, "
            "gradients and optimiser states are tensor bytes by owner; activations, KV cache and total are measured "
            f"peaks of {html.escape(str(measured.get('measured_by', '')))} during the update and the rollout.</p>")
    return ["<h2>Memory per component (RL)</h2>", _table(format_table(measured, predicted)), note]


def eval_during_section(rows: list[dict], eval_result: dict) -> list[str]:
    """rl.eval_every: the held-out metrics at each evaluated iteration, between before (iteration 0) and after."""
    points = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not points:
        return []
    keys = sorted({k.removeprefix("eval/") for r in points for k in r if k.startswith("eval/")})
    table = [("iteration", *keys)]
    before, after = _dict(eval_result.get("before")), _dict(eval_result.get("after"))
    if before:
        table.append(("0 (before)", *(_fmt(before.get(k, "")) for k in keys)))
    table += [(r["step"], *(_fmt(r.get(f"eval/{k}", "")) for k in keys)) for r in points]
    if after:
        table.append((f"{rows[-1]['step']} (after)", *(_fmt(after.get(k, "")) for k in keys)))
    return ["<h2>Held-out evaluation during RL</h2>", _table(table)]


# ------------------------------------------------------------------------------------------- samples


def prompt_end(text: str, other: str | None, prompt: str | None = None) -> int:
    """Where the prompt ends in `text`: the recorded prompt's length where there is one, else the start `text` shares
    with `other` (the sample of the same held-out prompt after RL), cut back to a word's end. That shared start holds
    the prompt and at most a few words both samples began with: never less than the prompt. 0: not known."""
    if prompt and text.startswith(prompt):
        return len(prompt)
    if not other:
        return 0
    n = len(os.path.commonprefix([text, other]))
    if n >= min(len(text), len(other)):
        return 0  # one sample is the other's start: nothing tells the prompt from the completion
    if not text[n - 1:n].isspace() and not text[n:n + 1].isspace():
        n = text.rfind(" ", 0, n) + 1  # mid-word: the word belongs to both completions, not the prompt
    return n


def _sample(text: str, cut: int) -> str:
    """The prompt muted, the completion in bold."""
    return f"<span class=prompt>{html.escape(text[:cut])}</span><b>{html.escape(text[cut:])}</b>"


def held_out_samples_section(run_dir: Path) -> list[str]:
    before_file = _dict(_json(run_dir / "rl" / "eval_before.json"))
    before = [t for t in before_file.get("samples") or [] if isinstance(t, str)]
    after = [t for t in _json(run_dir / "rl" / "samples_after.json") or [] if isinstance(t, str)]
    prompts = before_file.get("prompts") or []  # recorded prompts, where the evaluation keeps them
    if not before and not after:
        return []
    parts = ["<h2>Sample generations on held-out prompts</h2>",
             "<p class=note>Grey: the prompt (the start each sample shares with the other column's sample of the same "
             "prompt, where the prompts are not recorded); bold: the policy's completion.</p><div class=samples>"]
    for title, texts, others in (("before RL (SFT policy)", before, after), ("after RL", after, before)):
        items = "".join(f"<li>{_sample(t, prompt_end(t, others[i] if i < len(others) else None, _at(prompts, i)))}</li>"
                        for i, t in enumerate(texts[:8])) or "<li>(none yet)</li>"
        parts.append(f"<div><h3>{title}</h3><ol>{items}</ol></div>")
    return parts + ["</div>"]


def _at(items: list, i: int):
    return items[i] if i < len(items) and isinstance(items[i], str) else None


def samples_section(path: Path) -> list[str]:
    """rl.log_samples_every: the first and the latest table of sample completions (rl/samples.jsonl), each sample's
    prompt muted and its completion in bold."""
    rows = metric_rows(path)
    steps = sorted({r["step"] for r in rows})
    if not steps:
        return []
    parts = ["<h2>Sample completions during RL</h2>"]
    for step in dict.fromkeys([steps[0], steps[-1]]):
        table = [r for r in rows if r["step"] == step]
        cols = [c for c in table[0] if c not in ("step", "prompt", "completion")]
        head = "".join(f"<td>{html.escape(c)}</td>" for c in ["prompt → completion", *cols])
        body = "".join("<tr><td class=text>" + _sample(str(r.get("prompt", "")) + str(r.get("completion", "")),
                                                       len(str(r.get("prompt", ""))))
                       + "</td>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in cols) + "</tr>"
                       for r in table)
        parts += [f"<h3>iteration {step}</h3>", f"<table><tr>{head}</tr>{body}</table>"]
    return parts


# ------------------------------------------------------------------------------------------- the page


def figures_section(figs: dict[str, Path | str]) -> list[str]:
    """Everything below the dashboard: time per stage, reward distribution, the optional figures side by side where
    they fit; then why any of them was not drawn (the speedup without a baseline)."""
    names = [n for n in FIGURES[1:] if n in figs] + [n for n in ("worker_usage", "async_training", "pipeline_schedule")
                                                     if n in figs]
    drawn = [_img(figs[n], n.replace("_", " ")) for n in names if isinstance(figs[n], Path)]
    notes = [f"<p class=note><b>{n.replace('_', ' ')}</b>: {html.escape(str(figs[n]))}</p>" for n in names
             if not isinstance(figs[n], Path)]
    return ["<h2>Details</h2>", "<div class=figs>", *drawn, "</div>", *notes]


def dashboard_section(figs: dict[str, Path | str], rows: list[dict]) -> list[str]:
    f = figs.get("summary_dashboard")
    if not isinstance(f, Path):
        return [f"<p class=note>{html.escape(str(f or 'no RL iterations logged yet'))}</p>"]
    titles = ", ".join(p.title for p in select_panels(rows))
    return [_img(f, f"dashboard: {titles}", "x axis: RL iteration; top right of each panel: its last value; a band: "
                 "± one standard deviation over the iteration's samples")]


def build_page(run_dir: Path, figs: dict[str, Path | str], baseline_dir: Path | None) -> str:
    rows = metric_rows(run_dir / "rl" / "metrics.jsonl")
    eval_result = _dict(_json(run_dir / "eval.json"))
    base_rows = metric_rows(Path(baseline_dir) / "rl" / "metrics.jsonl") if baseline_dir else None
    parts = [f"<h1>rlfuse run <code>{html.escape(str(run_dir))}</code></h1>",
             status_line(run_dir, rows, run_settings(run_dir))]
    warned = warnings_section(rows, eval_result)
    parts += warned + health_section(run_dir, rows, gold_warned=bool(warned))
    if rows:
        parts.append(_cards(key_numbers(rows, eval_result, base_rows)))
    parts += dashboard_section(figs, with_evaluations(rows, eval_result))
    tables = evaluation_section(eval_result) + stages_section(run_dir, eval_result)
    if tables:
        parts += ["<div class=pair>", *tables, "</div>"]
    parts += held_out_samples_section(run_dir)
    parts += eval_during_section(rows, eval_result)
    parts += samples_section(run_dir / "rl" / "samples.jsonl")
    parts += figures_section(figs)
    parts += memory_section(run_dir)
    if plots.worker_ranks(rows):
        parts += ["<h2>Workers (placement on Ray)</h2>", _table(worker_table(rows))]
    config = (run_dir / "config.yaml").read_text()
    parts += ["<h2>Config</h2>", f"<pre>{html.escape(config)}</pre>"]
    return TEMPLATE.replace("{body}", "\n".join(parts))


def write_report(run_dir: str | Path, baseline_dir: str | Path | None = None) -> Path:
    """Draw the figures into RUN_DIR/figures and write RUN_DIR/report.html; returns its path. A folder that cannot be
    written (read-only, full) is a UserError of one line, not a traceback."""
    run_dir = require_run_dir(run_dir)
    baseline = Path(baseline_dir) if baseline_dir else None
    try:
        figs = draw_figures(run_dir, baseline)
        return write_text_atomic(run_dir / "report.html", build_page(run_dir, figs, baseline))
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        space = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        fix = ("free space there and run rlfuse report again" if space else
               f"copy the run folder somewhere writable (cp -r {run_dir} /tmp/) and run rlfuse report on the copy")
        raise UserError(f"report: cannot write report.html into {run_dir} ({e.strerror or 'not writable'}): {fix}") \
            from None


# Self-contained: inline CSS, images as data URIs, and a check the tests read back (every image decoded, no
# resource fetched from anywhere).
TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>rlfuse report</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 1360px; margin: .8em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.3em; margin: .2em 0; } h1 code { font-size: .85em; color: #444; }
h2 { font-size: 1.1em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.4em; }
h3 { font-size: 1em; margin: .8em 0 .3em; }
table { border-collapse: collapse; } td { border: 1px solid #ddd; padding: .25em .7em; vertical-align: top; }
tr:first-child td { font-weight: 600; background: #f5f5f5; }
figure { margin: .6em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #666; font-size: .85em; } .note { color: #666; font-size: .9em; }
.status { color: #444; margin: .2em 0 .6em; }
.warning { background: #fff3cd; border: 1px solid #e0b400; border-left: 6px solid #d39e00; padding: .6em .9em;
           margin: .6em 0; border-radius: 4px; }
.cards { display: flex; flex-wrap: wrap; gap: .4em; margin: .4em 0; }
.card { border: 1px solid #e3e3e3; border-radius: 6px; padding: .25em .6em; background: #fafafa; }
.card .label { font-size: .72em; color: #666; } .card .value { font-size: .95em; font-weight: 600; }
.figs { display: flex; flex-wrap: wrap; gap: 0 1.5em; align-items: flex-end; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 2em; align-items: start; }
.prompt { color: #8a8a8a; } .text { max-width: 60em; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .85em; }
.samples { display: grid; grid-template-columns: 1fr 1fr; gap: 1.5em; }
.samples li { margin-bottom: .4em; font-size: .9em; }
</style></head>
<body>
{body}
<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  document.body.setAttribute("data-images", String(imgs.length));
  document.body.setAttribute("data-images-loaded", String(imgs.every(function (i) { return i.naturalWidth > 0; })));
  var fetched = performance.getEntriesByType("resource").filter(function (e) { return !/^data:/.test(e.name); });
  document.body.setAttribute("data-external-requests", String(fetched.length));
});
</script>
</body></html>
"""
