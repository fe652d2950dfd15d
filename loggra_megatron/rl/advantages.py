"""Advantage estimators, registered by name (``--advantage-estimator``): one scalar per
completion from the rewards of an RL step::

    grpo                A_i = (r_i − mean_g(r)) / (std_g(r) + eps)  over the prompt's group g
                        (Dr.GRPO, --no-advantage-std-normalization: A_i = r_i − mean_g(r))
    reinforce-baseline  A_i = r_i − b,  then  b ← d·b + (1 − d)·mean(r)   (d: --baseline-decay)

``reinforce-baseline`` is REINFORCE with a running baseline: step ``k``'s advantages use the
baseline of the steps before it (``b_{k−1}``, 0 on the first step), and only then is the
step's mean reward, over the whole batch of every data-parallel rank (one all-reduce of two
floats), folded in. Every rank thus holds the same ``b``; it is checkpointed
(``state_dict``), so a resumed run continues the sequence of an uninterrupted one.

Adding an estimator: a subclass of ``AdvantageEstimator`` (``__call__``, and ``metrics``,
``state_dict``, ``load_state_dict`` when it keeps state) and one line in
``ADVANTAGE_ESTIMATORS``; ``settings`` names the ``GRPOConfig`` fields it reads (their flags
apply with it only). Formulas and sources: docs/losses.md#advantages
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loggra_megatron.rl.losses import group_advantages


class AdvantageEstimator:
    """Rewards ``[B]`` of this rank's rollouts (prompt-major: the ``G`` completions of a
    prompt are consecutive) → advantages ``[B]``. Stateless unless a subclass says so."""

    min_generations: int = 1
    """The fewest ``--num-generations`` it works with."""
    why_min_generations: str = ""
    """Why it needs ``min_generations`` (for the error message)."""
    settings: tuple[str, ...] = ()
    """The ``GRPOConfig`` fields it reads besides ``num_generations``."""

    def __init__(
        self,
        settings,  # the GRPOConfig (rl.config imports this module)
        dp_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ):
        self.group_size = settings.num_generations
        self.dp_group, self.device = dp_group, device

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Keys of ``metric_keys`` about the last call (reduced as declared there)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class GroupRelative(AdvantageEstimator):
    """GRPO (Shao et al. 2024) or, without the std, Dr.GRPO (Liu et al. 2025): each
    completion against the other completions of its prompt (``rl.losses.group_advantages``)."""

    min_generations = 2
    why_min_generations = "it compares the completions of a prompt"
    settings = ("no_advantage_std_normalization",)

    def __init__(self, settings, dp_group=None, device="cpu"):
        super().__init__(settings, dp_group, device)
        self.normalize_std = not settings.no_advantage_std_normalization

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        return group_advantages(rewards, self.group_size, normalize_std=self.normalize_std)


class RunningBaseline(AdvantageEstimator):
    """REINFORCE with a running baseline (Williams 1992): ``A_i = r_i − b_{k−1}``, then
    ``b_k = d·b_{k−1} + (1 − d)·mean(r)``, the mean over the global batch (all DP ranks).
    ``b_0 = 0``. One completion per prompt is enough."""

    settings = ("baseline_decay",)

    def __init__(self, settings, dp_group=None, device="cpu"):
        super().__init__(settings, dp_group, device)
        self.decay = settings.baseline_decay
        self.baseline = 0.0
        """``b``: what the next call subtracts (float64 on the host, the same on every rank)."""
        self.used = 0.0
        """The baseline the last call subtracted (``reward/baseline``)."""

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        mean = self.global_mean(rewards)
        self.used = self.baseline
        advantages = rewards.float() - self.used  # the baseline before this batch
        self.baseline = self.decay * self.baseline + (1.0 - self.decay) * mean
        return advantages

    def global_mean(self, rewards: torch.Tensor) -> float:
        """The mean reward of the batch over every DP rank: ``[Σ r, count]`` all-reduced in
        float64 (on ``device``: NCCL takes no host tensors)."""
        local = [float(rewards.double().sum()), float(rewards.numel())]
        totals = torch.tensor(local, dtype=torch.float64, device=self.device)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(totals, group=self.dp_group)
        total, count = totals.tolist()
        return total / count

    def metrics(self) -> dict[str, float]:
        return {"reward/baseline": self.used}

    def state_dict(self) -> dict:
        return {"baseline": self.baseline}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint of another estimator (no baseline) starts from 0."""
        self.baseline = float(state.get("baseline", 0.0))


ADVANTAGE_ESTIMATORS: dict[str, type[AdvantageEstimator]] = {
    "grpo": GroupRelative,
    "reinforce-baseline": RunningBaseline,
}
"""``--advantage-estimator`` choices, by name."""
