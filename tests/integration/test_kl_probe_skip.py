"""Predicted-KL control skipping its probe trial (``rl/kl_probe_skip.py``): the rule alone,
then the controller on real Megatron GPT policies (bf16, 2 CPU ranks)."""

import dataclasses
import io
import math

import pytest
import torch
from test_kl_control_ranks import (
    TOKENS,
    _backward,
    _build,
    _controller,
    _count_forwards,
    _local,
    _params,
)

from loggra_megatron.config import settings_that_do_not_apply
from loggra_megatron.rl.config import KLControlConfig
from loggra_megatron.rl.kl_probe_skip import ProbeSkipRule
from loggra_megatron.testing import run_distributed

pytestmark = pytest.mark.megatron  # the controller tests start Megatron-Core

TARGET = 0.02


def _rule(**state) -> ProbeSkipRule:
    return ProbeSkipRule(skip_below=0.1, max_skips=3, **state)


# ---------------------------------------------------------------- the rule
def test_flags_are_checked_and_max_skips_needs_skipping():
    with pytest.raises(ValueError, match="--kl-probe-skip-below"):
        KLControlConfig(kl_target=0.1, kl_probe_skip_below=1.5)
    with pytest.raises(ValueError, match="--kl-probe-max-skips"):
        KLControlConfig(kl_target=0.1, kl_probe_max_skips=0)
    off = KLControlConfig(kl_target=0.1, kl_probe_skip_below=0.0, kl_probe_max_skips=8)
    problems = list(
        settings_that_do_not_apply(
            [KLControlConfig], dataclasses.asdict(off), {"kl_probe_max_skips"}
        )
    )
    assert len(problems) == 1 and "--kl-probe-max-skips=8" in problems[0]
    on = dataclasses.asdict(KLControlConfig(kl_target=0.1, kl_probe_max_skips=8))
    assert not list(settings_that_do_not_apply([KLControlConfig], on, {"kl_probe_max_skips"}))


def test_skips_far_below_target_and_probes_near_it():
    rule = _rule(anchor_kl=1e-4, anchor_sq_norm=1.0)
    assert rule.bound(1.0, TARGET, basis_refresh=False) == pytest.approx(1e-4)
    assert rule.bound(4.0, TARGET, False) == pytest.approx(4e-4)  # KL grows as ‖Δθ‖²
    assert rule.bound(30.0, TARGET, False) is None  # 3e-3: above 0.1 × target
    assert _rule(anchor_kl=0.019, anchor_sq_norm=1.0).bound(1.0, TARGET, False) is None


def test_never_skips_without_a_measurement_on_a_refresh_or_when_off():
    assert _rule().bound(1.0, TARGET, False) is None  # the first step
    rule = _rule(anchor_kl=1e-4, anchor_sq_norm=1.0)
    assert rule.bound(1.0, TARGET, basis_refresh=True) is None
    assert rule.bound(None, TARGET, False) is None  # the optimizer cannot tell ‖Δθ‖
    assert rule.bound(math.nan, TARGET, False) is None
    assert _rule(anchor_kl=0.0, anchor_sq_norm=0.0).bound(1.0, TARGET, False) is None  # lr 0
    off = ProbeSkipRule(0.0, 3, anchor_kl=1e-4, anchor_sq_norm=1.0)
    assert off.bound(1.0, TARGET, False) is None


def test_a_probe_is_forced_after_max_skips_and_measurements_reanchor():
    rule = _rule(anchor_kl=1e-4, anchor_sq_norm=1.0)
    for _ in range(3):
        assert rule.bound(1.0, TARGET, False) is not None
        rule.update(True, None, 1.0)  # skipped, kl/realized not due: the anchor stays
    assert rule.skips_in_row == 3 and rule.bound(1.0, TARGET, False) is None
    rule.update(False, 2e-4, 2.0)  # probed
    assert rule.skips_in_row == 0 and (rule.anchor_kl, rule.anchor_sq_norm) == (2e-4, 2.0)
    rule.update(True, 0.05, 1.0)  # a skipped step's kl/realized above target: re-anchors
    assert rule.bound(1.0, TARGET, False) is None
    rule.update(False, math.nan, 1.0)  # a non-finite KL: no anchor, probe next
    assert rule.anchor_kl is None and rule.bound(1.0, TARGET, False) is None


def test_the_rule_state_round_trips_and_an_old_checkpoint_probes_first():
    rule = _rule(anchor_kl=1e-4, anchor_sq_norm=2.0, skips_in_row=2)
    buffer = io.BytesIO()
    torch.save(rule.state_dict(), buffer)
    buffer.seek(0)
    resumed = _rule()
    resumed.load_state_dict(torch.load(buffer))
    assert resumed == rule
    old = _rule(anchor_kl=1e-4, anchor_sq_norm=2.0)
    old.load_state_dict({})
    assert old.anchor_kl is None and old.bound(1.0, TARGET, False) is None


# ---------------------------------------------------------------- the controller
def _run(rank, kind, skip_below, steps=5, **cfg):
    """``steps`` controlled steps far below target (1e9); per step its metrics and the
    forwards the controller ran (rows of each), then the weights and the controller."""
    torch.manual_seed(0)
    ddp, opt = _build(kind)
    ctl = _controller(
        ddp,
        opt,
        kl_target=1e9,
        kl_probe_fraction=0.25,
        kl_probe_skip_below=skip_below,
        kl_probe_max_skips=2,
        **cfg,
    )
    forwards = _count_forwards(ctl)
    batch = _local(TOKENS)
    steps_out = []
    for _ in range(steps):
        _backward(ddp, opt, batch)
        forwards.clear()
        update = ctl.step(ctl.begin(batch))
        assert update.committed
        steps_out.append((update.metrics(), list(forwards)))
    return steps_out, _params(ddp), ctl.state_dict()


@pytest.mark.parametrize("kind", ["loggra", "dense"])
def test_skipped_probes_commit_the_full_step_and_still_measure_realized(kind):
    """Far below target: the skipping run commits bitwise the weights of the run that probes
    every step, every rank decides alike, its kl/realized (a forward of the held-out rows
    after the commit) equals the probing run's, and a skipped step forwards the held-out rows
    only.
    LoGRA refreshes its basis every 2 steps here (those steps probe); dense Adam skips at
    most 2 in a row (kl_probe_max_skips)."""
    skipping = run_distributed(_run, 2, kind, 0.1)
    probing = run_distributed(_run, 2, kind, 0.0)
    expected = [0, 1, 0, 1, 0] if kind == "loggra" else [0, 1, 1, 0, 1]
    for (steps, params, state), (steps_off, params_off, _) in zip(skipping, probing, strict=True):
        assert [m["kl/probe_skipped"] for m, _ in steps] == expected
        assert all(m["kl/probe_skipped"] == 0 for m, _ in steps_off)
        for name, w in params.items():
            assert torch.equal(w, params_off[name]), name
        for (m, forwards), (m_off, _) in zip(steps, steps_off, strict=True):
            assert m["kl/step_scale"] == 1.0
            assert m["kl/realized"] == pytest.approx(m_off["kl/realized"], rel=1e-5)
            if m["kl/probe_skipped"]:
                # the held-out rows only: their reference at θ, then at the committed weights
                assert forwards == [1, 1]
                assert 0 < m["kl/predicted"] < 0.1 * 1e9
        assert state["probe_skip"]["anchor_kl"] > 0
    # the same decisions and the same controller state on both ranks
    assert [m["kl/probe_skipped"] for m, _ in skipping[0][0]] == [
        m["kl/probe_skipped"] for m, _ in skipping[1][0]
    ]
    assert skipping[0][2] == skipping[1][2]


def _resumed(rank, steps_before=2, steps_after=3):
    """A controller rebuilt from another's state_dict (as a resume does) decides alike."""
    torch.manual_seed(0)
    ddp, opt = _build("dense")
    cfg = dict(kl_target=1e9, kl_probe_fraction=0.25, kl_probe_max_skips=2)
    ctl = _controller(ddp, opt, **cfg)
    batch = _local(TOKENS)
    skipped = []
    for i in range(steps_before + steps_after):
        if i == steps_before:
            state = ctl.state_dict()
            ctl = _controller(ddp, opt, **cfg)
            ctl.load_state_dict(state)
        _backward(ddp, opt, batch)
        skipped.append(ctl.step(ctl.begin(batch)).metrics()["kl/probe_skipped"])
    return skipped


def test_a_resumed_controller_continues_the_skip_pattern():
    for skipped in run_distributed(_resumed, 2):
        assert skipped == [0, 1, 1, 0, 1]  # without the state the third step would probe


def test_default_realized_interval_checks_skipped_steps_at_a_quarter_of_the_cost():
    """The default ``--kl-realized-interval`` 4: kl/realized on steps 0 and 4 of 6 (key
    absent elsewhere), step 4 a skipped one whose extrapolation it checks; the steps without
    it run no forward at all when they skip the probe."""
    assert KLControlConfig(kl_target=0.1).kl_realized_interval == 4
    (steps, _, _), _ = run_distributed(_run, 2, "dense", 0.1, steps=6, kl_realized_interval=4)
    assert [int("kl/realized" in m) for m, _ in steps] == [1, 0, 0, 0, 1, 0]
    assert [m["kl/probe_skipped"] for m, _ in steps] == [0, 1, 1, 0, 1, 1]
    assert steps[4][0]["kl/realized"] > 0 and steps[4][1] == [1, 1]
    assert steps[5][1] == []  # skipped, not due: the update norm only
