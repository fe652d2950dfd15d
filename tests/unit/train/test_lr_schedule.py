"""The learning-rate schedule the flags build (``train.build.lr_scheduler``: Megatron's
``OptimizerParamScheduler`` over the plan's updates) against the formulas of
docs/optimizer.md: a linear warm-up from 0 over ``--lr-warmup-iters`` updates, then constant,
linear or cosine decay to ``--min-lr`` at the last update, and ``--lr`` throughout without
warm-up or decay."""

from __future__ import annotations

import math

import pytest
import torch
from memory_plans import plan_of

pytestmark = pytest.mark.megatron  # the scheduler is Megatron-Core's: both lines run this

# 32 rollouts per RL step in updates of 8: 4 updates per RL step, 5 RL steps
RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
RUN += ["--seq-length", "64", "--max-new-tokens", "16", "--train-iters", "5", "--lr", "0.01"]
RUN += ["--prompts-per-step", "8", "--num-generations", "4", "--global-batch-size", "8"]


def _rates(*flags: str) -> list[float]:
    """The rate each of the run's updates uses (Megatron steps the scheduler after each)."""
    from loggra_megatron.train import build

    cfg, plan = plan_of([*RUN, *flags], world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = build.lr_scheduler(cfg, plan, optimizer)
    rates = []
    for _ in range(plan.updates_per_rl_step * cfg.training.train_iters):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return rates


def _expected(style: str, warmup: int, n: int = 20, lr=0.01, min_lr=0.001) -> list[float]:
    out = []
    for step in range(n):
        if warmup and step <= warmup:
            out.append(lr * step / warmup)
            continue
        ratio = (step - warmup) / (n - warmup)
        coeff = {"linear": 1 - ratio, "cosine": 0.5 * (math.cos(math.pi * ratio) + 1)}[style]
        out.append(min_lr + coeff * (lr - min_lr))
    return out


@pytest.mark.parametrize("style", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 4])
def test_warmup_then_decay_to_min_lr_over_the_runs_updates(style, warmup):
    flags = ["--lr-decay-style", style, "--min-lr", "0.001", "--lr-warmup-iters", str(warmup)]
    rates = _rates(*flags)
    assert rates == pytest.approx(_expected(style, warmup), abs=1e-12)
    assert rates[-1] > 0.001  # the last update's rate is one update short of --min-lr


def test_constant_rate_after_the_warmup():
    assert _rates() == pytest.approx([0.01] * 20, abs=1e-12)
    ramp = [0.01 * s / 3 for s in range(4)] + [0.01] * 16
    assert _rates("--lr-warmup-iters", "3") == pytest.approx(ramp, abs=1e-12)
