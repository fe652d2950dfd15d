"""Predicted-KL step control: measure the policy change of an update before applying it.

Design note §3. After the gradients are ready (reduce-scattered, unscaled, clipped), the
controller

1. computes the *candidate* ``θ + Δθ`` of the inner optimizer without changing any
   parameter or optimizer state (:mod:`loggra_megatron.optim.candidate`) and writes it
   into the 16-bit model weights only (the fp32 master weights stay ``θ``; the
   distributed optimizer's param all-gather spreads it to every DP rank);
2. runs a forward pass on *probe* sequences (a fraction of the batch) and estimates
   ``KL̂ = E_tokens KL(π_θ ‖ π_{θ+Δθ})`` against logits taken at ``θ`` before the step;
3. predicts the KL of a scaled step with the local quadratic model
   ``KL(η·Δθ) ≈ η²·KL̂`` and picks ``η = min(1, sqrt(kl_target / KL̂))`` (ACKTR, Wu et al.
   2017; TRPO, Schulman et al. 2015). As TRPO's line search does, it then checks the
   scaled candidate on the probe and halves η while its KL exceeds
   ``kl_backtrack_tolerance × kl_target`` (at most ``kl_max_backtracks`` times);
4. commits ``θ + η·Δθ`` as Megatron's own ``step_with_ready_grads`` with every group's lr
   multiplied by η (:class:`~loggra_megatron.optim.megatron.stepper.MegatronStepper`;
   AdamW's decay and update both scale with lr, and the moments are updated as for the
   full step, i.e. not rescaled). With ``η = 1`` this *is* the normal step, bit for bit.
   A non-finite gradient norm or KL̂ skips the update, leaving weights and state as they
   were.
5. every ``kl_realized_interval`` steps, measures ``kl/realized`` at the committed weights
   on *held-out* sequences that were not in the probe: an honest check of the prediction.

Estimators: ``full`` is the exact full-vocabulary KL per token (reference logits of the
probe are kept: ``probe tokens × V/TP`` values); ``k1``/``k2``/``k3`` use the sampled
tokens only (one log-prob per token is kept). Communication: per probe forward, the
vocab-parallel reductions of :mod:`loggra_megatron.kl` over TP (``[tokens]`` floats),
then one all-reduce of ``[Σ KL, #tokens]`` over DP and one over PP, where the stages
other than the last contribute zeros, so every stage applies the same η.

Memory: the stored reference (above) plus one param's candidate at a time; no copy of the
weights or of the update. fp32 params that share storage with their master (e.g. norm
weights kept in fp32) are saved before the candidate and restored after it; they must be
under 1 % of the parameters, so fp32 models are refused (use ``--bf16``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loggra_megatron.config import at_least, check_fields, one_of, positive
from loggra_megatron.kl import ESTIMATORS, sampled_kl, vocab_parallel_kl, vocab_parallel_log_probs
from loggra_megatron.optim.candidate import write_candidate

logger = logging.getLogger(__name__)


@dataclass
class KLControlConfig:
    """Settings of predicted-KL step control (``--kl-*`` flags)."""

    kl_target: float | None = None
    """Target KL(π_θ ‖ π_new) per probe token of each optimizer step; None turns it off."""
    kl_probe_fraction: float = 0.125
    """Fraction of each step's sequences used as probe (at least one sequence)."""
    kl_estimator: str = "full"
    """``full`` (exact, over the vocabulary) or ``k1`` / ``k2`` / ``k3`` (sampled tokens)."""
    kl_max_backtracks: int = 2
    """TRPO-style safeguard: how many times η may be halved after the quadratic model."""
    kl_backtrack_tolerance: float = 1.5
    """Halve η while the probe KL of the scaled step exceeds this × ``kl_target``."""
    kl_realized_interval: int = 1
    """Measure ``kl/realized`` on held-out sequences every N steps (0: never)."""

    def __post_init__(self):
        check_fields(self, [
            ("kl_target", positive, "a positive number (omit it to disable)"),
            ("kl_probe_fraction", lambda f: 0 < f <= 0.5, "in (0, 0.5]"),
            ("kl_estimator", one_of(*ESTIMATORS), f"one of {', '.join(ESTIMATORS)}"),
            ("kl_max_backtracks", at_least(0), ">= 0"),
            ("kl_backtrack_tolerance", at_least(1), ">= 1"),
            ("kl_realized_interval", at_least(0), ">= 0 (0: never)"),
        ])  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.kl_target is not None

    def probe_split(self, num_sequences: int) -> tuple[slice, slice]:
        """``(probe, held-out)`` index ranges of a step's ``num_sequences`` sequences."""
        k = min(num_sequences, max(1, math.ceil(self.kl_probe_fraction * num_sequences)))
        return slice(0, k), slice(k, min(num_sequences, 2 * k))


@dataclass
class ProbeOutput:
    """What the probe forward returns on the last pipeline stage."""

    logits: torch.Tensor
    """``[b, s, V/TP]`` vocab-parallel logits."""
    targets: torch.Tensor
    """``[b, s]`` the tokens that were sampled at each position."""
    mask: torch.Tensor
    """``[b, s]`` which positions count (the response tokens)."""


ProbeForward = Callable[[Any], "ProbeOutput | None"]
"""Runs the (pipelined) forward of a batch; ``ProbeOutput`` on the last stage, else None."""


def gpt_probe_forward(model) -> ProbeForward:
    """The probe forward of a (DDP-wrapped) Megatron-Core ``GPTModel`` through Megatron's
    forward-only schedule, so it works under PP.

    The batch is ``(tokens [b, s+1], mask [b, s] or None)``: positions ``0..s-1`` are fed,
    position t's logits score token ``t+1``, and ``mask`` selects the counted positions.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward(batch) -> ProbeOutput | None:
        tokens, mask = batch
        inputs = tokens[:, :-1]

        def step(data_iterator, chunk):
            x = next(data_iterator)
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand_as(x)
            return chunk(x, pos, None), lambda out, non_loss_data=True: out

        outs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([inputs]), model=[model],
            num_microbatches=1, seq_length=inputs.shape[1], micro_batch_size=inputs.shape[0],
            forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
        if not parallel_state.is_pipeline_last_stage():
            return None
        targets = tokens[:, 1:]
        mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask
        return ProbeOutput(outs[0], targets, mask)

    return forward


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
        optimizer: a Megatron-Core optimizer (LoGRA's or dense Adam) with 16-bit params.
        forward: the probe forward (no grad) of the policy.
        tp_group, dp_group, pp_group: Megatron's process groups (None: size 1).
    """

    def __init__(
        self,
        config: KLControlConfig,
        optimizer,
        forward: ProbeForward,
        tp_group=None,
        dp_group=None,
        pp_group=None,
    ):
        if not config.enabled:
            raise ValueError("PredictedKLController needs --kl-target")
        leaves = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        if len(leaves) != 1:
            raise NotImplementedError("predicted-KL control supports one leaf optimizer")
        self.config, self.leaf, self.forward = config, leaves[0], forward
        from loggra_megatron.optim.megatron.stepper import MegatronStepper

        self.stepper = MegatronStepper(optimizer)
        self.tp_group, self.dp_group, self.pp_group = tp_group, dp_group, pp_group
        self.num_steps = 0
        self.num_skipped_steps = 0
        from loggra_megatron.optim.megatron_adapter import main_params_of

        self._targets = main_params_of(self.leaf)
        aliased = [(main, model) for main, model, _, _ in self._targets if _shares(main, model)]
        total = sum(model.numel() for _, model, _, _ in self._targets) or 1
        if sum(main.numel() for main, _ in aliased) > 0.01 * total:
            raise ValueError(
                "--kl-target needs 16-bit model weights with fp32 master weights (--bf16): "
                "the candidate update is tried on the model weights while the masters keep θ"
            )
        self._aliased = [main for main, _ in aliased]
        self._model_of = {main: (model, start, end) for main, model, start, end in self._targets}

    # ------------------------------------------------------------------ public
    def step(self, probe_batch, holdout_batch=None, reference: ProbeOutput | None = None):
        """Megatron's ``optimizer.step()`` with the update scaled to the KL target.

        ``reference`` may pass the probe batch's logits at the current weights if the
        caller already has them (e.g. kept from the training forward), saving a forward.
        Returns a :class:`StepResult`.
        """
        cfg, leaf = self.config, self.leaf
        t_start = time.perf_counter()
        interval = cfg.kl_realized_interval
        realized_due = holdout_batch is not None and interval and self.num_steps % interval == 0
        ref = self._reference(probe_batch) if reference is None else self._as_reference(reference)
        ref_holdout = self._reference(holdout_batch) if realized_due else None
        ref_bytes = _bytes(ref) + _bytes(ref_holdout)
        t_control = time.perf_counter() - t_start

        prepared = self.stepper.prepare()
        grad_norm = prepared.grad_norm
        num_zeros = leaf.count_zeros() if leaf.config.log_num_zeros_in_grad else None
        if not prepared.ok:  # fp16 overflow or a non-finite gradient norm
            self.num_skipped_steps += 1
            metrics = {"kl/step_scale": 0.0, "time/kl_control_s": t_control}
            return StepResult(False, grad_norm, num_zeros, metrics)

        t0 = time.perf_counter()
        kl_raw, peak = self._candidate_kl(probe_batch, ref, 1.0)
        eta, kl_committed, backtracks = 1.0, kl_raw, 0
        if math.isfinite(kl_raw) and kl_raw > cfg.kl_target:
            eta = math.sqrt(cfg.kl_target / kl_raw)
            while True:
                kl_committed, _ = self._candidate_kl(probe_batch, ref, eta)
                ok = math.isfinite(kl_committed)
                if ok and kl_committed <= cfg.kl_backtrack_tolerance * cfg.kl_target:
                    break
                if backtracks == cfg.kl_max_backtracks:
                    break
                eta, backtracks = 0.5 * eta, backtracks + 1
        t_control += time.perf_counter() - t0
        metrics = {
            "kl/predicted": kl_raw,
            "kl/step_scale": eta,
            "kl/predicted_committed": kl_committed,
            "kl/backtracks": float(backtracks),
            "memory/kl_control_bytes": float(ref_bytes + peak),
        }
        if not (math.isfinite(kl_raw) and math.isfinite(kl_committed)):
            self._restore_model_weights()
            self.num_skipped_steps += 1
            logger.warning(
                "predicted-KL control: the KL of the candidate update is non-finite "
                "(kl/predicted=%s); skipping this optimizer step (%d skipped so far)",
                kl_raw, self.num_skipped_steps,
            )  # fmt: skip
            metrics.update({"kl/step_scale": 0.0, "time/kl_control_s": t_control})
            return StepResult(False, grad_norm, num_zeros, metrics)

        self.stepper.commit(eta)
        self.num_steps += 1
        if realized_due:
            t0 = time.perf_counter()
            self._sync_model_weights()
            metrics["kl/realized"] = self._kl(holdout_batch, ref_holdout)
            t_control += time.perf_counter() - t0
        metrics["time/kl_control_s"] = t_control
        return StepResult(True, grad_norm, num_zeros, metrics)

    # ------------------------------------------------------------------ internals
    @torch.no_grad()
    def _reference(self, batch):
        """What the KL needs from the current policy: logits (full) or token log-probs."""
        return self._as_reference(self.forward(batch))

    def _as_reference(self, out: ProbeOutput | None):
        if out is None:
            return None
        if self.config.kl_estimator == "full":
            return out
        logp = vocab_parallel_log_probs(
            out.logits, out.targets, self._vocab_start(out), self.tp_group
        )
        return ProbeOutput(logp, out.targets, out.mask)

    def _vocab_start(self, out: ProbeOutput) -> int:
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        return tp_rank * out.logits.shape[-1]

    @torch.no_grad()
    def _kl(self, batch, ref) -> float:
        """Mean per-token KL(reference ‖ current weights) over the batch's counted tokens."""
        out = self.forward(batch)
        totals = torch.zeros(2, device=_device_of(self._targets))
        if out is not None:
            if self.config.kl_estimator == "full":
                per_token = vocab_parallel_kl(ref.logits, out.logits, self.tp_group)
            else:
                logp = vocab_parallel_log_probs(
                    out.logits, out.targets, self._vocab_start(out), self.tp_group
                )
                per_token = sampled_kl(ref.logits, logp, self.config.kl_estimator)
            mask = out.mask.to(per_token.dtype)
            totals = torch.stack([(per_token * mask).sum(), mask.sum()]).to(totals.device)
        for group in (self.dp_group, self.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        return float(totals[0] / totals[1].clamp_min(1))

    def _candidate_kl(self, batch, ref, eta: float) -> tuple[float, int]:
        """Try ``θ + η·Δθ`` on the model weights and return (probe KL, peak transient bytes)."""
        backup = [main.detach().clone() for main in self._aliased]
        peak = sum(_bytes(b) for b in backup)

        def write(main, candidate):
            nonlocal peak
            peak = max(peak, _bytes(candidate) + sum(_bytes(b) for b in backup))
            model, start, end = self._model_of[main]
            model.detach().view(-1)[start:end].copy_(candidate.view(-1))

        ok = write_candidate(self.leaf.optimizer, write, eta)
        self._sync_model_weights()
        kl = self._kl(batch, ref) if ok else math.nan
        for main, saved in zip(self._aliased, backup, strict=True):
            main.copy_(saved)
        return kl, peak

    def _restore_model_weights(self) -> None:
        self.leaf._copy_main_params_to_model_params()
        self._sync_model_weights()

    def _sync_model_weights(self) -> None:
        """All-gather the model weights over DP (distributed optimizer), now."""
        for chunk in getattr(self.leaf, "model_chunks", []):
            if chunk.ddp_config.use_distributed_optimizer:
                chunk.start_param_sync(force_sync=True)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, ProbeOutput):
        return _bytes(x.logits)
    return x.numel() * x.element_size()


def _device_of(targets) -> torch.device:
    return targets[0][0].device if targets else torch.device("cpu")
