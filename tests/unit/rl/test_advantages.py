"""Advantage estimators (``rl/advantages.py``, ``--advantage-estimator``): REINFORCE's
running baseline over three batches by hand, its checkpoint round trip, GRPO unchanged, and
the flags (``--num-generations 1``, ``--baseline-decay``). Two DP ranks agreeing:
``tests/integration/test_rl_recipe_flags.py``."""

import dataclasses
import io
import re
from pathlib import Path

import pytest
import torch

from loggra_megatron.config import settings_that_do_not_apply
from loggra_megatron.rl.advantages import ADVANTAGE_ESTIMATORS, GroupRelative, RunningBaseline
from loggra_megatron.rl.config import GRPOConfig
from loggra_megatron.rl.losses import group_advantages

REINFORCE = GRPOConfig(advantage_estimator="reinforce-baseline", num_generations=1)
BATCHES = [
    torch.tensor([1.0, 0.0, 0.0, 1.0]),  # mean 0.5
    torch.tensor([1.0, 1.0, 1.0, 0.0]),  # mean 0.75
    torch.tensor([0.0, 0.0, 0.0, 0.0]),  # mean 0
]
# b_0 = 0;  A_k = r − b_{k−1}, then b_k = 0.9·b_{k−1} + 0.1·mean_k
#   k = 1: A = r − 0           b_1 = 0.1·0.5                  = 0.05
#   k = 2: A = r − 0.05        b_2 = 0.9·0.05 + 0.1·0.75      = 0.12
#   k = 3: A = r − 0.12        b_3 = 0.9·0.12 + 0.1·0         = 0.108
BASELINES_USED = [0.0, 0.05, 0.12]
BASELINE_AFTER = 0.108


def _estimator(settings=REINFORCE):
    return ADVANTAGE_ESTIMATORS[settings.advantage_estimator](settings)


def test_the_running_baseline_over_three_batches_by_hand():
    est = _estimator()
    assert isinstance(est, RunningBaseline)
    for rewards, used in zip(BATCHES, BASELINES_USED, strict=True):
        adv = est(rewards)
        assert est.metrics() == {"reward/baseline": pytest.approx(used, abs=1e-15)}
        torch.testing.assert_close(adv, rewards - used, atol=1e-7, rtol=0)
    assert est.baseline == pytest.approx(BASELINE_AFTER, abs=1e-15)
    assert adv.dtype == torch.float32 and adv.shape == (4,)


def test_the_decay_sets_the_memory_of_the_baseline():
    """d = 0.5 over the same batches: b = 0.25, then 0.5·0.25 + 0.5·0.75 = 0.5, 0.25."""
    est = _estimator(dataclasses.replace(REINFORCE, baseline_decay=0.5))
    used = []
    for rewards in BATCHES:
        est(rewards)
        used.append(est.used)
    assert used == [0.0, 0.25, 0.5] and est.baseline == 0.25


def test_the_baseline_round_trips_through_a_checkpoint_and_continues_the_sequence():
    uninterrupted = _estimator()
    for rewards in BATCHES:
        last = uninterrupted(rewards)
    first = _estimator()
    for rewards in BATCHES[:2]:
        first(rewards)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = _estimator()
    resumed.load_state_dict(torch.load(buffer))
    assert torch.equal(resumed(BATCHES[2]), last)
    assert resumed.baseline == uninterrupted.baseline and resumed.used == uninterrupted.used
    switched = _estimator()  # resumed from a grpo run's checkpoint: no baseline yet
    switched.load_state_dict(_estimator(GRPOConfig()).state_dict())
    assert switched.baseline == 0.0


def test_grpo_is_the_group_relative_advantage_and_keeps_no_state():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    for dr in (False, True):
        settings = GRPOConfig(no_advantage_std_normalization=dr)
        est = _estimator(settings)
        assert isinstance(est, GroupRelative)
        expected = group_advantages(rewards, 4, normalize_std=not dr)
        assert torch.equal(est(rewards), expected)
        assert est.metrics() == {} and est.state_dict() == {}


def test_one_generation_is_refused_for_grpo_naming_the_fix_and_taken_for_reinforce():
    with pytest.raises(ValueError) as refused:
        GRPOConfig(num_generations=1)
    message = str(refused.value)
    assert message.startswith("--num-generations=1: must be >= 2 with --advantage-estimator grpo")
    assert "use --advantage-estimator reinforce-baseline" in message
    assert REINFORCE.rollout_batch_size == REINFORCE.prompts_per_step
    with pytest.raises(ValueError, match="--num-generations=0"):
        GRPOConfig(advantage_estimator="reinforce-baseline", num_generations=0)
    with pytest.raises(ValueError, match="--advantage-estimator='ppo': must be one of grpo"):
        GRPOConfig(advantage_estimator="ppo")
    with pytest.raises(ValueError, match=re.escape("--baseline-decay=1.0: must be in [0, 1)")):
        dataclasses.replace(REINFORCE, baseline_decay=1.0)


def test_each_estimators_settings_apply_with_it_only():
    def problems(settings, given):
        return list(settings_that_do_not_apply([GRPOConfig], dataclasses.asdict(settings), given))

    grpo_decay = dataclasses.replace(GRPOConfig(), baseline_decay=0.5)
    (problem,) = problems(grpo_decay, {"baseline_decay"})
    assert "--baseline-decay=0.5: applies with --advantage-estimator reinforce-baseline" in problem
    dr = dataclasses.replace(REINFORCE, no_advantage_std_normalization=True)
    (problem,) = problems(dr, {"no_advantage_std_normalization"})
    assert "applies with --advantage-estimator grpo only" in problem
    assert not problems(dataclasses.replace(REINFORCE, baseline_decay=0.5), {"baseline_decay"})


def test_no_code_compares_an_estimators_name():
    """The estimators are chosen through the registry (their class's attributes), never by
    comparing ``--advantage-estimator`` with a name."""
    root = Path(__file__).resolve().parents[3]
    names = "|".join(re.escape(n) for n in ADVANTAGE_ESTIMATORS)
    compare = re.compile(rf"""[=!]=\s*["']({names})["']|["']({names})["']\s*[=!]=""")
    found = [
        f"{p.relative_to(root)}:{i}"
        for p in [*(root / "loggra_megatron").rglob("*.py"), root / "pretrain_rl.py"]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if compare.search(line)
    ]
    assert not found, found
