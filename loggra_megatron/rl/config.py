"""Settings of the RL algorithm: group sampling, advantages, the GRPO/PPO update and the
reference model (``GRPOConfig``) and predicted-KL step control (``KLControlConfig``); the
policy loss has its own (``PolicyLossConfig``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loggra_megatron.config import applies, at_least, check_fields, one_of, positive, reject
from loggra_megatron.model.vocab_parallel import ESTIMATORS
from loggra_megatron.rl.advantages import ADVANTAGE_ESTIMATORS


def _reference_model(s: dict) -> bool:
    return s["kl_coef"] > 0


def _kl_control(s: dict) -> bool:
    return s["kl_target"] is not None


def _probe_skipping(s: dict) -> bool:
    return _kl_control(s) and s["kl_probe_skip_below"] > 0


def _target_schedule(s: dict) -> bool:
    return _kl_control(s) and s["kl_target_final"] is not None


def _estimator_reads(setting: str) -> tuple[str, object]:
    """``applies``'s words and condition for a ``GRPOConfig`` field that the advantage
    estimators listing it in their ``settings`` read (and no other)."""
    names = [n for n, e in ADVANTAGE_ESTIMATORS.items() if setting in e.settings]
    return (
        f"with --advantage-estimator {' or '.join(names)}",
        lambda s: setting in ADVANTAGE_ESTIMATORS[s["advantage_estimator"]].settings,
    )


@dataclass
class GRPOConfig:
    """Group sampling, PPO epochs, advantages and the KL penalty's coefficient β."""

    prompts_per_step: int = 4
    """Prompts per RL step, over all data-parallel ranks."""
    num_generations: int = 4
    """Completions sampled per prompt (the GRPO group size; 1 is enough for
    ``--advantage-estimator reinforce-baseline``)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    advantage_estimator: str = "grpo"
    """grpo: each completion against its prompt's group, (r − mean) / (std + eps);
    reinforce-baseline: REINFORCE with a running baseline, r − b with b the running mean
    reward of the earlier RL steps (``--baseline-decay``), one completion per prompt allowed
    (docs/losses.md#advantages)."""
    no_advantage_std_normalization: bool = applies(
        False, *_estimator_reads("no_advantage_std_normalization")
    )
    """Dr.GRPO advantages: subtract the group mean only."""
    baseline_decay: float = applies(0.9, *_estimator_reads("baseline_decay"))
    """d of the running baseline, updated after each RL step's advantages:
    b ← d·b + (1 − d)·(the step's mean reward over all data-parallel ranks); b starts at 0."""
    kl_coef: float = 0.0
    """β of the KL-to-reference loss (0: no reference model)."""
    kl_ref_target: float | None = applies(None, "with --kl-coef > 0", _reference_model)
    """Adaptive β (Ziegler et al. 2019): the KL to the reference model (``kl/ref``) that β
    steers toward. Not ``--kl-target``, predicted-KL step control's per-update target."""
    kl_coef_horizon: float = applies(
        10000.0, "with --kl-ref-target", lambda s: s["kl_ref_target"] is not None
    )
    """Adaptive β horizon, in samples."""
    reference_offload: bool = applies(False, "with --kl-coef > 0", _reference_model)
    """Keep the reference model's weights in host memory (pinned on CUDA) and stream them to
    the device one unit at a time (the embedding, each transformer layer, the final norm and
    output layer) during its forward passes, the next unit copied while one computes
    (``model/offload.py``): the reference holds at most two units of device memory instead
    of all its weights, for one host-to-device copy of all of them per forward micro-batch."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("prompts_per_step", positive, ">= 1"),
                ("num_generations", positive, ">= 1"),
                ("ppo_epochs", positive, ">= 1"),
                (
                    "advantage_estimator",
                    one_of(*ADVANTAGE_ESTIMATORS),
                    f"one of {', '.join(ADVANTAGE_ESTIMATORS)}",
                ),
                ("baseline_decay", lambda d: 0 <= d < 1, "in [0, 1)"),
                ("kl_coef", at_least(0), ">= 0 (0: no reference model)"),
                ("kl_ref_target", positive, "> 0"),
                ("kl_coef_horizon", positive, "> 0"),
            ],
        )
        self._check_group_size()

    def _check_group_size(self) -> None:
        """``--num-generations`` against what the advantage estimator needs, naming the
        estimators that take that many."""
        name, n = self.advantage_estimator, self.num_generations
        needs = ADVANTAGE_ESTIMATORS[name]
        if n >= needs.min_generations:
            return
        able = [k for k, e in ADVANTAGE_ESTIMATORS.items() if e.min_generations <= n]
        fix = f"; or use --advantage-estimator {' or '.join(able)}" if able else ""
        reject(
            "num_generations",
            n,
            f"must be >= {needs.min_generations} with --advantage-estimator {name} "
            f"({needs.why_min_generations}){fix}",
        )

    @property
    def rollout_batch_size(self) -> int:
        """Sequences per RL step over all data-parallel ranks."""
        return self.prompts_per_step * self.num_generations


@dataclass
class KLControlConfig:
    """Settings of predicted-KL step control (``--kl-*`` flags)."""

    kl_target: float | None = None
    """Target KL(π_θ ‖ π_new) per probe token of each optimizer step (the first RL step's
    with ``--kl-target-final``); None turns it off."""
    kl_target_final: float | None = applies(None, "with --kl-target", _kl_control)
    """A cosine schedule of the target over the RL steps: from ``--kl-target`` at the
    first RL step to this at ``--kl-target-decay-iters`` and after,
    ``final + (kl_target − final)·(1 + cos(π·min(s, N)/N))/2`` at RL step s (0-based;
    docs/kl_control.md#the-target-schedule). None: the target stays ``--kl-target``."""
    kl_target_decay_iters: int | None = applies(None, "with --kl-target-final", _target_schedule)
    """N, the RL steps over which the target goes from ``--kl-target`` to
    ``--kl-target-final``; None: ``--train-iters``."""
    kl_max_step_scale: float = applies(1.0, "with --kl-target", _kl_control)
    """α_max, the largest step scale η = min(α_max, sqrt(target / KL̂)). 1: a step is only
    ever shrunk; above 1 a step whose predicted KL is below the target is grown, up to
    α_max times, tried on the probe (and halved while its KL exceeds the tolerance) before
    it is committed (docs/kl_control.md#growing-a-step)."""
    kl_probe_fraction: float = applies(0.125, "with --kl-target", _kl_control)
    """Fraction of each step's sequences used as probe (at least one sequence)."""
    kl_estimator: str = applies("full", "with --kl-target", _kl_control)
    """``full`` (exact, over the vocabulary) or ``k1`` / ``k2`` / ``k3`` (sampled tokens)."""
    kl_max_backtracks: int = applies(2, "with --kl-target", _kl_control)
    """TRPO-style safeguard: how many times η may be halved after the quadratic model."""
    kl_backtrack_tolerance: float = applies(1.5, "with --kl-target", _kl_control)
    """Halve η while the probe KL of the scaled step exceeds this × ``kl_target``."""
    kl_realized_interval: int = applies(4, "with --kl-target", _kl_control)
    """Measure ``kl/realized`` on held-out sequences every N optimizer steps (0: never; 1:
    every step). The default 4 keeps the control under 5 % of an RL step
    (docs/benchmarks.md) and, next to the probe cycle of at most 5 steps, lands mostly on
    steps that skipped the probe, whose extrapolation it checks."""
    kl_probe_skip_below: float = applies(0.1, "with --kl-target", _kl_control)
    """Skip the probe trial and commit the largest step (η = ``--kl-max-step-scale``, 1 by
    default) when the quadratic model's extrapolation of the last measured KL to that step,
    ``α_max²·KL·‖Δθ‖²/‖Δθ_then‖²``, is below this × the target
    (docs/kl_control.md#skipping-the-probe); 0: probe every step."""
    kl_probe_max_skips: int = applies(4, "with --kl-probe-skip-below > 0", _probe_skipping)
    """At most this many consecutive steps skip the probe; the next one probes."""
    kl_backup_offload: bool = applies(False, "with --kl-target", _kl_control)
    """Keep the copy of the weights a trial overwrites (this rank's shards of the bf16
    weights whose masters are kept as remainders, ``--loggra-param-remainders``: 2 bytes per
    master element) in pinned host memory instead of on the GPU: one device-to-host copy per
    optimizer step that tries a candidate, one host-to-device copy per trial
    (``optim/megatron/trial_backup.py``, docs/kl_control.md#the-weight-backup)."""

    def __post_init__(self):
        check_fields(
            self,
            [
                ("kl_target", positive, "a positive number (omit it to disable)"),
                ("kl_target_final", positive, "a positive number (omit it: a constant target)"),
                ("kl_target_decay_iters", positive, ">= 1 RL step"),
                ("kl_max_step_scale", at_least(1), ">= 1 (1: steps are never grown; 3 is typical)"),
                ("kl_probe_fraction", lambda f: 0 < f <= 0.5, "in (0, 0.5]"),
                ("kl_estimator", one_of(*ESTIMATORS), f"one of {', '.join(ESTIMATORS)}"),
                ("kl_max_backtracks", at_least(0), ">= 0"),
                ("kl_backtrack_tolerance", at_least(1), ">= 1"),
                ("kl_realized_interval", at_least(0), ">= 0 (0: never)"),
                ("kl_probe_skip_below", lambda f: 0 <= f <= 1, "in [0, 1] (0: never skip)"),
                ("kl_probe_max_skips", positive, ">= 1"),
            ],
        )

    @property
    def enabled(self) -> bool:
        return self.kl_target is not None

    def probe_split(self, num_sequences: int) -> tuple[slice, slice]:
        """``(probe, held-out)`` index ranges of a step's ``num_sequences`` sequences."""
        k = min(num_sequences, max(1, math.ceil(self.kl_probe_fraction * num_sequences)))
        return slice(0, k), slice(k, min(num_sequences, 2 * k))
