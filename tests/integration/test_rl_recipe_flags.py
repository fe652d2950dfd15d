"""The published LoGRA RL recipe end to end, from its documented config
(``examples/paper_recipe/loggra_rl.yaml``: the backward sketch with RowAdam's relative ε and
norm restoration, the update ratio, frozen non-targets, no clipping): REINFORCE with a running baseline and one
response per prompt (``--advantage-estimator reinforce-baseline --num-generations 1``),
predicted-KL control that may grow a step (``--kl-max-step-scale 3``) toward a cosine target
(``--kl-target-final``, ``--kl-target-decay-iters``), with ``--tis-cap 2``; at DP = 2, and
save → resume against the uninterrupted run. The pieces alone: ``tests/unit/rl/``."""

import math
import os

import pytest
import torch
from rl_runs import ROOT, tiny_argv, torchrun

from loggra_megatron.metrics import read_metrics
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # also run on the newest megatron-core in CI

REWARDS = [  # 3 RL steps × 8 rewards, exact in binary: sums and means are exact
    [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5],
    [0.0, 0.0, 0.25, 0.0, 1.0, 1.0, 1.0, 0.5],
    [0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
]


def _baseline(rank, dp):
    """This rank's half (DP = 2: rank r holds rewards ``[4r, 4r + 4)``) of each step through
    ``RunningBaseline`` over Megatron's DP group; the baselines used and the advantages."""
    from megatron.core import parallel_state as ps

    from loggra_megatron.rl.advantages import RunningBaseline
    from loggra_megatron.rl.config import GRPOConfig

    settings = GRPOConfig(advantage_estimator="reinforce-baseline", num_generations=1)
    est = RunningBaseline(settings, ps.get_data_parallel_group(), "cpu")
    share = 8 // dp
    used, advantages = [], []
    for rewards in REWARDS:
        advantages.append(est(torch.tensor(rewards[rank * share : (rank + 1) * share])))
        used.append(est.used)
    return used, torch.cat(advantages), est.state_dict()


def test_two_dp_ranks_hold_the_baseline_of_the_whole_batch():
    """Rank means 0.4375 / 0.5625 (step 1): each rank subtracts the global batch's running
    baseline, the same as one rank holding all 8 rewards, bit for bit."""
    (alone,) = run_distributed(_baseline, 1, 1)
    ranks = run_distributed(_baseline, 2, 2)
    means = [sum(r) / 8 for r in REWARDS]  # 0.5, 0.46875, 0.25
    b1 = 0.1 * means[0]
    b2 = 0.9 * b1 + 0.1 * means[1]
    assert alone[0] == pytest.approx([0.0, b1, b2], abs=1e-15)
    assert alone[2]["baseline"] == pytest.approx(0.9 * b2 + 0.1 * means[2], abs=1e-15)
    for used, _, state in ranks:
        assert used == alone[0] and state == alone[2]
    per_step = [
        torch.cat([ranks[0][1][4 * k : 4 * k + 4], ranks[1][1][4 * k : 4 * k + 4]])
        for k in range(3)
    ]
    assert torch.equal(torch.cat(per_step), alone[1])


PAPER_RECIPE = os.path.join(ROOT, "examples", "paper_recipe", "loggra_rl.yaml")
RECIPE = {
    "config": PAPER_RECIPE,  # the documented recipe; the flags below override it
    "loggra-sketch": "backward",
    "bf16": True,
    "train-iters": 4,
    "prompts-per-step": 8,
    "num-generations": 1,
    "global-batch-size": 4,  # 2 optimizer updates per RL step
    "kl-target": 0.5,
    "kl-target-final": 0.05,
    "kl-target-decay-iters": 2,
}


def _target(s: int) -> float:
    return 0.05 + (0.5 - 0.05) * (1 + math.cos(math.pi * min(s, 2) / 2)) / 2


def test_the_recipe_trains_follows_its_schedules_and_resumes_exactly(tokenizer, tmp_path):
    """Every RL step's ``kl/target`` is the cosine at its 0-based step, ``reward/baseline``
    the running mean of the earlier steps' ``reward/mean`` (0.9/0.1, from 0), some updates
    are grown (η > 1, never above 3), and a run saved at step 2 and resumed logs every
    metric of steps 3–4 as the uninterrupted run does."""
    full = tmp_path / "full"
    torchrun(tiny_argv(tokenizer, **RECIPE, save=full))
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    baseline = 0.0
    for s, row in enumerate(rows):
        assert row["kl/target"] == pytest.approx(_target(s), rel=1e-12)
        assert row["reward/baseline"] == pytest.approx(baseline, rel=1e-6, abs=1e-12)
        baseline = 0.9 * baseline + 0.1 * row["reward/mean"]
        assert 0 < row["kl/step_scale"] <= 3.0
    assert rows[0]["kl/target"] == 0.5 and rows[3]["kl/target"] == 0.05
    assert any(r["kl/step_scale"] > 1.0 for r in rows)  # grown steps were committed
    for row in rows:  # the recipe's optimizer: the update ratio's rate, no clipping
        assert row["loggra/step_size"] > 0 and row["grad/clipped"] == 0.0
        assert row["memory/optimizer_state_bytes"] > 0
    part = tmp_path / "part"
    torchrun(tiny_argv(tokenizer, **{**RECIPE, "train-iters": 2}, save=part))
    torchrun(tiny_argv(tokenizer, **RECIPE, save=part, load=part))
    volatile = ("time/", "throughput/", "memory/peak")
    for a, b in zip(rows, read_metrics(part), strict=True):
        for key in a:
            if not key.startswith(volatile):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
