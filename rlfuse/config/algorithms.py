"""What each RL algorithm (rl.algo) needs and does, in one table: validation, the roles, the advantages, the KL
penalty, the mini-batches and the logged learning rates read these properties rather than branching on the name."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Algorithm:
    name: str
    critic: bool
    """A value model trains beside the actor (the critic role; rl.critic_init, rl.critic_lr)."""
    min_k: int
    """Samples per prompt it needs (rl.k): the group baselines need at least two."""
    advantage: str
    """The estimator: "gae" (per token, from the critic's values; rl.whiten_advantages over response tokens) or a key
    of rlfuse.algos.advantages.ADVANTAGE_FNS (per sample, from the k samples of its prompt; whitened over samples)."""
    kl_in: str
    """Where the KL penalty to the reference goes: "token_reward" (each token's reward, Ziegler et al.: what GAE
    reads), "sequence_reward" (the sample's reward, Ahmadian et al.) or "loss" (the policy loss, DeepSeekMath)."""
    kl_estimator: str
    """The per-token KL estimator when rl.kl_estimator is null (k1 | k2 | k3)."""
    groups_prompts: bool
    """A prompt's k samples stay together in one mini-batch (its baseline is their mean)."""
    preset: dict = field(default_factory=dict)
    """rl fields this algorithm sets where the config leaves them out (ppo's are the dataclass defaults): rloo and
    grpo sample a group per prompt, and keep a fixed KL coefficient as TRL does, with no adaptive controller."""


PPO_PRESET = {"k": 1, "prompts_per_iter": 32, "kl_coef": 0.2, "kl_target": 4.0}
"""ppo's: the RLConfig defaults, named so that a config switched from another algorithm takes them."""
GROUP_PRESET = {"k": 4, "prompts_per_iter": 8, "kl_target": None}
"""What rloo and grpo share: 4 samples for each of 8 prompts (as many samples an iteration as ppo's 32 prompts), a
fixed KL coefficient. The coefficients (rloo 0.1 in the sequence reward, grpo 0.2 in the loss) keep the default task's
KL to its learned reward model near ppo's target; grpo at TRL's earlier 0.04 ran the KL to 26 nats and its replies
to the length limit (docs/benchmarks/default_run.md)."""

ALGORITHMS = {
    "ppo": Algorithm("ppo", critic=True, min_k=1, advantage="gae", kl_in="token_reward", kl_estimator="k1",
                     groups_prompts=False, preset=PPO_PRESET),
    "rloo": Algorithm("rloo", critic=False, min_k=2, advantage="rloo", kl_in="sequence_reward", kl_estimator="k1",
                      groups_prompts=True, preset=GROUP_PRESET | {"kl_coef": 0.1, "scale_rewards": "none"}),
    "grpo": Algorithm("grpo", critic=False, min_k=2, advantage="grpo", kl_in="loss", kl_estimator="k3",
                      groups_prompts=True, preset=GROUP_PRESET | {"kl_coef": 0.2, "scale_rewards": "group"}),
}
"""rl.algo -> its Algorithm."""

RECIPES = {
    "grpo": {"policy_loss": "ppo", "loss_agg": "seq-mean-token-mean", "clip": 0.2, "clip_high": None,
             "scale_rewards": "group"},
    "dr_grpo": {"policy_loss": "ppo", "loss_agg": "seq-mean-token-sum-norm", "clip": 0.2, "clip_high": None,
                "scale_rewards": "none"},
    "dapo": {"policy_loss": "ppo", "loss_agg": "token-mean", "clip": 0.2, "clip_high": 0.28, "scale_rewards": "group",
             "dynamic_sampling": True},
    "gspo": {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean", "clip": 3e-4, "clip_high": 4e-4,
             "scale_rewards": "group"},
}
"""rl.recipe: the published recipes by the names TRL gives them (its loss_type; gspo: importance_sampling_level=
sequence), each the rl fields it sets where the config leaves them out: the policy loss, its aggregation, the clip
range, the advantage's scale and (dapo) dynamic sampling."""

BEHAVIOUR_WEIGHT_MODES = ("truncate", "mask")
"""How the decoupled objective bounds a stale token's importance weight (rl.behaviour_weight_mode;
rlfuse/algos/offpolicy.py)."""
