"""Checkpoints of RL and of the supervised stages (SFT, reward model): one file written then renamed, so a kill at any
moment leaves the previous checkpoint intact."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from rlfuse.errors import UserError, first_line
from rlfuse.files import atomic_path, weights_digest
from rlfuse.learn.divergence import Blowup, LossWatch, stage_blowup_line
from rlfuse.learn.learners import Learners
from rlfuse.learn.update import BadSteps
from rlfuse.models.build import Models


def trainable_state(module: torch.nn.Module | None, copy: bool = True) -> dict | None:
    """Only what training changes (with LoRA: the adapters), not the frozen base. copy=False: the live tensors, for
    a write that serialises them at once (a checkpoint: a copy would hold the weights twice while it is written)."""
    if module is None:
        return None
    return {n: p.detach().clone() if copy else p.detach() for n, p in module.named_parameters() if p.requires_grad}


def save_checkpoint(path: Path, *, iteration: int, actor, critic, opt_actor, opt_critic, sched_actor, sched_critic,
                    kl_coef: float, counters: dict, shards: str | None = None) -> None:
    """Weights that train, optimiser and LR-scheduler states, the KL coefficient, the bad-step counters and every
    RNG state: what a resumed run needs to repeat an uninterrupted one bit for bit. shards: a sharded run's
    (rl.train_parallel=fsdp) DCP folder beside `path`, holding the weights and optimiser states (actor, critic and
    their optimisers are then None here)."""
    state = {
        "iteration": iteration,
        "actor": trainable_state(actor, copy=False),
        "critic": trainable_state(critic, copy=False),
        "opt_actor": opt_actor.state_dict() if opt_actor is not None else None,
        "opt_critic": opt_critic.state_dict() if opt_critic is not None else None,
        "sched_actor": sched_actor.state_dict(),
        "sched_critic": sched_critic.state_dict() if sched_critic is not None else None,
        "kl_coef": kl_coef,
        "counters": counters,
        "rng": rng_states(),
        "shards": shards,
    }
    keep_previous(path)
    with atomic_path(path) as tmp:
        save_torch(state, tmp)


def previous_of(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def checkpoint_bytes(path: Path) -> int:
    """What a checkpoint holds on disk: its file and every companion beside it (the previous one, a sharded run's
    shard folders, pipeline stage states, batches in flight), a file hard-linked twice counted once."""
    files = [f for f in path.parent.glob(f"{path.name}*") for f in ([f] if f.is_file() else f.rglob("*"))]
    sizes = {(st.st_dev, st.st_ino): st.st_size for st in (f.stat() for f in files if f.is_file())}
    return sum(sizes.values())


def keep_previous(path: Path) -> None:
    """The checkpoint about to be replaced stays as checkpoint.pt.prev (a hard link: no copy, and checkpoint.pt is
    never absent), so a damaged newest one can be stepped back from."""
    if not path.exists():
        return
    prev = previous_of(path)
    staged = prev.with_name(prev.name + ".tmp")
    staged.unlink(missing_ok=True)
    try:
        os.link(path, staged)
    except OSError:  # a file system without hard links
        shutil.copyfile(path, staged)
    os.replace(staged, prev)


class _KeepWriteError:
    """A file whose failed write keeps its OSError: torch.save reports one (a full disk) as a RuntimeError that has
    lost the OS's reason and the path."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        return self.file.flush()


def save_torch(obj, path: Path) -> None:
    """torch.save(obj, path), a failed write raised as the OSError (errno, path) the CLI prints as one line."""
    f = open(path, "wb")
    sink = _KeepWriteError(f)
    try:
        torch.save(obj, sink)
        f.close()  # the last buffered bytes: a full disk may show only here
    except (RuntimeError, OSError) as e:
        error = sink.error or (e if isinstance(e, OSError) else None)
        with contextlib.suppress(OSError):
            f.close()
        if error is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None


def load_checkpoint(path: Path, actor, critic, opt_actor, opt_critic, sched_actor, sched_critic,
                    sharded: bool = False) -> dict:
    """Restore weights, optimiser, LR-scheduler and RNG states in place; returns the rest (iteration, kl_coef,
    counters). sharded: a sharded run's checkpoint, whose weights and optimiser states the caller reads from its DCP
    folder (runtime/fsdp.py load_shards)."""
    state = read_checkpoint(path)
    if bool(state.get("shards")) != sharded:
        held = "sharded (rl.train_parallel=fsdp)" if state.get("shards") else "whole"
        raise UserError(f"{path} holds {held} weights, which this run cannot read; resume with the run's own "
                        "rl.train_parallel, or start a new run")
    configured = {key: [g["lr"] for g in opt.param_groups] for key, opt in (("actor", opt_actor), ("critic", opt_critic))
                  if opt is not None}
    try:
        for module, key in ((actor, "actor"), (critic, "critic")):
            if module is not None and state[key] is not None:
                missing = set(state[key]) - {n for n, _ in module.named_parameters()}
                if missing:
                    raise ValueError(f"it has parameters the model lacks: {sorted(missing)[:3]}")
                module.load_state_dict(state[key], strict=False)
        if state["opt_actor"] is not None:
            opt_actor.load_state_dict(state["opt_actor"])
        if opt_critic is not None and state["opt_critic"] is not None:
            opt_critic.load_state_dict(state["opt_critic"])
        for sched, key in ((sched_actor, "sched_actor"), (sched_critic, "sched_critic")):
            if sched is not None and state.get(key) is not None:  # checkpoints before scheduler state have none
                sched.load_state_dict(state[key])
    except (KeyError, ValueError, RuntimeError) as e:
        raise UserError(f"{path} does not fit this run's models ({first_line(e)}); it belongs to another "
                        "run or model: resume the run it came from, or start a new run") from None
    # a learning rate changed on resume (rl.lr, rl.critic_lr) takes effect: the restored optimiser and schedule
    # would otherwise keep the checkpoint's
    for (opt, sched), key in (((opt_actor, sched_actor), "actor"), ((opt_critic, sched_critic), "critic")):
        if opt is not None:
            keep_learning_rates(opt, sched, configured[key])
    set_rng_states(state["rng"])
    return state


def rng_states() -> dict:
    """Every generator a step may draw from: dropout on a GPU draws from CUDA's."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])


RL_KEYS = frozenset({"iteration", "kl_coef", "counters", "actor", "opt_actor", "rng"})


def read_checkpoint(path: Path, required: frozenset = RL_KEYS) -> dict:
    """The checkpoint's contents; a damaged or foreign file (one without the `required` keys) is one line saying how
    to step back to the previous."""
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")  # load_state_dict moves to each device
        missing = required - set(state)
    except Exception as e:  # torch.load's failures on a damaged file are many (zip, pickle, EOF, unicode)
        state, missing = None, f"{type(e).__name__}: {first_line(e)}"
    if missing:
        prev = previous_of(path)
        back = (f"go back one checkpoint with `mv {prev} {path}`, then --resume again" if prev.exists() else
                "no previous checkpoint is kept: start the run again with --overwrite")
        what = f"it lacks {sorted(missing)}" if isinstance(missing, set) else missing
        raise UserError(f"{path} is not a readable rlfuse checkpoint ({what}); {back}")
    return state


def keep_learning_rates(opt, sched, lrs: list[float]) -> None:
    """Set each parameter group's learning rate (and the constant schedule's base) to lrs."""
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
        if "initial_lr" in group:
            group["initial_lr"] = lr
    if sched is not None:
        sched.base_lrs = list(lrs)
        sched._last_lr = list(lrs)  # what get_last_lr() reports (train/lr)


CHECKPOINT_KEYS = ("actor", "critic", "opt_actor", "opt_critic", "sched_actor", "sched_critic")


def checkpoint_parts(models: Models, learners: Learners) -> tuple:
    """What a checkpoint holds besides counters, in CHECKPOINT_KEYS order."""
    c = learners.critic
    return (models.actor, models.critic, learners.actor.opt, c.opt if c else None, learners.actor.sched,
            c.sched if c else None)


# ------------------------------------------------------------------------------------ SFT and reward-model stages

STAGE_KEYS = frozenset({"step", "model", "opt", "sched", "counters", "rng"})


class StageCheckpoint:
    """STAGE_DIR/checkpoint.pt of a supervised stage (SFT, reward model): the trained weights (with LoRA the adapters
    and the head), optimiser, LR-schedule and RNG states and the bad-step counters after every `every`-th step but
    the last (the model saved next is the result; a full model's checkpoint is three times its size). The optimiser
    batches are a function of (seed, step), so a stage resumed from it repeats an uninterrupted one bit for bit.
    Removed once the stage has saved its model and summary. start_from: the model folder (or hub name) the stage
    started from; the checkpoint keeps its weights_digest and a resume from another (`rlfuse sft --overwrite` between
    a reward model's kill and its resume, say) is refused."""

    def __init__(self, stage_dir: Path, every: int, steps: int, model: torch.nn.Module, opt, sched,
                 start_from: str = "", started: float | None = None):
        self.path, self.every, self.steps = Path(stage_dir) / "checkpoint.pt", every, steps
        self.model, self.opt, self.sched = model, opt, sched
        # the stage's seconds: this process's since `started` (time.perf_counter) plus those the processes before it
        # spent up to the checkpoint it resumed from (steps trained after that checkpoint and lost are not counted)
        self.started = time.perf_counter() if started is None else started
        self.earlier_s = 0.0
        self.start_from = start_from
        self.start_digest = weights_digest(start_from) if start_from else ""

    def restore(self, stage: str, log) -> tuple[int, BadSteps]:
        """(the step to continue after, the bad-step counters) from the checkpoint, its states loaded in place;
        (0, fresh counters) where the stage stopped before its first checkpoint, said in the log."""
        if not self.path.exists():
            log(f"[{stage}] --resume: no checkpoint in {self.path.parent} yet (the stage stopped before its first, "
                f"which comes every {stage}.ckpt_every={self.every} steps): starting at step 0")
            return 0, BadSteps()
        state = read_checkpoint(self.path, STAGE_KEYS)
        if state.get("start_digest", self.start_digest) != self.start_digest:  # older checkpoints have none
            raise UserError(f"{self.path} was trained from another model than {self.start_from} holds now (it was "
                            f"saved again since the checkpoint: `rlfuse sft --overwrite`?); its weights would not fit "
                            f"it: start this stage again with --overwrite")
        try:
            trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
            extra, missing = set(state["model"]) - trained, trained - set(state["model"])
            if extra or missing:
                raise ValueError(f"it has trained parameters the model lacks: {sorted(extra)[:3]}" if extra else
                                 f"it lacks trained parameters of the model: {sorted(missing)[:3]}")
            configured = [g.get("initial_lr", g["lr"]) for g in self.opt.param_groups]
            self.model.load_state_dict(state["model"], strict=False)
            self.opt.load_state_dict(state["opt"])
            self.sched.load_state_dict(state["sched"])
            keep_scheduled_rates(self.opt, self.sched, configured)
        except (KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{self.path} does not fit this run's model ({first_line(e)}); it belongs to another run "
                            f"or model: resume the run it came from, or start a new run") from None
        set_rng_states(state["rng"])
        self.earlier_s = state.get("seconds", 0.0)  # older checkpoints have none
        log(f"[{stage}] resumed from {self.path} at step {state['step']} of {self.steps}")
        return state["step"], BadSteps(**state["counters"])

    def save_if_due(self, step: int, bad: BadSteps, calm: bool = True) -> None:
        """calm: False while the loss is rising (divergence.py LossWatch.calm): the due checkpoint is skipped, so the
        one on disk stays one from before a blow-up."""
        if step % self.every or step == self.steps or not calm:
            return
        state = {"step": step, "model": trainable_state(self.model, copy=False), "opt": self.opt.state_dict(),
                 "sched": self.sched.state_dict(), "counters": dataclasses.asdict(bad), "rng": rng_states(),
                 "start_digest": self.start_digest, "seconds": self.seconds()}
        keep_previous(self.path)
        with atomic_path(self.path) as tmp:
            save_torch(state, tmp)

    def seconds(self) -> float:
        """The stage's seconds so far, across the processes that trained it."""
        return self.earlier_s + time.perf_counter() - self.started

    def remove(self) -> None:
        remove_stage_checkpoint(self.path.parent)

    def blown(self, stage: str, found: Blowup, watch: LossWatch, section) -> UserError:
        """The error that ends a stage whose loss blew up (no model is saved): the newest checkpoint from before the
        blow-up stays as checkpoint.pt (the previous one moved back over a newer one from inside it), the others
        go. section: the stage's config section (its grad_clip names the fix)."""
        kept = self.keep_before(watch)
        where = (f"the model of step {kept} (the last checkpoint before it) is kept in {self.path}" if kept is not None
                 else f"no model saved and no checkpoint from before it (one comes every {stage}.ckpt_every="
                      f"{self.every} steps)")
        resume = f", then `rlfuse {stage} --resume RUN_DIR {stage}.lr=...`" if kept is not None else ""
        fix = f"lower {stage}.lr" + (f" or set {stage}.grad_clip (1.0 is the default)" if section.grad_clip <= 0 else
                                     "") + resume
        return UserError(stage_blowup_line(stage, found, where, fix))

    def keep_before(self, watch: LossWatch) -> int | None:
        """After a blow-up: the step of the newest checkpoint from before it (watch.before_blowup), left as
        checkpoint.pt; the ones from after it are removed. None where no checkpoint is from before it."""
        for p in (self.path, previous_of(self.path)):
            step = checkpoint_step(p)
            if step is not None and watch.before_blowup(step):
                if p != self.path:
                    os.replace(p, self.path)
                return step
            p.unlink(missing_ok=True)
        return None


def checkpoint_step(path: Path) -> int | None:
    """The step a stage checkpoint holds, read without its tensors (mmap); None where there is none, or it is
    unreadable."""
    if not path.is_file():
        return None
    try:
        return int(torch.load(path, mmap=True, weights_only=False, map_location="cpu")["step"])
    except Exception:  # torch.load's failures on a damaged file are many (read_checkpoint)
        return None


def keep_scheduled_rates(opt, sched, lrs: list[float]) -> None:
    """After a stage checkpoint is loaded: the configured learning rates (a resume at a lower sft.lr after a blow-up)
    replace the checkpoint's, at the schedule's point (LambdaLR: lr x its factor at the restored step); unchanged
    rates are left exactly as restored."""
    if [g.get("initial_lr", g["lr"]) for g in opt.param_groups] == lrs:
        return
    sched.base_lrs = list(lrs)
    for i, (group, lr) in enumerate(zip(opt.param_groups, lrs)):
        group["initial_lr"] = lr
        group["lr"] = lr * sched.lr_lambdas[i](sched.last_epoch) if hasattr(sched, "lr_lambdas") else lr
    sched._last_lr = [g["lr"] for g in opt.param_groups]  # what get_last_lr() reports (train/lr)


def remove_stage_checkpoint(stage_dir: Path) -> None:
    """A finished stage's checkpoint and the one before it (a kill between its summary and this leaves them)."""
    path = Path(stage_dir) / "checkpoint.pt"
    for p in (path, previous_of(path)):
        p.unlink(missing_ok=True)
