"""What trains: a module with its optimiser and constant LR schedule (Learner), the actor's and the critic's
(Learners), and which of them one optimise() call steps together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlfuse.config import RLConfig
from rlfuse.learn.optim import build_constant_optimizer
from rlfuse.models.build import Models
from rlfuse.models.shared import ACTOR, role_parameters


@dataclass
class Learner:
    """A module that trains, with its optimiser and (constant) LR schedule."""
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    params: list | None = None
    """What it trains when that is not every trainable parameter of `module`: a shared base holds the actor's and
    the critic's adapters in one model."""
    on_step: Callable | None = None
    """Called with the learner after each optimiser step, before the gradients are dropped (the memory meter)."""

    @classmethod
    def constant(cls, module: torch.nn.Module, lr: float, optimizer: str = "adamw",
                 params: list | None = None) -> "Learner":
        return cls(module, *build_constant_optimizer(module, lr, optimizer, params), params)

    def trained(self) -> list:
        return self.params if self.params is not None else [p for p in self.module.parameters() if p.requires_grad]

    def step(self, grad_clip: float) -> torch.Tensor:
        """Clip this learner's own gradient norm (0: no clipping), step, zero; returns the norm before clipping."""
        params = self.trained()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        self.opt.step()
        self.sched.step()
        if self.on_step is not None:
            self.on_step(self)
        self.opt.zero_grad(set_to_none=True)
        return norm.detach()


@dataclass
class Learners:
    actor: Learner
    critic: Learner | None
    """With a value head on the actor (critic_init=actor) this owns only the head; the body is the actor's."""
    shared_body: bool


def build_learners(models: Models, rl: RLConfig) -> Learners:
    """The actor's and the critic's optimisers (rl.optimizer). On a shared base each owns its adapter's tensors."""
    on_actor = models.critic is not None and models.roles["critic"].source == "actor"  # a value head on its body
    critic = None
    if models.critic is not None:
        if on_actor:
            critic = Learner.constant(models.critic.head, rl.critic_lr, rl.optimizer)
        else:
            own = models.critic.trainable_parameters() if models.shared_base is not None else None
            critic = Learner.constant(models.critic, rl.critic_lr, rl.optimizer, own)
    own = role_parameters(models.actor, ACTOR) if models.shared_base is not None else None
    return Learners(Learner.constant(models.actor, rl.lr, rl.optimizer, own), critic, on_actor)


def learner_sets(learners: Learners) -> list[list[Learner]]:
    """The learners each optimise() call of `update` steps together, in update's order: the actor (with the value
    head when it sits on the actor's body), then a separate critic."""
    sets = [[learners.actor] + ([learners.critic] if learners.shared_body else [])]
    return sets + ([[learners.critic]] if learners.critic is not None and not learners.shared_body else [])
