"""What a resumed run may change: settings that only say how long to train, how fast, what to log and how often to
evaluate or checkpoint are applied from the resumed iteration on; every other one (the algorithm, k, the model,
the data, the critic, the placement) would make the continued run a different run than its checkpoint's, so a
change to it is refused with the list. The changes taken are appended to config.yaml as comments naming the
iteration they took effect."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from rlfuse.config.load import config_to_dict
from rlfuse.config.sections import Config
from rlfuse.errors import UserError
from rlfuse.files import write_text_atomic

CHANGEABLE = {
    # where and how it runs and logs, not what it computes
    "run": {"dir", "quiet", "threads", "cpu_heap", "memory_table", "report_to"},
    "rl": {"iterations", "lr", "critic_lr", "ckpt_every", "eval_every", "log_samples_every", "max_bad_steps"},
    # a stage stopped for a loss that blew up resumes from its last good checkpoint at a gentler rate
    "sft": {"ckpt_every", "eval_every", "eval_samples", "max_bad_steps", "lr", "grad_clip", "warmup_steps"},
    "rm": {"ckpt_every", "eval_every", "max_bad_steps", "lr", "grad_clip", "warmup_steps"},
    # rollout settings change where and when samples are decoded and scored, never the samples (tested equal); the
    # generator copy's dtype does change them (bf16 rounding: another behaviour policy)
    "rollout": {f.name for f in dataclasses.fields(Config().rollout)} - {"generator_dtype"},
}
RESOLVED_FROM_AUTO = {("run", "precision"), ("rollout", "generator_dtype")}
"""Settings a run saved as auto and resolve.py now resolves before the run: a run saved before that resumes with the
value resolved (noted), where that is what its auto computed in."""


def _resolved_as_it_ran(saved: dict, value) -> bool:
    """A run saved with auto computed so in one process; its Ray workers computed in fp32 whatever the hardware."""
    return (saved.get("placement") or {}).get("strategy") in ("single", "auto") or value == "fp32"
NOTE = "# resumed at"


def resume_changes(saved: Config, new: Config, free: set[str] = frozenset()) -> list[tuple[str, object, object]]:
    """(field, saved value, new value) for each setting of `new` that differs from the run's `saved` one and may
    change on resume: CHANGEABLE's, and any of the sections in `free` (those whose stage has made nothing yet, e.g.
    rl before its first checkpoint). Raises UserError listing those that may not."""
    old, now = config_to_dict(saved), config_to_dict(new)
    changed, refused = [], []
    for section, fields in now.items():
        for name, value in fields.items():
            if old.get(section, {}).get(name) == value or (section, name) == ("run", "dir"):
                continue
            entry = (f"{section}.{name}", old.get(section, {}).get(name), value)
            resolved = (section, name) in RESOLVED_FROM_AUTO and entry[1] == "auto" and _resolved_as_it_ran(old, value)
            (changed if resolved or name in CHANGEABLE.get(section, ()) or section in free else refused).append(entry)
    if refused and all(a == "auto" and tuple(f.split(".")) in RESOLVED_FROM_AUTO for f, a, _ in refused):
        raise UserError("resume: this run was saved with run.precision and rollout.generator_dtype auto, which its "
                        "Ray workers ran in fp32, and auto resolves to bf16 here now; resume with run.precision=fp32 "
                        "rollout.generator_dtype=fp32 to go on as it ran")
    if refused:
        listed = ", ".join(f"{field} {a!r} -> {b!r}" for field, a, b in refused)
        raise UserError(f"resume: {listed}: cannot change in a resumed run (its checkpoint was trained with the "
                        f"saved values); drop the change, or start a new run (a new run.dir, or --overwrite). Changeable "
                        f"on resume: rl.iterations, rl.lr, rl.critic_lr, logging, evaluation and checkpoint intervals, "
                        f"rollout.*; and any setting of a stage that has made nothing yet (no checkpoint)")
    return changed


def record_resume_changes(cfg: Config, run_dir: str | os.PathLike, changes: list, at: str) -> None:
    """config.yaml becomes `cfg`, with the notes of earlier resumes kept and one line for this one's changes, made
    `at` ("iteration 3", "sft step 40")."""
    path = Path(run_dir) / "config.yaml"
    notes = [line for line in path.read_text().splitlines() if line.startswith(NOTE)] if path.exists() else []
    notes.append(f"{NOTE} {at}: " + ", ".join(f"{field} {a!r} -> {b!r}" for field, a, b in changes))
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    write_text_atomic(path, text + "\n".join(notes) + "\n")
