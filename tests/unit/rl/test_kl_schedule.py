"""The KL target's cosine schedule over the RL steps (``rl/kl_schedule.py``) against the
formula by hand, its flags, and a controller rebuilt at a later RL step (a resume)."""

import math

import pytest

from loggra_megatron.rl.config import KLControlConfig
from loggra_megatron.rl.kl_schedule import KLTargetSchedule

PAPER = KLControlConfig(kl_target=2e-4, kl_target_final=2e-5, kl_target_decay_iters=300)


def test_the_cosine_target_at_the_start_the_middle_the_end_and_after():
    """target(s) = 2e-5 + 1.8e-4·(1 + cos(π·min(s, 300)/300))/2."""
    target = KLTargetSchedule.of(PAPER)
    assert target(0) == 2e-4  # exactly the initial target
    assert target(150) == pytest.approx(1.1e-4, rel=1e-12)  # the mean of both
    assert target(300) == 2e-5 and target(305) == 2e-5  # exactly the final one, and after
    by_hand = 2e-5 + 1.8e-4 * (1 + math.cos(math.pi * 75 / 300)) / 2  # 0.8536 of the way up
    assert target(75) == pytest.approx(by_hand, rel=1e-12)
    assert target(75) == pytest.approx(2e-5 + 1.8e-4 * 0.8535533905932737, rel=1e-12)
    values = [target(s) for s in range(0, 301, 10)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))  # strictly decaying


def test_without_a_final_target_it_is_constant_and_decay_defaults_to_train_iters():
    constant = KLTargetSchedule.of(KLControlConfig(kl_target=0.05))
    assert constant.constant and {constant(s) for s in (0, 7, 10**6)} == {0.05}
    unset = KLControlConfig(kl_target=2e-4, kl_target_final=2e-5)
    assert KLTargetSchedule.of(unset, train_iters=10)(5) == pytest.approx(1.1e-4, rel=1e-12)
    with pytest.raises(ValueError, match="--kl-target-decay-iters"):
        KLTargetSchedule.of(unset)


def test_the_schedule_flags_are_checked():
    with pytest.raises(ValueError, match="--kl-target-final"):
        KLControlConfig(kl_target=0.1, kl_target_final=0.0)
    with pytest.raises(ValueError, match="--kl-target-decay-iters"):
        KLControlConfig(kl_target=0.1, kl_target_final=0.01, kl_target_decay_iters=0)


def test_a_controller_resumed_at_a_later_rl_step_has_the_uninterrupted_target():
    """The target is read off the trainer's RL step (checkpointed), so a controller built
    anew at step 120, as on a resume, has the target of the run that never stopped."""
    from test_kl_control import batch, controller

    steps = {"now": 0}
    kwargs = dict(
        target=2e-4,
        kl_target_final=2e-5,
        kl_target_decay_iters=300,
        rl_step=lambda: steps["now"],
    )
    running = controller(lambda eta: 0.0, **kwargs)
    targets = []
    for steps["now"] in range(0, 121, 40):
        targets.append(running.begin(*batch()).target)
    resumed = controller(lambda eta: 0.0, **kwargs)
    resumed.load_state_dict(running.state_dict())
    assert resumed.begin(*batch()).target == targets[-1] == KLTargetSchedule.of(PAPER)(120)
    assert targets[0] == 2e-4 and targets == sorted(targets, reverse=True)
