"""The RL stack: group-relative advantages, PPO-clip policy losses (GRPO / Dr.GRPO / DAPO
variants), the KL penalty against a frozen reference model, and its adaptive coefficient."""

from loggra_megatron.rl.losses import (
    AGGREGATIONS,
    AdaptiveKLCoefficient,
    aggregate,
    group_advantages,
    grpo_loss,
    kl_to_reference,
    policy_loss,
    ppo_clip_per_token,
)

__all__ = [
    "AGGREGATIONS",
    "AdaptiveKLCoefficient",
    "aggregate",
    "group_advantages",
    "grpo_loss",
    "kl_to_reference",
    "policy_loss",
    "ppo_clip_per_token",
]
