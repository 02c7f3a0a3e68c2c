"""Roles as data: from the config alone (nothing loaded, no torch), which models an RL run has, which train, where
each comes from, and which must live in one process because they share weights.

The placement checker builds on `Roles.colocated_groups()`: a placement that puts two roles of one group on
different workers splits weights that exist once, and is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfuse.config.algorithms import ALGORITHMS

ROLE_NAMES = ("actor", "generator", "reference", "critic", "reward")


@dataclass(frozen=True)
class Role:
    name: str
    """actor | generator | reference | critic | reward."""
    trainable: bool
    """An optimiser steps it."""
    source: str
    """Where its weights come from: "sft" (the SFT model folder), "rm" (the reward-model folder), "actor" (the
    actor's current weights), or "function:module:name" (a Python reward function: no model at all)."""
    shares_with: str | None = None
    """The role whose weights (and so whose process) this one uses; None when it holds its own."""
    why: str = ""
    """One line for the printed plan."""

    @property
    def has_model(self) -> bool:
        return not self.source.startswith("function:")


@dataclass(frozen=True)
class Roles:
    roles: tuple[Role, ...]

    def __getitem__(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        return any(r.name == name for r in self.roles)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.roles)

    def trainable(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.roles if r.trainable)

    def colocated_groups(self) -> list[frozenset[str]]:
        """Roles that must share a process, one set per group (singletons included), in role order. Sharing is
        transitive: each role joins the group of the role it shares with."""
        root = {r.name: r.name for r in self.roles}

        def find(name: str) -> str:
            while root[name] != name:
                name = root[name]
            return name

        for r in self.roles:
            if r.shares_with is not None:
                root[find(r.name)] = find(r.shares_with)
        groups: dict[str, set[str]] = {}
        for r in self.roles:
            groups.setdefault(find(r.name), set()).add(r.name)
        return [frozenset(g) for g in groups.values()]

    def describe(self) -> str:
        return "\n".join(f"  {r.name:<10} {'trains' if r.trainable else 'frozen':<7} from {r.source:<12}"
                         + (f" shares {r.shares_with}'s weights" if r.shares_with else "") + (f"  ({r.why})" if r.why else "")
                         for r in self.roles)


def derive_roles(cfg) -> Roles:
    """The roles of an RL run on `cfg` (a rlfuse.config.Config), before anything loads.

    - actor: the policy, from the SFT model; trains.
    - generator: the rollout engine's own copy of the policy, a plain causal LM (with LoRA the adapters merged) that
      gets the actor's weights through an explicit sync before each rollout; it can live anywhere (in full
      fine-tuning, in the actor's process, it is the actor itself: runtime/local.decode_engine). With
      model.shared_base it is the shared base itself running the actor's adapter (shares the actor, no sync).
    - reference: with model.lora, the actor with its adapters switched off (no second copy: shares the actor);
      otherwise a frozen copy of the SFT model.
    - critic (where the algorithm has one, config/algorithms.py: ppo): rl.critic_init=actor puts a value head on
      the actor's body (shares the actor); rm and sft load a separate model from that folder.
    - reward: the reward model (frozen, from the rm folder), or a Python function (no model).
    With model.shared_base (cfg.model.shares_base) the base exists once, in the actor's process: the critic and the
    reward model are adapters on it (plus their heads), so both share the actor.
    """
    rl, lora, shared = cfg.rl, cfg.model.lora, cfg.model.shares_base
    roles = [
        Role("actor", True, "sft", why="the policy"),
        Role("generator", False, "actor", "actor" if shared else None,
             "decodes rollouts on the shared base with the actor's adapter" if shared
             else "decodes rollouts; weights synced from the actor each iteration" if lora
             else "decodes rollouts: the actor itself beside it, else weights synced from it each iteration"),
        Role("reference", False, "sft", "actor" if lora else None,
             "the actor with LoRA adapters off" if lora else "a frozen copy of the SFT model"),
    ]
    if ALGORITHMS[rl.algo].critic:
        on_actor = rl.critic_init == "actor"
        why = ("a value head on the actor's body" if on_actor else
               f"its own adapter + value head on the shared base (from {rl.critic_init})" if shared else
               f"value head on the {rl.critic_init} model")
        roles.append(Role("critic", True, rl.critic_init, "actor" if on_actor or shared else None, why))
    if rl.reward == "rm":
        roles.append(Role("reward", False, "rm", "actor" if shared else None,
                          "the reward model's adapter + score head on the shared base" if shared else "the reward model"))
    elif rl.reward == "environment":  # no function: the episodes' environment reward alone (rollout/score.py)
        roles.append(Role("reward", False, "function:", why="the environment's reward"))
    else:
        roles.append(Role("reward", False, f"function:{rl.reward}", why="a Python function of texts"))
    return Roles(tuple(roles))
