"""Predicted-KL step control: measure the policy change of an update before applying it.

After the gradients are ready, the controller writes the inner optimizer's candidate
``θ + Δθ`` into the 16-bit model weights only (masters and optimizer state untouched),
estimates ``KL̂ = E_tokens KL(π_θ ‖ π_{θ+Δθ})`` on probe rows, predicts
``KL(η·Δθ) ≈ η²·KL̂`` and commits ``θ + η·Δθ`` with ``η = min(α_max, sqrt(target / KL̂))``
(ACKTR, Wu et al. 2017; TRPO, Schulman et al. 2015; ``α_max`` is ``--kl-max-step-scale``,
1 by default), halving η while the scaled candidate's probe KL exceeds the tolerance. With
``η = 1`` the commit is Megatron's step, bit for bit. The target may follow a cosine
schedule over the RL steps (``rl.kl_schedule``).

One update, as ``PredictedKLController.step`` runs it; a ``KLUpdate`` records each phase:

    begin      the update's rows: the probe rows, and the held-out rows when kl/realized
               is due; the training forward may keep their π_θ (KLUpdate.keep_reference)
    gradients  Megatron's prepare_grads and clipping (LoGRA also projects); a non-finite
               norm skips the update here
    skip?      far below target the probe could only confirm η = α_max (rl.kl_probe_skip)
    reference  π_θ of the rows the KL is measured on: kept, or one forward here
    probe      KL̂ of the full step θ + Δθ, tried on the model weights only
    scale      η from the quadratic model (grown up to α_max), then TRPO's backtracking
    commit     Megatron's step with lr·η (a non-finite KL restores θ and skips instead)
    realized   kl/realized on the held-out rows at the committed weights: the last
               trial's forward when trials are commits (LoGRA's), else a forward after

Every optimizer phase goes through ``MegatronStepper``, every KL through
``rl.kl_probe.ProbeKL``. Communication: per probe forward, the TP reductions of
``model.vocab_parallel`` and one all-reduce of ``[Σ KL, #tokens]`` over DP, then PP; the
skip decision's inputs are all-reduced too, so every rank and stage applies the same η.

Steps, estimators and memory: docs/kl_control.md#what-happens-at-each-optimizer-step
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loggra_megatron.rl.config import KLControlConfig
from loggra_megatron.rl.kl_probe import ProbeBatch, ProbeKL, ProbeOutput, ReferenceCollector
from loggra_megatron.rl.kl_probe_skip import ProbeSkipRule
from loggra_megatron.rl.kl_schedule import KLTargetSchedule

if TYPE_CHECKING:  # imports Megatron
    from loggra_megatron.optim.megatron.stepper import MegatronStepper, PreparedGrads

logger = logging.getLogger(__name__)


@dataclass
class KLUpdate:
    """One optimizer update under predicted-KL control: its rows, then what each phase of
    ``PredictedKLController.step`` found (in phase order). ``metrics()`` reports it."""

    rows: ProbeBatch
    """The probe rows ``[:split]``, then the held-out rows when ``kl/realized`` is due."""
    split: int
    """How many of ``rows`` are probe rows."""
    keep_logits: bool
    """The reference is the logits (the ``full`` estimator), not token log-probs."""
    target: float = math.nan
    """The KL target of this update (``--kl-target``, or its schedule at the RL step)."""
    collector: ReferenceCollector | None = None
    """Set by ``keep_reference``: π_θ of ``rows`` from the mini-batch's training forward."""

    prepared: PreparedGrads | None = None
    """gradients: the grad norm, and whether the step may go on."""
    sq_norm: float | None = None
    """skip?: ``‖Δθ‖²`` of the full step (None: not needed, or unknown)."""
    skip_bound: float | None = None
    """skip?: the extrapolated KL when the probe is skipped, else None."""
    fold: bool = False
    """reference: the held-out rows ride along in each trial's forward."""
    reference: ProbeOutput | None = None
    """reference: π_θ of the trials' rows (the probe rows, then the held-out rows when
    ``fold``); None on pipeline stages other than the last."""
    holdout_reference: ProbeOutput | None = None
    """reference: π_θ of the held-out rows, for their forward after the commit."""
    kl_predicted: float = math.nan
    """probe: KL̂ of the full step (skipped: the extrapolated KL)."""
    peak_bytes: int = 0
    """probe: the largest transient memory of the candidate write."""
    eta: float = 1.0
    """scale: the step scale η that is committed."""
    kl_committed: float = math.nan
    """scale: the probe KL at η (the last trial's)."""
    backtracks: int = 0
    """scale: how often η was halved."""
    kl_holdout: float | None = None
    """scale: the held-out rows' KL in the last trial (``fold``)."""
    committed: bool = False
    """commit: the update was applied."""
    kl_realized: float | None = None
    """realized: the held-out rows' KL at the committed weights."""
    seconds: float = 0.0
    """Time spent on control, not counting the step's own work (gradients, commit)."""

    @property
    def probe(self) -> ProbeBatch:
        return _take(self.rows, slice(0, self.split))

    @property
    def holdout(self) -> ProbeBatch | None:
        return _take(self.rows, slice(self.split, None)) if self.has_holdout else None

    @property
    def has_holdout(self) -> bool:
        return len(self.rows[0]) > self.split

    @property
    def skipped(self) -> bool:
        return self.skip_bound is not None

    @property
    def measured(self) -> tuple[float | None, float | None]:
        """``(KL, ‖update‖²)`` of the update whose KL this step measured, the skip rule's
        anchor: the probe's full step ``Δθ``, or on a skipped step the committed ``η·Δθ``
        (its ``kl/realized``; None when not due)."""
        if not self.skipped:
            return self.kl_predicted, self.sq_norm
        sq_norm = None if self.sq_norm is None else self.sq_norm * self.eta**2
        return self.kl_realized, sq_norm

    def keep_reference(self, loss_fn):
        """``loss_fn`` wrapped to keep π_θ of ``rows`` from the mini-batch's training
        forward (at the same weights), so that no reference forward runs."""
        self.collector = ReferenceCollector(len(self.rows[0]), self.keep_logits)
        return self.collector.wrap(loss_fn)

    @contextlib.contextmanager
    def timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """The ``kl/*`` keys of this update (``metric_keys.py``); NaN where not measured."""
        if self.prepared is None or not self.prepared.ok:
            return {"kl/step_scale": 0.0, "kl/target": self.target, "time/kl_control_s": 0.0}
        kept = (r.nbytes for r in (self.reference, self.holdout_reference) if r is not None)
        metrics = {
            "kl/target": self.target,
            "kl/predicted": self.kl_predicted,
            "kl/step_scale": self.eta if self.committed else 0.0,
            "kl/predicted_committed": self.kl_committed,
            "kl/backtracks": float(self.backtracks),
            "memory/kl_control_bytes": float(sum(kept) + self.peak_bytes),
        }
        if self.kl_realized is not None:
            metrics["kl/realized"] = self.kl_realized
        metrics["kl/probe_skipped"] = float(self.skipped)
        metrics["time/kl_control_s"] = self.seconds
        return metrics


def _take(batch: ProbeBatch, rows: slice) -> ProbeBatch:
    tokens, mask = batch
    return tokens[rows], None if mask is None else mask[rows]


class PredictedKLController:
    """Wraps a Megatron optimizer's step with predicted-KL control (module docstring).

    Args:
        config: the ``--kl-*`` settings (``kl_target`` must be set).
        stepper: the run's ``MegatronStepper`` over a Megatron-Core optimizer (LoGRA's or
            dense Adam) with 16-bit model weights.
        measure: the KL of a batch against a reference, and the reference (``ProbeKL``).
        schedule: the target by RL step (default: ``config``'s, read at each update, which
            must then be constant or set ``--kl-target-decay-iters``).
        rl_step: the RL step of the next update (0-based; the trainer's step counter, which
            its checkpoint carries); needed when the target is scheduled.
    """

    def __init__(
        self,
        config: KLControlConfig,
        stepper: MegatronStepper,
        measure: ProbeKL,
        schedule: KLTargetSchedule | None = None,
        rl_step: Callable[[], int] | None = None,
    ):
        if not config.enabled:
            raise ValueError("PredictedKLController needs --kl-target")
        self.schedule = schedule
        if not (schedule or KLTargetSchedule.of(config)).constant and rl_step is None:
            raise ValueError("a scheduled KL target (--kl-target-final) needs the RL step")
        stepper.require_separate_model_weights()
        self.config, self.stepper, self.measure = config, stepper, measure
        self.rl_step = rl_step or (lambda: 0)
        self.num_steps = 0
        """Committed steps (drives the kl/realized interval). Skipped steps are the caller's
        to count (``train.steps.SkipCounter``)."""
        self.skip_rule = ProbeSkipRule(
            config.kl_probe_skip_below, config.kl_probe_max_skips, config.kl_max_step_scale
        )

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "probe_skip": self.skip_rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self.skip_rule.load_state_dict(state.get("probe_skip", {}))

    def target(self) -> float:
        """The KL target of the next update: the schedule's at the RL step."""
        schedule = self.schedule or KLTargetSchedule.of(self.config)
        return schedule(self.rl_step())

    def begin(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> KLUpdate:
        """The update of a mini-batch ``tokens [B, s+1]`` (``mask [B, s]``): its probe rows
        and, when ``kl/realized`` is due, its held-out rows (``KLControlConfig.probe_split``).
        Call it before the mini-batch's training forward, which may then keep their
        reference (``KLUpdate.keep_reference``)."""
        probe, holdout = self.config.probe_split(len(tokens))
        interval = self.config.kl_realized_interval
        due = holdout.stop > holdout.start and bool(interval) and self.num_steps % interval == 0
        stop = holdout.stop if due else probe.stop
        full = self.config.kl_estimator == "full"
        rows = _take((tokens, mask), slice(0, stop))
        return KLUpdate(rows, probe.stop, keep_logits=full, target=self.target())

    def step(self, u: KLUpdate) -> KLUpdate:
        """Megatron's ``optimizer.step()`` with the update scaled to the KL target, phase by
        phase (module docstring). Returns ``u``, filled in."""
        u.prepared = self.stepper.prepare(project=True)  # the step's work, not control's
        if not u.prepared.ok:  # an fp16 overflow or a non-finite gradient norm
            return u
        with u.timed():
            self._decide_skip(u)  # far below target: the full step, no trial
            self._collect_reference(u)  # π_θ of the rows the KL is measured on
            if not u.skipped:
                self._probe(u)  # KL̂ of θ + Δθ
                self._scale(u)  # η, then backtracking
        if math.isfinite(u.kl_predicted) and math.isfinite(u.kl_committed):
            self._commit(u)  # Megatron's step at lr·η
            self._check_realized(u)  # kl/realized on the held-out rows
        else:
            self._reject(u)  # θ restored; no state changed
        self.skip_rule.update(u.skipped, *u.measured)  # its anchor
        return u

    # ------------------------------------------------------------------ the phases
    def _decide_skip(self, u: KLUpdate) -> None:
        """skip?: commit the largest step (η = α_max) without a trial when the last measured
        KL, carried to this update's norm and scaled by α_max², is far below the target:
        the probe would choose α_max too."""
        rule = self.skip_rule
        u.sq_norm = self.stepper.update_sq_norm() if rule.skip_below > 0 else None
        refresh = self.stepper.basis_refresh_due
        u.skip_bound = rule.bound(u.sq_norm, u.target, refresh)
        if u.skipped:
            u.eta = self.config.kl_max_step_scale
            u.kl_predicted = u.skip_bound
            u.kl_committed = u.skip_bound * u.eta**2

    def _collect_reference(self, u: KLUpdate) -> None:
        """reference: π_θ of the trials' rows and of the held-out rows for a forward after
        the commit. Kept by the training forward when the caller wrapped its loss (every
        stage then skips the forward together; only the last holds values), else a forward
        here: one for the trials' rows, one for the held-out rows when not folded."""
        u.fold = u.has_holdout and not u.skipped and self.stepper.trials_are_commits
        kept = None if u.collector is None else u.collector.result(u.rows[0].shape[1] - 1)

        def reference(rows: slice) -> ProbeOutput | None:
            if u.collector is not None:
                return None if kept is None else kept.rows(rows)
            return self.measure.reference(_take(u.rows, rows))

        if u.fold:  # one batch: the probe rows, then the held-out rows
            u.reference = reference(slice(None))
            return
        if not u.skipped:
            u.reference = reference(slice(0, u.split))
        if u.has_holdout:
            u.holdout_reference = reference(slice(u.split, None))

    def _probe(self, u: KLUpdate) -> None:
        """probe: KL̂ of the full step."""
        u.kl_predicted, u.kl_holdout, u.peak_bytes = self._trial(u, 1.0)
        u.kl_committed = u.kl_predicted

    def _scale(self, u: KLUpdate) -> None:
        """scale: η = min(α_max, sqrt(target / KL̂)) from the quadratic model, then halved
        while the probe KL at η exceeds the tolerance; the last trial is at the η that is
        committed. The full step (η = 1) needs no trial: the probe was it."""
        cfg, alpha = self.config, self.config.kl_max_step_scale
        if not math.isfinite(u.kl_predicted):
            return
        if u.kl_predicted <= u.target / alpha**2:  # also KL̂ ≤ 0 (a k1 estimate may be)
            if alpha == 1.0:
                return
            u.eta = alpha
        else:
            u.eta = math.sqrt(u.target / u.kl_predicted)
        while True:
            u.kl_committed, u.kl_holdout, _ = self._trial(u, u.eta)
            within = u.kl_committed <= cfg.kl_backtrack_tolerance * u.target
            if (math.isfinite(u.kl_committed) and within) or u.backtracks == cfg.kl_max_backtracks:
                return
            u.eta, u.backtracks = 0.5 * u.eta, u.backtracks + 1

    def _commit(self, u: KLUpdate) -> None:
        """commit: Megatron's step with every group's lr × η."""
        self.stepper.commit(u.eta)
        self.num_steps += 1
        u.committed = True

    def _check_realized(self, u: KLUpdate) -> None:
        """realized: the held-out rows' KL at the committed weights, on tokens η was not
        decided on: the last trial's, which were these weights bit for bit (``fold``), else
        a forward now."""
        if not u.has_holdout:
            return
        with u.timed():
            if u.fold:
                u.kl_realized = u.kl_holdout
                return
            if not self.stepper.commit_syncs_weights:
                self.stepper.finish_weight_sync()  # the commit's gathers, not a new one
            u.kl_realized = self.measure(u.holdout, u.holdout_reference)[0]

    def _reject(self, u: KLUpdate) -> None:
        """A non-finite KL: the model weights back to θ (the masters and the optimizer
        state were never touched) and the update skipped."""
        with u.timed():
            self.stepper.restore_model_weights()
            logger.warning(
                "predicted-KL control: the KL of the candidate update is non-finite "
                "(kl/predicted=%s); skipping this optimizer step",
                u.kl_predicted,
            )

    def _trial(self, u: KLUpdate, eta: float) -> tuple[float, float | None, int]:
        """``θ + η·Δθ`` in the model weights: ``(KL of the probe rows, KL of the held-out
        rows when folded, peak transient bytes)``."""
        batch, split = (u.rows, u.split) if u.fold else (u.probe, None)
        with self.stepper.try_candidate(eta) as trial:
            kl, kl_rest = self.measure(batch, u.reference, split) if trial.ok else (math.nan,) * 2
        return kl, kl_rest, trial.peak_bytes
