"""One optimizer step per mini-batch, with skipped steps counted and the LR schedule kept
in step (Megatron-LM's ``train_step``: the scheduler advances only on a successful update).

``OptimizerStep`` takes the step through predicted-KL control when it is on, else
through ``MegatronStepper``; ``SkipCounter``
counts skipped steps (a checkpointed component) and stops the run after
``--max-consecutive-skipped-steps`` in a row, on every rank alike (the grad norm and the
predicted KL are global).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from loggra_megatron.rl.kl_control import KLUpdate, PredictedKLController
from loggra_megatron.train.memory_phases import PHASE_PEAKS

if TYPE_CHECKING:  # imports Megatron
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from loggra_megatron.optim.megatron.stepper import MegatronStepper


class TrainingStopped(RuntimeError):
    """The run cannot continue (raised on every rank alike); nothing was corrupted."""


class SkipCounter:
    """Skipped optimizer steps: in total, and in a row."""

    def __init__(self, limit: int):
        self.limit = limit
        """Stop after this many in a row (0: never)."""
        self.total = 0
        self.consecutive = 0

    def count(self, ok: bool, grad_norm: float | None, where: str) -> None:
        if ok:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.limit and self.consecutive >= self.limit:
            raise TrainingStopped(
                f"{self.consecutive} consecutive optimizer steps were skipped (non-finite "
                f"gradient norm or predicted KL; last grad norm {grad_norm}) {where}. Weights, "
                "optimizer state and checkpoints are unchanged since the last good step. Lower "
                "--lr, check --kl-coef and the reward, or raise --max-consecutive-skipped-steps."
            )

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.consecutive = state["total"], state["consecutive"]


class OptimizerStep:
    """``step(mini_batch) -> metrics``: the step of one mini-batch (see module docstring).
    ``where()`` says where the run is, for the stop message."""

    def __init__(
        self,
        *,
        stepper: MegatronStepper,
        kl_controller: PredictedKLController | None,
        scheduler: OptimizerParamScheduler,
        skips: SkipCounter,
        where: Callable[[], str],
    ):
        self.stepper, self.kl_controller = stepper, kl_controller
        self.scheduler, self.skips, self.where = scheduler, skips, where

    def begin(self, mini: dict[str, torch.Tensor]) -> KLUpdate | None:
        """Under predicted-KL control, the record of this mini-batch's update (before its
        training forward, which may then keep the probe's reference:
        ``KLUpdate.keep_reference``); else None."""
        if self.kl_controller is None:
            return None
        return self.kl_controller.begin(mini["tokens"], mini["mask"])

    def __call__(
        self, mini: dict[str, torch.Tensor], update: KLUpdate | None = None
    ) -> dict[str, float]:
        lr = self.scheduler.optimizer.param_groups[0]["lr"]  # the rate this step uses
        if self.kl_controller is None:
            prepared = self.stepper.step()
            ok, grad_norm, metrics = prepared.ok, prepared.grad_norm, {}
        else:
            update = update or self.begin(mini)
            with PHASE_PEAKS.phase("kl_control"):
                self.kl_controller.step(update)
            ok, grad_norm, metrics = update.committed, update.prepared.grad_norm, update.metrics()
        self.skips.count(ok, grad_norm, self.where())
        if ok:
            self.scheduler.step(1)
        metrics.update(self.stepper.step_metrics())
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        metrics["optimizer/skipped_steps"] = 0.0 if ok else 1.0
        metrics["lr"] = lr
        if grad_norm is not None:
            metrics["grad/norm"] = float(grad_norm)
            metrics["grad/clipped"] = float(self.stepper.clips(float(grad_norm)))
        return metrics
