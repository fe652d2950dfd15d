"""Predicted-KL step control: measure the policy change of an update before applying it.

After the gradients are ready, the controller writes the inner optimizer's candidate
``θ + Δθ`` into the 16-bit model weights only (masters and optimizer state untouched),
estimates ``KL̂ = E_tokens KL(π_θ ‖ π_{θ+Δθ})`` on probe sequences, predicts
``KL(η·Δθ) ≈ η²·KL̂`` and commits ``θ + η·Δθ`` with ``η = min(1, sqrt(kl_target / KL̂))``
(ACKTR, Wu et al. 2017; TRPO, Schulman et al. 2015), halving η while the scaled candidate's
probe KL exceeds the tolerance. With ``η = 1`` the commit is Megatron's step, bit for bit;
held-out sequences check the prediction (``kl/realized``). Far below target the probe is
skipped (``rl.kl_probe_skip``). Every optimizer phase goes through
``MegatronStepper``.

Communication: per probe forward, the TP reductions of
``model.vocab_parallel``, then one all-reduce of ``[Σ KL, #tokens]`` over
DP and one over PP (the other stages add zeros), so every stage applies the same η.

Steps, estimators and memory: docs/kl_control.md#what-happens-at-each-optimizer-step
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from loggra_megatron.model.vocab_parallel import (
    sampled_kl,
    vocab_parallel_kl,
    vocab_parallel_log_probs,
)
from loggra_megatron.rl.config import KLControlConfig
from loggra_megatron.rl.kl_probe import (
    REFERENCE_ON_LAST_STAGE,
    ProbeForward,
    ProbeOutput,
    ReferenceCollector,
    batch_rows,
    cat_batches,
    cat_outputs,
    nbytes,
    num_rows,
    output_rows,
    widen_output,
)
from loggra_megatron.rl.kl_probe_skip import ProbeSkipRule

if TYPE_CHECKING:  # imports Megatron
    from loggra_megatron.optim.megatron.stepper import MegatronStepper

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    update_successful: bool
    grad_norm: float | None
    num_zeros_in_grad: int | None
    metrics: dict[str, float] = field(default_factory=dict)


class PredictedKLController:
    """Wraps a Megatron optimizer's step with predicted-KL control (see module docstring).

    Args:
        config: the ``--kl-*`` settings (``kl_target`` must be set).
        stepper: the run's ``MegatronStepper``
            over a Megatron-Core optimizer (LoGRA's or dense Adam) with 16-bit params.
        forward: the probe forward (no grad) of the policy.
        tp_group, dp_group, pp_group: Megatron's process groups (None: size 1).
        forward_rows: rows per call of ``forward`` when a KL is measured (None: all at
            once), so that one call's logits and KL temporaries exist at a time (the
            ``full`` estimator's are ``rows × s × V/TP`` floats, several times over).
    """

    def __init__(
        self,
        config: KLControlConfig,
        stepper: MegatronStepper,
        forward: ProbeForward,
        tp_group=None,
        dp_group=None,
        pp_group=None,
        forward_rows: int | None = None,
    ):
        if not config.enabled:
            raise ValueError("PredictedKLController needs --kl-target")
        self.config, self.forward, self.forward_rows = config, forward, forward_rows
        self.stepper = stepper
        """The run's one stepping seam over its optimizer (shared with the plain step)."""
        stepper.require_separate_model_weights()
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.num_steps = 0
        """Committed steps (drives the kl/realized interval). Skipped steps are the caller's
        to count (``train.steps.SkipCounter``)."""
        self.skip_rule = ProbeSkipRule(config.kl_probe_skip_below, config.kl_probe_max_skips)
        """When the probe trial may be skipped (``rl.kl_probe_skip``)."""
        params = (p for g in stepper.optimizer.param_groups for p in g["params"])
        self._device = next((p.device for p in params), torch.device("cpu"))

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "probe_skip": self.skip_rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self.skip_rule.load_state_dict(state.get("probe_skip", {}))

    # ------------------------------------------------------------------ public
    def step_minibatch(self, tokens: torch.Tensor, mask: torch.Tensor, reference=None):
        """``step`` with this mini-batch's probe and held-out sequences
        (``KLControlConfig.probe_split``); ``reference``: from a
        ``reference_collector`` of this mini-batch (the probe rows, and the held-out
        rows when ``kl/realized`` is due)."""
        probe, holdout = self.config.probe_split(len(tokens))
        held = (tokens[holdout], mask[holdout]) if holdout.stop > holdout.start else None
        held_reference = None
        if reference is not None and reference is not REFERENCE_ON_LAST_STAGE:
            reference = widen_output(reference, tokens.shape[1] - 1)  # grouped: cut rows
        if reference is not None and self._realized_due(held is not None):
            held_reference = reference
            if reference is not REFERENCE_ON_LAST_STAGE:
                kept_all = reference.logits.shape[0] >= holdout.stop  # else: probe rows only
                held_reference = output_rows(reference, holdout) if kept_all else None
                reference = output_rows(reference, probe)
        return self.step((tokens[probe], mask[probe]), held, reference, held_reference)

    def reference_collector(self, num_sequences: int) -> ReferenceCollector:
        """A ``ReferenceCollector`` of the probe rows of a mini-batch of
        ``num_sequences`` and, when ``kl/realized`` is due at this step, of its held-out rows
        (its result goes to ``step_minibatch``)."""
        probe, holdout = self.config.probe_split(num_sequences)
        due = self._realized_due(holdout.stop > holdout.start)
        full = self.config.kl_estimator == "full"
        return ReferenceCollector(self, holdout.stop if due else probe.stop, logits=full)

    def _realized_due(self, has_holdout: bool) -> bool:
        interval = self.config.kl_realized_interval
        return has_holdout and bool(interval) and self.num_steps % interval == 0

    def step(self, probe_batch, holdout_batch=None, reference=None, holdout_reference=None):
        """Megatron's ``optimizer.step()`` with the update scaled to the KL target.

        ``reference`` (``holdout_reference``) may pass the probe (held-out) batch's logits
        at the current weights if the caller already has them (e.g. kept from the training
        forward by a ``ReferenceCollector``), saving a forward; stages other than the
        last then pass ``REFERENCE_ON_LAST_STAGE``. When ``skip_rule`` finds the
        step far below target, no probe trial runs and the full step is committed (η = 1).
        Returns a ``StepResult``.
        """
        cfg = self.config
        realized_due = self._realized_due(holdout_batch is not None)
        prepared = self.stepper.prepare(project=True)  # work of the step, not of control
        grad_norm, num_zeros = prepared.grad_norm, prepared.num_zeros
        if not prepared.ok:  # fp16 overflow or a non-finite gradient norm
            metrics = {"kl/step_scale": 0.0, "time/kl_control_s": 0.0}
            return StepResult(False, grad_norm, num_zeros, metrics)

        t0 = time.perf_counter()
        sq_norm = self.stepper.update_sq_norm() if self.skip_rule.skip_below > 0 else None
        bound = self.skip_rule.bound(sq_norm, cfg.kl_target, self.stepper.basis_refresh_due)
        t_control = time.perf_counter() - t0
        held = (holdout_batch, holdout_reference) if realized_due else None
        if bound is None:
            ok, metrics, full_step_kl, seconds = self._probed(probe_batch, reference, held)
        else:
            ok, metrics, full_step_kl, seconds = self._skipped(bound, held)
        self.skip_rule.update(bound is not None, full_step_kl, sq_norm)
        metrics["kl/probe_skipped"] = float(bound is not None)
        metrics["time/kl_control_s"] = t_control + seconds
        return StepResult(ok, grad_norm, num_zeros, metrics)

    def _probed(self, probe_batch, reference, held):
        """The probe trial(s), η, the commit and ``kl/realized`` (``held``: the held-out
        batch and its reference, when due). ``(committed, metrics, KL̂ of the full step,
        control seconds)``."""
        t0 = time.perf_counter()
        # Trials that are commits (LoGRA): the held-out rows ride along in each trial's
        # forward and the last trial's held-out KL is kl/realized, with no forward of its own.
        fold = held is not None and self.stepper.trials_are_commits
        batch, ref, split, ref_holdout = self._probe_references(probe_batch, reference, held, fold)
        kl_raw, kl_held, peak = self._candidate_kl(batch, ref, 1.0, split)
        eta, kl_committed, backtracks, kl_held = self._scale(batch, ref, split, kl_raw, kl_held)
        metrics = {
            "kl/predicted": kl_raw,
            "kl/step_scale": eta,
            "kl/predicted_committed": kl_committed,
            "kl/backtracks": float(backtracks),
            "memory/kl_control_bytes": float(nbytes(ref) + nbytes(ref_holdout) + peak),
        }
        if not (math.isfinite(kl_raw) and math.isfinite(kl_committed)):
            self.stepper.restore_model_weights()
            logger.warning(
                "predicted-KL control: the KL of the candidate update is non-finite "
                "(kl/predicted=%s); skipping this optimizer step",
                kl_raw,
            )
            metrics["kl/step_scale"] = 0.0
            return False, metrics, kl_raw, time.perf_counter() - t0
        t_control = time.perf_counter() - t0
        self.stepper.commit(eta)
        self.num_steps += 1
        if fold:
            metrics["kl/realized"] = kl_held
        elif held is not None:
            t0 = time.perf_counter()
            metrics["kl/realized"] = self._realized_after_commit(held[0], ref_holdout)
            t_control += time.perf_counter() - t0
        return True, metrics, kl_raw, t_control

    def _skipped(self, bound: float, held):
        """The full step committed without a probe trial; ``kl/realized`` after the commit
        when due (``held``), which is then the full step's measured KL. Returns as
        ``_probed``, with ``bound`` as ``kl/predicted``."""
        t0 = time.perf_counter()
        ref_holdout = None if held is None else self._given_or_own_reference(held[1], held[0])
        metrics = {
            "kl/predicted": bound,
            "kl/step_scale": 1.0,
            "kl/predicted_committed": bound,
            "kl/backtracks": 0.0,
            "memory/kl_control_bytes": float(nbytes(ref_holdout)),
        }
        t_control = time.perf_counter() - t0
        self.stepper.commit(1.0)
        self.num_steps += 1
        full_step_kl = None
        if held is not None:
            t0 = time.perf_counter()
            full_step_kl = self._realized_after_commit(held[0], ref_holdout)
            metrics["kl/realized"] = full_step_kl
            t_control += time.perf_counter() - t0
        return True, metrics, full_step_kl, t_control

    def _probe_references(self, probe_batch, reference, held, fold: bool):
        """``(batch of the trials, its reference, rows of the probe or None, the held-out
        reference for a forward after the commit)``; ``fold``: the held-out rows join the
        trials' batch (one batch: the probe rows, then the held-out rows)."""
        if fold:
            holdout_batch, holdout_reference = held
            batch, split = cat_batches(probe_batch, holdout_batch), num_rows(probe_batch)
            if reference is None and holdout_reference is None:
                return batch, self._reference(batch), split, None
            ref = cat_outputs(
                self._given_or_own_reference(reference, probe_batch),
                self._given_or_own_reference(holdout_reference, holdout_batch),
            )
            return batch, ref, split, None
        ref = self._given_or_own_reference(reference, probe_batch)
        ref_holdout = None if held is None else self._given_or_own_reference(held[1], held[0])
        return probe_batch, ref, None, ref_holdout

    def _scale(self, batch, ref, split, kl_raw: float, kl_held):
        """η from the quadratic model, then TRPO's backtracking; the last trial is at the η
        that is committed. ``(η, its probe KL, backtracks, its held-out KL)``."""
        cfg = self.config
        eta, kl_committed, backtracks = 1.0, kl_raw, 0
        if math.isfinite(kl_raw) and kl_raw > cfg.kl_target:
            eta = math.sqrt(cfg.kl_target / kl_raw)
            while True:
                kl_committed, kl_held, _ = self._candidate_kl(batch, ref, eta, split)
                ok = math.isfinite(kl_committed)
                if ok and kl_committed <= cfg.kl_backtrack_tolerance * cfg.kl_target:
                    break
                if backtracks == cfg.kl_max_backtracks:
                    break
                eta, backtracks = 0.5 * eta, backtracks + 1
        return eta, kl_committed, backtracks, kl_held

    def _realized_after_commit(self, batch, ref) -> float:
        """``kl/realized`` by a forward of the held-out rows at the committed weights."""
        if not self.stepper.commit_syncs_weights:
            self.stepper.sync_model_weights()
        return self._kl(batch, ref)[0]

    # ------------------------------------------------------------------ internals
    def _given_or_own_reference(self, reference, batch):
        if reference is None:
            return self._reference(batch)
        return None if reference is REFERENCE_ON_LAST_STAGE else self.as_reference(reference)

    @torch.no_grad()
    def _reference(self, batch):
        """What the KL needs from the current policy: logits (full) or token log-probs."""
        return self.as_reference(self.forward(batch))

    def as_reference(self, out: ProbeOutput | None):
        """What the KL needs of the probe's output at θ: the logits (``full``), else the
        sampled tokens' log-probs (``[b, s]``; an output that already holds them is kept)."""
        if out is None:
            return None
        if self.config.kl_estimator == "full" or out.logits.ndim == 2:
            return out
        logp = vocab_parallel_log_probs(out.logits, out.targets, self.tp_group)
        return ProbeOutput(logp, out.targets, out.mask)

    @torch.no_grad()
    def _kl(self, batch, ref, split: int | None = None) -> tuple[float, float | None]:
        """Mean per-token KL(reference ‖ current weights) over the batch's counted tokens, of
        rows ``[:split]`` and of rows ``[split:]`` (None without ``split``); forwards of
        ``forward_rows`` rows, then one all-reduce of ``[Σ KL, #tokens]`` per part over DP,
        then PP."""
        rows = num_rows(batch)
        parts = [(0, rows)] if split is None else [(0, split), (split, rows)]
        totals = torch.zeros(2 * len(parts), device=self._device)
        step = self.forward_rows or rows
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            out = self.forward(batch_rows(batch, slice(lo, hi)))
            if out is None:  # a pipeline stage other than the last
                continue
            if self.config.kl_estimator == "full":
                chunk_ref = output_rows(ref, slice(lo, hi))
                per_token = vocab_parallel_kl(chunk_ref.logits, out.logits, self.tp_group)
            else:
                logp = self.as_reference(out).logits  # [b, s] log-probs
                per_token = sampled_kl(ref.logits[lo:hi], logp, self.config.kl_estimator)
            mask = out.mask.to(per_token.dtype)
            sums = []
            for start, stop in parts:  # the part's rows within this chunk
                r = slice(max(start, lo) - lo, max(min(stop, hi), lo) - lo)
                sums += [(per_token[r] * mask[r]).sum(), mask[r].sum()]
            totals += torch.stack(sums).to(totals.device)
        for group in (self.dp_group, self.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        kl = (totals[0::2] / totals[1::2].clamp_min(1)).tolist()
        return kl[0], (kl[1] if split is not None else None)

    def _candidate_kl(self, batch, ref, eta: float, split: int | None = None):
        """Try ``θ + η·Δθ`` on the model weights; ``(KL of rows [:split], KL of rows
        [split:] or None, peak transient bytes)``."""
        with self.stepper.try_candidate(eta) as trial:
            kl, kl_rest = self._kl(batch, ref, split) if trial.ok else (math.nan, math.nan)
        return kl, kl_rest, trial.peak_bytes
