"""`rlfuse report RUN_DIR [--baseline RUN_DIR]`: redraw a run's figures and write its self-contained report.html.

Works on finished, running and killed runs alike: everything comes from the files the run has written so far."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from rlfuse.errors import UserError
from rlfuse.files import write_text_atomic
from rlfuse.metrics import plots
from rlfuse.metrics.schedule_chart import draw_record
from rlfuse.metrics.tracker import read_metrics

FIGURES = ["summary_dashboard", "training_metrics", "throughput_over_time", "stage_breakdown", "memory_usage",
           "speedup_comparison"]


def require_run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.yaml").is_file():
        raise UserError(f"report: {p} is not an rlfuse run folder (no config.yaml); give the folder a run printed as "
                        "'run folder: ...'")
    return p


def _json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def draw_figures(run_dir: Path, baseline_dir: Path | None = None) -> dict[str, Path | str]:
    """name -> PNG path, or name -> the reason it was not drawn."""
    rows = read_metrics(run_dir / "rl" / "metrics.jsonl") if (run_dir / "rl" / "metrics.jsonl").exists() else []
    out_dir = run_dir / "figures"
    if not rows:
        return {name: "no RL iterations logged yet" for name in FIGURES}
    eval_result = _json(run_dir / "eval.json")
    base_rows = None
    if baseline_dir is not None:
        base_path = require_run_dir(baseline_dir) / "rl" / "metrics.jsonl"
        base_rows = read_metrics(base_path) if base_path.exists() else []
    numbers = plots.summary_numbers(rows, eval_result, base_rows)
    last_rewards = _json(run_dir / "rl" / "last_rewards.json")
    figs: dict[str, Path | str] = {
        "summary_dashboard": plots.summary_dashboard(rows, numbers, out_dir / "summary_dashboard.png"),
        "training_metrics": plots.training_metrics(rows, out_dir / "training_metrics.png", last_rewards),
        "throughput_over_time": plots.throughput_over_time(rows, out_dir / "throughput_over_time.png"),
        "stage_breakdown": plots.stage_breakdown(rows, out_dir / "stage_breakdown.png"),
        "memory_usage": plots.memory_usage(rows, out_dir / "memory_usage.png"),
    }
    if plots.worker_ranks(rows):  # placement on Ray: per-worker time and memory (not in FIGURES: optional)
        figs["worker_usage"] = plots.worker_usage(rows, out_dir / "worker_usage.png")
    if plots.is_async(rows):  # rl.max_staleness: staleness, importance weights, length bias
        figs["async_training"] = plots.async_training(rows, out_dir / "async_training.png")
    schedule = _json(run_dir / "rl" / "pipeline_schedule.json")
    if schedule:  # rl.train_parallel=pipeline_*: the executed schedule beside the simulated one
        figs["pipeline_schedule"] = draw_record(schedule, out_dir / "pipeline_schedule.png")
    if base_rows:
        figs["speedup_comparison"] = plots.speedup_comparison(rows, base_rows, out_dir / "speedup_comparison.png",
                                                              (run_dir.name, Path(baseline_dir).name))
    else:
        stale = out_dir / "speedup_comparison.png"
        stale.unlink(missing_ok=True)
        figs["speedup_comparison"] = ("not drawn: no baseline run given (rlfuse report RUN_DIR --baseline OTHER_RUN, "
                                      "e.g. the same config with rollout.fusion=true); a speedup is only ever measured")
    return figs


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{alt}" src="data:image/png;base64,{data}"><figcaption>{alt}</figcaption></figure>'


def _table(rows: list[tuple]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{cells}</table>"


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


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
    from rlfuse.metrics.memory import format_table  # torch: only a run that measured memory has this table

    measured = _json(run_dir / "rl" / "memory.json")
    if not measured:
        return []
    predicted = (_json(run_dir / "rl" / "memory_predicted.json") or {}).get("bytes")
    note = (f"<p class=note>Quantisation: {html.escape(str(measured.get('quantization', 'none')))}. Weights, adapters, "
            "gradients and optimiser states are tensor bytes by owner; activations, KV cache and total are measured "
            f"peaks of {html.escape(measured.get('measured_by', ''))} during the update and the rollout.</p>")
    return ["<h2>Memory per component (RL)</h2>", _table(format_table(measured, predicted)), note]


def eval_during_section(rows: list[dict], eval_result: dict) -> list[str]:
    """rl.eval_every: the held-out metrics at each evaluated iteration, between before (iteration 0) and after."""
    points = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not points:
        return []
    keys = sorted({k.removeprefix("eval/") for r in points for k in r if k.startswith("eval/")})
    table = [("iteration", *keys)]
    if eval_result.get("before"):
        table.append(("0 (before)", *(_fmt(eval_result["before"].get(k, "")) for k in keys)))
    table += [(r["step"], *(_fmt(r.get(f"eval/{k}", "")) for k in keys)) for r in points]
    if eval_result.get("after"):
        table.append((f"{rows[-1]['step']} (after)", *(_fmt(eval_result["after"].get(k, "")) for k in keys)))
    return ["<h2>Held-out evaluation during RL</h2>", _table(table)]


def samples_section(path: Path) -> list[str]:
    """rl.log_samples_every: the first and the latest table of sample completions (rl/samples.jsonl)."""
    rows = read_metrics(path) if path.exists() else []
    steps = sorted({r["step"] for r in rows})
    if not steps:
        return []
    parts = ["<h2>Sample completions during RL</h2>"]
    for step in dict.fromkeys([steps[0], steps[-1]]):
        table = [r for r in rows if r["step"] == step]
        cols = [c for c in table[0] if c != "step"]
        parts += [f"<h3>iteration {step}</h3>", _table([tuple(cols)] + [tuple(_fmt(r.get(c, "")) for c in cols)
                                                                        for r in table])]
    return parts


def write_report(run_dir: str | Path, baseline_dir: str | Path | None = None) -> Path:
    run_dir = require_run_dir(run_dir)
    figs = draw_figures(run_dir, Path(baseline_dir) if baseline_dir else None)
    rows = read_metrics(run_dir / "rl" / "metrics.jsonl") if (run_dir / "rl" / "metrics.jsonl").exists() else []
    eval_result = _json(run_dir / "eval.json") or {}
    base_rows = None
    if baseline_dir:
        p = Path(baseline_dir) / "rl" / "metrics.jsonl"
        base_rows = read_metrics(p) if p.exists() else []
    parts = [f"<h1>rlfuse run <code>{html.escape(str(run_dir))}</code></h1>"]
    done = (run_dir / "rl" / "model").exists()
    parts.append(f"<p class=status>{'finished' if done else 'in progress or stopped early'}: "
                 f"{len([r for r in rows if 'time/iteration' in r])} RL iterations logged.</p>")
    if rows:
        n = plots.summary_numbers(rows, eval_result, base_rows)
        key = [("number", "value"), ("average throughput", f"{n['avg_samples_per_s']:.2f} samples/s"),
               ("total RL time", f"{n['total_time_s']:.0f} s"), ("iterations", n["iterations"]),
               ("average reward", f"{n['avg_reward']:.3f}"), (f"peak memory ({n['memory_kind']})", f"{n['peak_memory_mb']:.0f} MiB")]
        if "measured_speedup" in n:
            key.append(("measured speedup vs baseline", f"{n['measured_speedup']:.2f}x"))
        parts += ["<h2>Key numbers</h2>", _table(key)]
    if eval_result:
        keys = sorted(set(eval_result.get("before", {})) | set(eval_result.get("after", {})))
        parts += ["<h2>Held-out evaluation, before and after RL</h2>",
                  _table([("metric", "before", "after")] + [(k, _fmt(eval_result.get("before", {}).get(k, "")),
                                                             _fmt(eval_result.get("after", {}).get(k, ""))) for k in keys])]
    parts += eval_during_section(rows, eval_result)
    stages = [(s, _json(run_dir / s / "summary.json")) for s in ("sft", "rm", "rl")]
    stage_rows = [(s, ", ".join(f"{k} {_fmt(v)}" for k, v in d.items() if k != "model_dir")) for s, d in stages if d]
    if stage_rows:
        parts += ["<h2>Stages</h2>", _table([("stage", "summary")] + stage_rows)]
    if plots.worker_ranks(rows):
        parts += ["<h2>Workers (placement on Ray)</h2>", _table(worker_table(rows))]
    parts += memory_section(run_dir)
    parts.append("<h2>Figures</h2>")
    for name in FIGURES + [n for n in ("worker_usage", "async_training") if n in figs]:
        f = figs.get(name)
        parts.append(_img(f, name.replace("_", " ")) if isinstance(f, Path) else
                     f"<p class=note><b>{name.replace('_', ' ')}</b>: {html.escape(str(f))}</p>")
    before = (_json(run_dir / "rl" / "eval_before.json") or {}).get("samples", [])
    after = _json(run_dir / "rl" / "samples_after.json") or []
    if before or after:
        parts.append("<h2>Sample generations on held-out prompts</h2><div class=samples>")
        for title, texts in (("before RL (SFT policy)", before), ("after RL", after)):
            items = "".join(f"<li>{html.escape(t)}</li>" for t in texts[:8]) or "<li>(none yet)</li>"
            parts.append(f"<div><h3>{title}</h3><ol>{items}</ol></div>")
        parts.append("</div>")
    parts += samples_section(run_dir / "rl" / "samples.jsonl")
    config = (run_dir / "config.yaml").read_text()
    parts += ["<h2>Config</h2>", f"<pre>{html.escape(config)}</pre>"]
    page = TEMPLATE.replace("{body}", "\n".join(parts))
    return write_text_atomic(run_dir / "report.html", page)


# Self-contained: inline CSS, images as data URIs, and a check the tests read back (every image decoded, no
# resource fetched from anywhere).
TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>rlfuse report</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 1.5em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; } td { border: 1px solid #ddd; padding: .25em .7em; }
tr:first-child td { font-weight: 600; background: #f5f5f5; }
figure { margin: 1em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #666; font-size: .85em; } .note { color: #666; } .status { color: #444; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .85em; }
.samples { display: grid; grid-template-columns: 1fr 1fr; gap: 1.5em; } .samples li { margin-bottom: .4em; font-size: .9em; }
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
