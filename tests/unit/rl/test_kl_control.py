"""``rl.kl_control``'s update, phase by phase, against a stepper and a KL whose answers are
known: the KL of ``θ + η·Δθ`` is ``η²·K`` (exactly the quadratic model) or anything a test
sets. The real optimizer and model: ``tests/integration/test_kl_control.py``."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from loggra_megatron.rl.config import KLControlConfig
from loggra_megatron.rl.kl_control import PredictedKLController

ROWS, SEQ = 8, 5


class Stepper:
    """The phases of ``MegatronStepper`` that the controller calls, recorded."""

    def __init__(self, ok=True, sq_norm=1.0, trials_are_commits=True):
        self.ok, self.sq_norm, self.trials_are_commits = ok, sq_norm, trials_are_commits
        self.basis_refresh_due = False
        self.commit_syncs_weights = True
        self.eta = 0.0  # the η of the model weights now (0: θ)
        self.calls = []

    def require_separate_model_weights(self):
        pass

    def prepare(self, project=False):
        self.calls.append("prepare")
        return SimpleNamespace(ok=self.ok, grad_norm=1.0 if self.ok else math.nan)

    def update_sq_norm(self):
        return self.sq_norm

    @contextlib.contextmanager
    def try_candidate(self, eta):
        self.calls.append(f"try {eta:.4g}")
        self.eta = eta
        yield SimpleNamespace(ok=True, peak_bytes=7)

    def commit(self, eta):
        self.calls.append(f"commit {eta:.4g}")
        self.eta = eta

    def restore_model_weights(self):
        self.calls.append("restore")
        self.eta = 0.0


class Measure:
    """``ProbeKL``'s interface: the KL of both parts is ``curve(η)`` of the weights now."""

    def __init__(self, stepper, curve):
        self.stepper, self.curve, self.forwards = stepper, curve, []

    def reference(self, batch):
        self.forwards.append(("reference", len(batch[0])))
        return SimpleNamespace(nbytes=100 * len(batch[0]))

    def __call__(self, batch, ref, split=None):
        self.forwards.append(("kl", len(batch[0])))
        kl = self.curve(self.stepper.eta)
        return kl, (kl if split is not None else None)


def controller(curve, target=0.1, **config):
    stepper = Stepper(**config.pop("stepper", {}))
    rl_step = config.pop("rl_step", None)
    cfg = KLControlConfig(kl_target=target, kl_probe_fraction=0.25, **config)
    return PredictedKLController(cfg, stepper, Measure(stepper, curve), rl_step=rl_step)


def batch():
    return torch.zeros(ROWS, SEQ + 1, dtype=torch.long), torch.ones(ROWS, SEQ, dtype=torch.bool)


def test_begin_takes_the_held_out_rows_only_when_realized_is_due():
    ctl = controller(lambda eta: 0.0, kl_realized_interval=2)
    assert len(ctl.begin(*batch()).rows[0]) == 4  # step 0: probe 2 + held-out 2
    ctl.num_steps = 1
    update = ctl.begin(*batch())
    assert (len(update.rows[0]), update.split, update.holdout) == (2, 2, None)
    never = controller(lambda eta: 0.0, kl_realized_interval=0)
    assert len(never.begin(*batch()).rows[0]) == 2


def test_a_step_above_target_is_scaled_by_the_quadratic_model():
    """KL(η) = η²·K with K = 10 × target: η = sqrt(1/10), the trial at η confirms it (no
    backtrack), the commit is at η and kl/realized is the last trial's (folded)."""
    ctl = controller(lambda eta: 1.0 * eta**2, target=0.1, kl_realized_interval=1)
    update = ctl.step(ctl.begin(*batch()))
    m = update.metrics()
    assert m["kl/step_scale"] == pytest.approx(math.sqrt(0.1))
    assert m["kl/predicted"] == pytest.approx(1.0)
    assert m["kl/predicted_committed"] == pytest.approx(0.1)
    assert m["kl/realized"] == pytest.approx(0.1) and m["kl/backtracks"] == 0
    assert ctl.stepper.calls == ["prepare", "try 1", "try 0.3162", "commit 0.3162"]
    # one reference forward of the probe and held-out rows together, then a KL per trial
    assert ctl.measure.forwards == [("reference", 4), ("kl", 4), ("kl", 4)]
    assert m["memory/kl_control_bytes"] == 400 + 7 and ctl.num_steps == 1


def test_a_kl_steeper_than_predicted_backtracks_at_most_the_limit():
    """KL(η) = η·K (steeper than η² near 0): η halves while the KL exceeds 1.5 × target."""
    ctl = controller(lambda eta: 1.0 * eta, target=0.01, kl_max_backtracks=2)
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/backtracks"] == 2 and m["kl/step_scale"] == pytest.approx(0.1 / 4)
    assert m["kl/predicted_committed"] == pytest.approx(0.025)  # still above: the limit


def test_below_target_the_full_step_is_committed_and_a_dense_step_checks_after():
    """η = 1; trials that are not commits (dense Adam): kl/realized by a forward of the
    held-out rows after the commit, against their own reference."""
    ctl = controller(lambda eta: 0.01 * eta**2, stepper={"trials_are_commits": False})
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/step_scale"] == 1.0 and m["kl/realized"] == pytest.approx(0.01)
    assert ctl.stepper.calls == ["prepare", "try 1", "commit 1"]
    assert ctl.measure.forwards == [("reference", 2), ("reference", 2), ("kl", 2), ("kl", 2)]


def test_a_non_finite_kl_restores_the_weights_and_commits_nothing():
    ctl = controller(lambda eta: math.nan)
    update = ctl.step(ctl.begin(*batch()))
    assert not update.committed and update.metrics()["kl/step_scale"] == 0.0
    assert ctl.stepper.calls == ["prepare", "try 1", "restore"] and ctl.num_steps == 0
    assert ctl.skip_rule.anchor_kl is None  # nothing trustworthy measured: probe next


def test_a_failed_gradient_preparation_stops_before_any_phase():
    ctl = controller(lambda eta: 0.0, stepper={"ok": False})
    update = ctl.step(ctl.begin(*batch()))
    assert update.metrics() == {"kl/step_scale": 0.0, "kl/target": 0.1, "time/kl_control_s": 0.0}
    assert ctl.stepper.calls == ["prepare"] and ctl.measure.forwards == []


def test_far_below_target_the_probe_is_skipped_and_realized_re_anchors():
    """After a probed step (the anchor), a step of the same norm extrapolates to the same
    tiny KL: the full step is committed with no trial, and its held-out rows alone are
    measured (reference at θ, then at the committed weights)."""
    ctl = controller(lambda eta: 1e-4 * eta**2, target=0.1, kl_realized_interval=1)
    ctl.step(ctl.begin(*batch()))
    ctl.stepper.calls.clear()
    ctl.measure.forwards.clear()
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/probe_skipped"] == 1.0 and m["kl/predicted"] == pytest.approx(1e-4)
    assert ctl.stepper.calls == ["prepare", "commit 1"]
    assert ctl.measure.forwards == [("reference", 2), ("kl", 2)]
    assert m["kl/realized"] == pytest.approx(1e-4)
    assert ctl.skip_rule.anchor_kl == pytest.approx(1e-4)


# ---------------------------------------------------------------- growing a step (α_max > 1)
def test_a_step_far_below_target_grows_to_the_largest_scale():
    """KL(η) = η²·K with K = target / 100: η = min(3, sqrt(100)) = 3, tried on the probe
    (KL 9·K = 0.09·target) and committed; with the default α_max = 1 the same step is
    committed at η = 1 with no trial but the probe."""
    ctl = controller(lambda eta: 1e-3 * eta**2, target=0.1, kl_max_step_scale=3.0)
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/step_scale"] == 3.0 and m["kl/backtracks"] == 0
    assert m["kl/predicted"] == pytest.approx(1e-3)
    assert m["kl/predicted_committed"] == pytest.approx(9e-3)
    assert ctl.stepper.calls == ["prepare", "try 1", "try 3", "commit 3"]
    plain = controller(lambda eta: 1e-3 * eta**2, target=0.1)
    assert plain.step(plain.begin(*batch())).metrics()["kl/step_scale"] == 1.0
    assert plain.stepper.calls == ["prepare", "try 1", "commit 1"]


def test_a_step_near_target_grows_to_the_quadratic_models_scale():
    """KL̂ = target / 4 < target but above target / α_max²: η = sqrt(4) = 2, whose trial
    lands on the target; a step above target still shrinks as with α_max = 1."""
    ctl = controller(lambda eta: 0.025 * eta**2, target=0.1, kl_max_step_scale=3.0)
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/step_scale"] == pytest.approx(2.0)
    assert m["kl/predicted_committed"] == pytest.approx(0.1)
    above = controller(lambda eta: 0.4 * eta**2, target=0.1, kl_max_step_scale=3.0)
    assert above.step(above.begin(*batch())).metrics()["kl/step_scale"] == pytest.approx(0.5)


def test_a_grown_step_whose_kl_is_steeper_backtracks_by_halving():
    """KL(η) = K·η⁴ (steeper than the quadratic model beyond η = 1). K = target / 100:
    η = 3 gives 81·K = 0.81 × target, within 1.5 × target: kept. K = target / 20:
    η = min(3, sqrt(20)) = 3 gives 81/20 = 4.05 × target > 1.5 × target, halved to 1.5
    (5.06/20 = 0.25 × target): one backtrack."""
    kept = controller(lambda eta: 1e-3 * eta**4, target=0.1, kl_max_step_scale=3.0)
    m = kept.step(kept.begin(*batch())).metrics()
    assert m["kl/step_scale"] == 3.0 and m["kl/backtracks"] == 0
    assert m["kl/predicted_committed"] == pytest.approx(0.081)
    ctl = controller(lambda eta: 5e-3 * eta**4, target=0.1, kl_max_step_scale=3.0)
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/step_scale"] == 1.5 and m["kl/backtracks"] == 1
    assert m["kl/predicted_committed"] == pytest.approx(5e-3 * 1.5**4)
    assert ctl.stepper.calls == ["prepare", "try 1", "try 3", "try 1.5", "commit 1.5"]


def test_with_growth_the_probe_is_skipped_only_if_the_largest_step_stays_far_below():
    """The anchor (KL̂ = 1e-4 of a full step, target 0.1, skip below 0.1 × target = 0.01):
    with α_max = 3 the largest step extrapolates to 9e-4 < 0.01, so the next step commits
    η = 3 with no trial, and its kl/realized (at 3·Δθ, 9e-4) re-anchors with the committed
    update's norm 9·‖Δθ‖²; at K = 2e-3 (18e-3 at η = 3) the probe runs."""
    ctl = controller(
        lambda eta: 1e-4 * eta**2, target=0.1, kl_max_step_scale=3.0, kl_realized_interval=1
    )
    ctl.step(ctl.begin(*batch()))  # probed: η = 3 (and the anchor is the full step's KL̂)
    assert (ctl.skip_rule.anchor_kl, ctl.skip_rule.anchor_sq_norm) == (pytest.approx(1e-4), 1.0)
    ctl.stepper.calls.clear()
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/probe_skipped"] == 1.0 and m["kl/step_scale"] == 3.0
    assert m["kl/predicted"] == pytest.approx(1e-4)
    assert m["kl/predicted_committed"] == pytest.approx(9e-4)
    assert ctl.stepper.calls == ["prepare", "commit 3"]
    assert m["kl/realized"] == pytest.approx(9e-4)
    assert ctl.skip_rule.anchor_kl == pytest.approx(9e-4)
    assert ctl.skip_rule.anchor_sq_norm == 9.0  # KL/‖update‖² is the full step's again
    near = controller(
        lambda eta: 2e-3 * eta**2, target=0.1, kl_max_step_scale=3.0, kl_realized_interval=1
    )
    near.step(near.begin(*batch()))
    near.stepper.calls.clear()
    m = near.step(near.begin(*batch())).metrics()
    assert m["kl/probe_skipped"] == 0.0 and near.stepper.calls[:2] == ["prepare", "try 1"]
    # with α_max = 1 the same anchor is far enough below: the full step skips
    plain = controller(lambda eta: 2e-3 * eta**2, target=0.1, kl_realized_interval=1)
    plain.step(plain.begin(*batch()))
    assert plain.step(plain.begin(*batch())).metrics()["kl/probe_skipped"] == 1.0


def test_the_max_step_scale_flag_is_checked_and_applies_with_the_target_only():
    import dataclasses

    from loggra_megatron.config import settings_that_do_not_apply

    with pytest.raises(ValueError, match="--kl-max-step-scale"):
        KLControlConfig(kl_target=0.1, kl_max_step_scale=0.5)
    off = dataclasses.asdict(KLControlConfig(kl_max_step_scale=3.0))
    problems = list(settings_that_do_not_apply([KLControlConfig], off, {"kl_max_step_scale"}))
    assert len(problems) == 1 and "--kl-max-step-scale=3.0: applies with --kl-target" in problems[0]


# ---------------------------------------------------------------- the target's schedule
def test_the_target_follows_the_rl_step_and_scales_eta():
    """target 2e-4 → 2e-5 over N = 300 RL steps; at RL step 150 the target is the mean
    1.1e-4, and a full step of KL̂ = 4.4e-4 is scaled to η = sqrt(1.1e-4 / 4.4e-4) = 0.5;
    past N the target is the final one (η = sqrt(2e-5 / 4.4e-4))."""
    step = {"now": 150}
    ctl = controller(
        lambda eta: 4.4e-4 * eta**2,
        target=2e-4,
        kl_target_final=2e-5,
        kl_target_decay_iters=300,
        rl_step=lambda: step["now"],
    )
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/target"] == pytest.approx(1.1e-4, rel=1e-12)
    assert m["kl/step_scale"] == pytest.approx(0.5)
    step["now"] = 305
    m = ctl.step(ctl.begin(*batch())).metrics()
    assert m["kl/target"] == 2e-5
    assert m["kl/step_scale"] == pytest.approx(math.sqrt(2e-5 / 4.4e-4))


def test_a_scheduled_target_needs_the_rl_step():
    with pytest.raises(ValueError, match="RL step"):
        controller(lambda eta: 0.0, target=0.1, kl_target_final=0.01, kl_target_decay_iters=5)
