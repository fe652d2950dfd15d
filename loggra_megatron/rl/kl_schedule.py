"""The per-update KL target of predicted-KL step control over the RL steps
(``--kl-target``, ``--kl-target-final``, ``--kl-target-decay-iters``)::

    target(s) = final + (initial − final) · (1 + cos(π · min(s, N) / N)) / 2

``s`` the RL step (0-based: the RL steps done before the update's), ``N`` the decay
iterations: ``initial`` at s = 0, the mean of both at s = N/2, ``final`` from s = N on. It
is a function of the RL step alone, which the trainer checkpoints, so a resumed run has the
target of an uninterrupted one. Without ``--kl-target-final`` the target is constant.
docs/kl_control.md#the-target-schedule
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loggra_megatron.rl.config import KLControlConfig


@dataclass(frozen=True)
class KLTargetSchedule:
    """``schedule(s)``: the KL target of the updates of RL step ``s``."""

    initial: float
    """``--kl-target``."""
    final: float | None = None
    """``--kl-target-final`` (None: constant)."""
    decay_iters: int = 1
    """N, RL steps from ``initial`` to ``final``."""

    @classmethod
    def of(cls, config: KLControlConfig, train_iters: int | None = None) -> KLTargetSchedule:
        """The schedule of the ``--kl-*`` settings; ``--kl-target-decay-iters`` unset
        decays over ``train_iters`` (``--train-iters``)."""
        if config.kl_target_final is None:
            return cls(config.kl_target)
        decay = config.kl_target_decay_iters or train_iters
        if not decay or decay < 1:
            raise ValueError(
                "--kl-target-final needs --kl-target-decay-iters (or --train-iters) >= 1"
            )
        return cls(config.kl_target, config.kl_target_final, decay)

    @property
    def constant(self) -> bool:
        return self.final is None

    def __call__(self, rl_step: int) -> float:
        if self.final is None:
            return self.initial
        w = (
            1.0 + math.cos(math.pi * min(max(rl_step, 0), self.decay_iters) / self.decay_iters)
        ) / 2
        return self.initial * w + self.final * (1.0 - w)  # exactly initial at 0, final at N
