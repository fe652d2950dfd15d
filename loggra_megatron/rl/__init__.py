"""The RL stack: group-relative advantages, the per-token PPO-clip and KL math, the policy
loss object (GRPO / Dr.GRPO / DAPO variants, ``.policy_loss``), the KL penalty against a
frozen reference model, and its adaptive coefficient."""

from loggra_megatron.rl.losses import (
    AGGREGATIONS,
    AdaptiveKLCoefficient,
    aggregate,
    group_advantages,
    kl_to_reference,
    ppo_clip_per_token,
)

__all__ = [
    "AGGREGATIONS",
    "AdaptiveKLCoefficient",
    "aggregate",
    "group_advantages",
    "kl_to_reference",
    "ppo_clip_per_token",
]
