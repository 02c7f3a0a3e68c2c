"""`rlfuse audit RUN_DIR`: the health detectors (health.DETECTORS) on a run folder, finished, running or killed, and
made by any version (they read only metrics.jsonl, config.yaml and eval.json)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlfuse.errors import UserError
from rlfuse.metrics.health import DETECTORS, Finding, HealthWatch, RunFacts, audit
from rlfuse.metrics.panels import finite
from rlfuse.metrics.tracker import read_metrics


def run_folder(path: str | Path) -> Path:
    """The run folder: PATH itself, or its parent where PATH is the run's rl/ folder."""
    p = Path(path)
    if (p / "metrics.jsonl").is_file() and not (p / "rl").is_dir():
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{p} is not a folder; give the run folder a run printed as 'run folder: ...'")
    if not (p / "config.yaml").is_file() and not (p / "rl" / "metrics.jsonl").is_file():
        raise UserError(f"{p} is not an rlfuse run folder (no config.yaml, no rl/metrics.jsonl); give the "
                        "folder a run printed as 'run folder: ...'")
    return p


def _read(path: Path, parse) -> object:
    try:
        return parse(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None


def reward_weights(config: dict | None) -> dict[str, float]:
    """Reward function name -> weight, from the saved config's rl.reward ("module:function,...") and
    rl.reward_weights."""
    rl = (config or {}).get("rl") if isinstance(config, dict) else None
    names = str((rl or {}).get("reward") or "").split(",")
    weights = (rl or {}).get("reward_weights") or []
    out = {}
    for i, name in enumerate(n.strip() for n in names):
        if ":" in name:
            w = weights[i] if i < len(weights) and finite(weights[i]) else 1.0
            out[name.rsplit(":", 1)[1]] = float(w)
    return out


def run_facts(run_dir: Path) -> RunFacts:
    config = _read(run_dir / "config.yaml", yaml.safe_load)
    eval_result = _read(run_dir / "eval.json", json.loads)
    return RunFacts(reward_weights(config if isinstance(config, dict) else None),
                    eval_result if isinstance(eval_result, dict) else None)


def metric_rows(path: Path) -> list[dict]:
    """A metrics file's rows that have a step (a torn or hand-edited file may hold other JSON)."""
    rows = read_metrics(path) if path.is_file() else []
    return [r for r in rows if isinstance(r, dict) and finite(r.get("step"))]


def run_rows(run_dir: Path) -> list[dict]:
    return metric_rows(run_dir / "rl" / "metrics.jsonl")


def health_watch(rl, metrics_path: Path, start: int) -> HealthWatch:
    """The live detectors of an RL stage (rl: its RLConfig); a run resumed at iteration `start` reads the rows it
    logged before, so what they already showed is not said again."""
    rows = [r for r in metric_rows(metrics_path) if r["step"] <= start] if start else []
    weights = reward_weights({"rl": {"reward": rl.reward, "reward_weights": rl.reward_weights}})
    return HealthWatch(RunFacts(weights), rows)


def audit_run(run_dir: str | Path) -> tuple[list[Finding], int]:
    """(findings, iterations read) of a run folder."""
    d = run_folder(run_dir)
    rows = run_rows(d)
    return audit(rows, run_facts(d)), len(rows)


def audit_text(run_dir: Path, findings: list[Finding], iterations: int) -> str:
    """What `rlfuse audit` prints: one line per finding, or that none of the detectors fired on how many iterations."""
    if not iterations:
        return f"{run_dir}: no RL iterations logged yet (rl/metrics.jsonl); nothing to audit"
    head = (f"{run_dir}: {len(findings)} of {len(DETECTORS)} detectors fired over {iterations} RL iterations"
            if findings else f"{run_dir}: healthy: none of the {len(DETECTORS)} detectors fired over {iterations} "
            "RL iterations")
    return "\n".join([head, *(f"- {f.line()}" for f in findings)])
