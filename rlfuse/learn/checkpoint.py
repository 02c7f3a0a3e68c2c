"""RL checkpoints: one file written then renamed, so a kill at any moment leaves the previous checkpoint intact."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch

from rlfuse.files import atomic_path
from rlfuse.learn.learners import Learners
from rlfuse.models.build import Models


def trainable_state(module: torch.nn.Module | None) -> dict | None:
    """Only what training changes (with LoRA: the adapters), not the frozen base."""
    if module is None:
        return None
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def save_checkpoint(path: Path, *, iteration: int, actor, critic, opt_actor, opt_critic, sched_actor, sched_critic,
                    kl_coef: float, counters: dict) -> None:
    """Weights that train, optimiser and LR-scheduler states, the KL coefficient, the bad-step counters and every
    RNG state: what a resumed run needs to repeat an uninterrupted one bit for bit."""
    state = {
        "iteration": iteration,
        "actor": trainable_state(actor),
        "critic": trainable_state(critic),
        "opt_actor": opt_actor.state_dict(),
        "opt_critic": opt_critic.state_dict() if opt_critic is not None else None,
        "sched_actor": sched_actor.state_dict(),
        "sched_critic": sched_critic.state_dict() if sched_critic is not None else None,
        "kl_coef": kl_coef,
        "counters": counters,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    with atomic_path(path) as tmp:
        save_torch(state, tmp)


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


def load_checkpoint(path: Path, actor, critic, opt_actor, opt_critic, sched_actor, sched_critic) -> dict:
    """Restore weights, optimiser, LR-scheduler and RNG states in place; returns the rest (iteration, kl_coef,
    counters)."""
    state = torch.load(path, weights_only=False, map_location="cpu")  # load_state_dict copies to each tensor's device
    for module, key in ((actor, "actor"), (critic, "critic")):
        if module is not None and state[key] is not None:
            missing = set(state[key]) - {n for n, _ in module.named_parameters()}
            assert not missing, f"checkpoint has parameters the model lacks: {sorted(missing)[:3]}"
            module.load_state_dict(state[key], strict=False)
    opt_actor.load_state_dict(state["opt_actor"])
    if opt_critic is not None and state["opt_critic"] is not None:
        opt_critic.load_state_dict(state["opt_critic"])
    for sched, key in ((sched_actor, "sched_actor"), (sched_critic, "sched_critic")):
        if sched is not None and state.get(key) is not None:  # checkpoints before scheduler state have none
            sched.load_state_dict(state[key])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state


CHECKPOINT_KEYS = ("actor", "critic", "opt_actor", "opt_critic", "sched_actor", "sched_critic")


def checkpoint_parts(models: Models, learners: Learners) -> tuple:
    """What a checkpoint holds besides counters, in CHECKPOINT_KEYS order."""
    c = learners.critic
    return (models.actor, models.critic, learners.actor.opt, c.opt if c else None, learners.actor.sched,
            c.sched if c else None)
