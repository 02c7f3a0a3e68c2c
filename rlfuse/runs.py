"""Run folders: one per run, holding the resolved config, per-stage outputs and metrics; what the CLI and the Python
API both do around the trainers (the folder, the RL results and report, stage models named by hub id)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

from rlfuse.config import Config, is_hub_id
from rlfuse.errors import UserError, first_line
from rlfuse.files import remove_path, write_text_atomic

# what each command writes into a run folder, and so what starting it again there would replace
STAGE_OUTPUTS = {"sft": ("sft",), "rm": ("rm",), "rl": ("rl", "eval.json", "report.html", "figures")}
STAGE_OUTPUTS["run"] = STAGE_OUTPUTS["sft"] + STAGE_OUTPUTS["rm"] + STAGE_OUTPUTS["rl"]
LOCK_NAME = "run.lock"

@contextlib.contextmanager
def claim_run_folder(folder: str | os.PathLike | None, command: str, *, resume: bool = False, overwrite: bool = False,
                     log: Callable = print) -> Iterator[Path]:
    """The run folder of `command` (`folder`, else a new runs/<command>-<timestamp>), locked for the block: a second
    run into it is refused while this one lives (a lock left by a killed run is taken over, and said). A folder
    holding what `command` would write (a finished or partly finished run) is refused unless `resume` continues it or
    `overwrite` allows replacing it (clear_previous removes it, once the new config is known to be good)."""
    path = Path(folder) if folder else _new_run_path(command)
    made = not os.path.exists(path) or (not folder and not any(path.iterdir()))  # never raises, as pathlib may
    _make_folder(path)
    lock = RunLock.acquire(path, log)
    try:
        if resume:
            if not (path / "config.yaml").is_file():
                raise UserError(f"resume: {path} is not a run folder (no config.yaml); give the folder a run printed")
        elif not overwrite:
            _refuse_previous(path, command)
    except BaseException:  # refused: what is there stays as it is
        if made:  # still holding the lock: no second run can have written into it meanwhile
            _remove_if_unused(path, log)
        lock.release()
        raise
    try:
        log(f"[{command}] run folder: {path}")
        yield path
    except BaseException:
        _remove_unused_stages(path, command, log)
        if made:
            _remove_if_unused(path, log)
        raise
    finally:
        lock.release()


KEPT_ON_FAILURE_ONLY_IF_MORE = {LOCK_NAME, "config.yaml"}
"""What a run writes before its first stage does: a folder holding nothing more is not worth keeping."""


def _remove_if_unused(path: Path, log: Callable) -> None:
    """A folder this run made and that its failure left holding nothing of use (its lock, its config, empty
    folders) goes, so the same command can run again without --overwrite and runs/ keeps no empty husks."""
    try:
        entries = list(path.iterdir())
        if any(e.name not in KEPT_ON_FAILURE_ONLY_IF_MORE and _has_content(e) for e in entries):
            return
        remove_path(path)
    except OSError:
        return
    log(f"[run] removed {path}: the run stopped before writing anything into it")


STAGE_FOLDERS = ("sft", "rm", "rl")
KEPT_IN_A_STAGE = ("model", "adapter", "summary.json", "eval.json", "samples_after.json")
"""What makes a stage folder worth keeping after a failure, besides its checkpoints (checkpoint.pt and the files and
folders beside it named checkpoint*) and metrics rows (a *.jsonl file in it with a line): a model, a summary."""


def stage_holds_results(stage_dir: Path) -> bool:
    """Whether a stage folder holds something a user or a resumed run can use: a checkpoint, a saved model or
    adapter, a summary, metrics rows. What a stage writes while it starts (its evaluation before training, the
    layout it chose, the predicted memory, empty metrics files) is not."""
    try:
        for e in stage_dir.iterdir():
            if e.name.startswith("checkpoint") or (e.name in KEPT_IN_A_STAGE and _has_content(e)):
                return True
            if e.suffix == ".jsonl" and e.is_file():
                with e.open(errors="replace") as f:
                    if any(line.strip() for line in f):
                        return True
    except OSError:
        return True  # what cannot be read is not removed
    return False


def _remove_unused_stages(path: Path, command: str, log: Callable) -> None:
    """The stage folders of `command` that its failure left holding nothing of use (stage_holds_results) go, so the
    same command can run again without --overwrite (or --resume, which would have nothing to continue from)."""
    for name in STAGE_OUTPUTS[command]:
        stage = path / name
        if name not in STAGE_FOLDERS or not stage.is_dir() or stage_holds_results(stage):
            continue
        try:
            remove_path(stage)
        except OSError:
            continue
        log(f"[run] removed {stage}: the {name} stage stopped before writing anything of use into it")


def _new_run_path(command: str) -> Path:
    """runs/<command>-<timestamp>, created here (two runs started in the same second get a folder each)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path("runs").mkdir(exist_ok=True)
    for i in range(1000):
        path = Path("runs") / (f"{command}-{stamp}" + (f"-{i}" if i else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"could not find a free folder runs/{command}-{stamp}-N; set run.dir")


def _make_folder(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise UserError(f"run.dir {path}: is a file, not a folder; choose a folder (new or a run's) for run.dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"run.dir {path}: cannot write there ({e.strerror}); choose a folder you can write to for "
                        "run.dir") from None


def _previous_outputs(path: Path, command: str) -> list[str]:
    """What an earlier run wrote into `path` that `command` would write again."""
    return [name for name in STAGE_OUTPUTS[command] if _has_content(path / name)]


def _refuse_previous(path: Path, command: str) -> None:
    present = _previous_outputs(path, command)
    if not present:
        return
    stages = [s for s in ("sft", "rm", "rl") if s in present] or ["rl"]  # eval.json etc. alone: an RL stage's
    done = {s: (path / s / "summary.json").is_file() for s in stages}
    what = ", ".join(f"{s} {'finished' if done[s] else 'unfinished'}" for s in stages)
    last = "rl" if command in ("run", "rl") else command  # the stage whose finish ends the command
    fixes = [f"continue it with `rlfuse {command} --resume {path}`"] if not done.get(last, False) else []
    fixes += ["choose a new run.dir", "pass --overwrite (API: overwrite=True) to replace it"]
    raise UserError(f"run.dir {path} already holds an earlier run ({what}) that this {command} would overwrite; "
                    f"{', or '.join(fixes)}")


def clear_previous(path: Path, command: str, log: Callable) -> None:
    """--overwrite: remove what an earlier run wrote into `path` for `command` (called once the new run's config
    has been checked, so a config mistake never costs the old run)."""
    present = _previous_outputs(path, command)
    for name in present:
        remove_path(path / name)
    if present:
        log(f"[run] --overwrite: removed {', '.join(present)} of the previous run in {path}")


def _has_content(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


class RunLock:
    """An exclusive lock (flock) on RUN_DIR/run.lock for a run's life, the file naming its holder. The kernel drops
    it when the holder dies however it dies, so a lock file no process holds is a killed run's, and taken over."""

    def __init__(self, fd: int | None, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, folder: Path, log: Callable) -> "RunLock":
        path = folder / LOCK_NAME
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise UserError(f"run.dir {folder}: cannot create its lock file ({e.strerror}); choose a folder you "
                                "can write to for run.dir") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe_holder(_read_holder(fd))
                os.close(fd)
                raise UserError(f"run.dir {folder} is in use by another run ({holder}); wait for it to end, stop it, "
                                "or choose another run.dir") from None
            except OSError as e:  # a file system without locks (some NFS, Lustre): run, unprotected, and say so
                os.close(fd)
                log(f"[run] warning: {folder} cannot be locked ({e.strerror}); nothing stops a second run into it")
                return cls(None, path)
            # the holder before us may have removed the file between our open and our lock: lock the one in place
            if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        previous = _read_holder(fd)
        if previous and previous.get("pid") != os.getpid():
            log(f"[run] {folder}: took over the lock of a run that is no longer running "
                f"({_describe_holder(previous)})")
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine, 0)
        except OSError as e:  # a full disk: the lock is ours, only its note of who holds it is missing
            log(f"[run] warning: could not write who holds {path} ({e.strerror})")
        return cls(fd, path)

    def release(self) -> None:
        """Idempotent: a failed run releases once its folder is cleared, and again as the block ends."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _describe_holder(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def stage_summary(run_dir: Path, stage: str) -> dict | None:
    """A finished stage's summary.json (None when the stage has not finished)."""
    path = Path(run_dir) / stage / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def stage_started(run_dir: Path, stage: str) -> bool:
    """Whether `stage` has made something a resumed run continues from: a checkpoint, or its finished summary."""
    return any((Path(run_dir) / stage / name).exists() for name in ("checkpoint.pt", "summary.json"))


def write_rl_results(run_dir: Path, result: dict) -> Path:
    """eval.json (before/after, in rl/ and the run folder), samples_after.json, rl/summary.json (time, prompt budget
    and how many prompts were cut to it), and the report; returns its path."""
    # torch and matplotlib: only when a run has finished (the API and `rlfuse --help` import this module)
    from rlfuse.evaluation import EVAL_SAMPLES_KEPT
    from rlfuse.metrics.report import write_report

    evals = json.dumps({"before": result["before"], "after": result["after"]}, indent=2)
    write_text_atomic(run_dir / "rl" / "eval.json", evals)
    write_text_atomic(run_dir / "eval.json", evals)
    write_text_atomic(run_dir / "rl" / "samples_after.json", json.dumps(result["samples_after"][:EVAL_SAMPLES_KEPT],
                                                                        indent=1))
    summary = {"seconds": result["seconds"], **result["prompts"], "model_dir": str(run_dir / "rl" / "model")}
    write_text_atomic(run_dir / "rl" / "summary.json", json.dumps(summary, indent=2))
    return write_report(run_dir)


# ------------------------------------------------------------------------------- stage models by hub id

# what a model needs to load (weights, configs, tokenizer, chat template), not every file of the repository
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download  # only for a stage model named by hub id

    return snapshot_download(repo_id, allow_patterns=allow_patterns)


def hub_model_folder(name: str, field: str) -> str:
    """The local folder of hub model `name` (the hub cache, downloading what is missing; offline, the cache alone):
    what transformers' from_pretrained resolves, as one folder, since the RL stage loads several roles from it and
    saves its adapter on it. Repositories with only pytorch_model.bin get those too."""
    try:
        folder = _snapshot_download(name, HUB_FILES)
        if not any(Path(folder).glob("*.safetensors")):
            folder = _snapshot_download(name, HUB_FILES + ["*.bin"])
    except Exception as e:  # the hub's errors are many; the message and the fix are the same
        first = first_line(e)
        raise UserError(f"config error: {field}: could not fetch hub model {name!r} ({type(e).__name__}: {first}); "
                        f"check the name, or download it where there is network, or set {field} to a local folder") from None
    if not (Path(folder) / "config.json").is_file() and not (Path(folder) / "adapter_config.json").is_file():
        raise UserError(f"config error: {field}: hub repository {name!r} has no config.json, so it is not a model; "
                        f"set {field} to a model's hub id or folder")
    return str(folder)


STAGE_PATHS = (("rl", "sft_path"), ("rl", "rm_path"), ("rm", "sft_path"))
"""The fields that name a stage's starting model, which take hub ids as well as folders."""


def with_local_stage_paths(cfg: Config) -> Config:
    """cfg with rl.sft_path, rl.rm_path and rm.sft_path given as hub ids replaced by their local folders. Done after
    the run folder saved the config, so config.yaml keeps the hub ids."""
    for section, name in STAGE_PATHS:
        part = getattr(cfg, section)
        if (value := getattr(part, name)) and is_hub_id(value):
            local = hub_model_folder(value, f"{section}.{name}")
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{name: local})})
    return cfg
