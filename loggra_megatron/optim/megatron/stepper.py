"""One optimizer step of a Megatron-Core optimizer, split into the phases its callers need.

Megatron's ``MegatronOptimizer.step()`` is ``prepare_grads`` (grads → fp32 main grads,
unscale and overflow check under fp16 loss scaling) → grad norm and clipping →
``step_with_ready_grads`` (inner step, main params → model params). ``MegatronStepper``
exposes the same phases, for the trainer and for predicted-KL control:
``prepare`` (norm, clipping, skip or not, the same decision on every
rank), ``try_candidate`` (``θ + η·Δθ`` in the model weights only) and
``commit`` (``lr_scale`` = η; 1 is Megatron's step bit for bit). A
skipped step changes no weight, no optimizer state and no step counter.

The phases in detail: docs/optimizer.md#the-step-in-phases-megatronstepper.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from loggra_megatron.optim.candidate import update_sq_norm, write_candidate
from loggra_megatron.optim.megatron.model_grads import clip_coefficient
from loggra_megatron.optim.megatron.params import main_params_of, shares_storage
from loggra_megatron.optim.megatron.trial_backup import TrialBackup
from loggra_megatron.optim.param_remainders import weight_of


@dataclass
class PreparedGrads:
    """The outcome of ``MegatronStepper.prepare``."""

    ok: bool
    """False: an fp16 overflow or a non-finite gradient norm; the step must be skipped."""
    grad_norm: float
    """Global L2 norm of the gradients before clipping (NaN after an fp16 overflow)."""
    num_zeros: int | None = None
    """Zero gradient entries (with Megatron's ``log_num_zeros_in_grad``)."""


@dataclass
class CandidateTrial:
    """What ``MegatronStepper.try_candidate`` yields."""

    ok: bool
    """False: the inner optimizer would skip this step (a non-finite gradient)."""
    peak_bytes: int = 0
    """Largest transient memory of the trial (one param's candidate + the weight backup on
    the device)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MegatronStepper:
    """The phases of ``optimizer.step()`` for a Megatron leaf or ``ChainedOptimizer``."""

    def __init__(self, optimizer, backup_on_host: bool = False):
        self.optimizer = optimizer
        self.leaves = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self._params = [
            (leaf, main, model, start, end)
            for leaf in self.leaves
            if getattr(leaf, "optimizer", None) is not None
            for main, model, start, end in main_params_of(leaf)
        ]
        self.trial_backup = TrialBackup(
            [main for _, main, model, _, _ in self._params if shares_storage(main, model)],
            on_host=backup_on_host,
        )
        """θ's weights that a trial overwrites and no master keeps (``trial_backup.py``)."""

    # ------------------------------------------------------------------ Megatron's phases
    @torch.no_grad()
    def prepare(self, project: bool = False) -> PreparedGrads:
        """Main grads ready, norm computed, grads clipped; collective over the grad-stats
        group. Returns whether the step may be committed. ``project``: also project the
        gradients now for LoGRA's optimizers (kept for the trials and the commit; a plain
        step projects one weight at a time in the commit instead, holding less)."""
        self.trial_backup.invalidate()
        for leaf in self.leaves:  # new gradients: sketches kept from the last step are stale
            clear = getattr(getattr(leaf, "optimizer", None), "clear_candidate_cache", None)
            if clear is not None:
                clear()
        if self.optimizer.prepare_grads():  # fp16 overflow (the loss scaler was updated)
            return PreparedGrads(False, math.nan)
        if len(self.leaves) == 1:
            leaf = self.leaves[0]
            clip = leaf.config.clip_grad
            grad_norm = leaf.clip_grad_norm(clip) if clip > 0 else leaf.get_grad_norm()
        else:  # as ChainedOptimizer.step: one norm over all leaves, each clips by it
            grad_norm = self.optimizer.get_grad_norm()
            for leaf in self.leaves:
                params = [] if getattr(leaf, "is_stub_optimizer", False) else leaf.get_parameters()
                if params and leaf.config.clip_grad > 0:
                    decoupled = leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                    clip_grad_by_total_norm_fp32(
                        params, leaf.config.clip_grad, grad_norm, use_decoupled_grad=decoupled
                    )
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        num_zeros = self.optimizer.count_zeros() if self._config.log_num_zeros_in_grad else None
        ok = math.isfinite(grad_norm)
        if ok and project:
            for leaf in self.leaves:
                projector = getattr(getattr(leaf, "optimizer", None), "project_gradients", None)
                ok = (projector() if projector is not None else True) and ok
        return PreparedGrads(ok, grad_norm, num_zeros)

    @torch.no_grad()
    def commit(self, lr_scale: float = 1.0) -> None:
        """The inner step with every group's lr × ``lr_scale`` (AdamW's update and decay
        both scale with lr, so this commits ``θ + η·Δθ``), then main → model params."""
        self.trial_backup.invalidate()
        groups = [g for leaf in self.leaves for g in leaf.param_groups]
        lrs = [g["lr"] for g in groups]
        rated = [  # a rate of their own (RowAdam's update ratio) scales by η too
            leaf.optimizer
            for leaf in self.leaves
            if hasattr(getattr(leaf, "optimizer", None), "rate_scale")
        ]
        try:
            if lr_scale != 1.0:
                for g in groups:
                    g["lr"] = g["lr"] * lr_scale
                for inner in rated:
                    inner.rate_scale = lr_scale
            self.optimizer.step_with_ready_grads()
        finally:
            for g, lr in zip(groups, lrs, strict=True):
                g["lr"] = lr
            for inner in rated:
                inner.rate_scale = 1.0

    def clips(self, grad_norm: float) -> bool:
        """Whether a step of norm ``grad_norm`` is clipped (``--clip-grad``), by Megatron's
        rule: the coefficient ``clip_grad / (norm + 1e-6)`` is below 1."""
        clip = self.leaves[0].config.clip_grad if self.leaves else 0.0
        return clip > 0 and clip_coefficient(clip, grad_norm) < 1.0

    def step(self) -> PreparedGrads:
        """``prepare`` then ``commit`` unless the step must be skipped."""
        prepared = self.prepare()
        if prepared.ok:
            self.commit()
        return prepared

    def step_metrics(self) -> dict[str, float]:
        """Metrics the leaves report of the last ``prepare`` (``step_metrics()``, e.g. the
        backward sketch's ``loggra/sketch_norm``)."""
        metrics = {}
        for leaf in self.leaves:
            if hasattr(leaf, "step_metrics"):
                metrics.update(leaf.step_metrics())
        return metrics

    @property
    def _config(self):
        return self.leaves[0].config

    # ------------------------------------------------------------------ candidate trials
    def require_separate_model_weights(self) -> None:
        """Refuse models whose weights *are* their fp32 masters (fp32 models): a candidate
        could not be tried on the model weights while the masters keep θ. (bf16 weights
        whose masters are kept as remainders are backed up for the trial, 2 bytes/param.)"""
        aliased = sum(m.numel() for m in self.trial_backup.tensors if m.dtype == torch.float32)
        total = sum(model.numel() for _, _, model, _, _ in self._params) or 1
        if aliased > 0.01 * total:
            raise ValueError(
                "--kl-target needs 16-bit model weights with fp32 master weights (--bf16): "
                "the candidate update is tried on the model weights while the masters keep θ"
            )

    @property
    def trials_are_commits(self) -> bool:
        """Whether the model weights inside ``try_candidate`` at η are, bit for bit, the
        ones ``commit`` at η leaves (every inner optimizer computes its candidates as its
        step does, e.g. LoGRA's, and the model weights are plain 16-bit tensors), so that a
        forward in the last trial is a forward at the committed weights."""
        exact = all(
            getattr(leaf.optimizer, "candidates_are_commits", False)
            for leaf in self.leaves
            if getattr(leaf, "optimizer", None) is not None
        )
        return exact and all(type(model.data) is torch.Tensor for _, _, model, _, _ in self._params)

    @torch.no_grad()
    def update_sq_norm(self) -> float | None:
        """``‖Δθ‖²`` of this step's update at η = 1 (weight decay left out) over all ranks,
        after ``prepare``: one scalar all-reduce over the grad-stats group, so every rank
        gets the same number. None where an inner optimizer cannot tell (on every rank)."""
        inners = [
            leaf.optimizer for leaf in self.leaves if getattr(leaf, "optimizer", None) is not None
        ]
        parts = [update_sq_norm(inner) for inner in inners]
        device = next((p.device for _, p, _, _, _ in self._params), torch.device("cpu"))
        total = torch.zeros((), device=device)
        for part in parts:  # NaN (cannot tell) reaches every rank through the sum
            total += math.nan if part is None else part.to(device)
        group = self.optimizer.get_grad_stats_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        value = float(total)
        return value if math.isfinite(value) else None

    @property
    def basis_refresh_due(self) -> bool:
        """Whether the next step changes a LoGRA sketch basis (its update then lies in a new
        subspace). The same on every rank."""
        return any(
            getattr(leaf.optimizer, "basis_refresh_due", lambda: False)()
            for leaf in self.leaves
            if getattr(leaf, "optimizer", None) is not None
        )

    @property
    def commit_syncs_weights(self) -> bool:
        """Whether ``commit`` leaves the model weights all-gathered (Megatron's
        distributed optimizer gathers them synchronously unless ``overlap_param_gather``
        defers it to the next forward; the backward sketch's leaf always finishes its own),
        so that a reader right after it needs no ``finish_weight_sync``."""
        return not any(
            c.ddp_config.use_distributed_optimizer and c.ddp_config.overlap_param_gather
            for c in self._model_chunks()
        )

    def _model_chunks(self) -> list:
        chunks = {id(c): c for leaf in self.leaves for c in getattr(leaf, "model_chunks", [])}
        return list(chunks.values())

    @contextlib.contextmanager
    @torch.no_grad()
    def try_candidate(self, scale: float) -> Iterator[CandidateTrial]:
        """Within the block, the model weights are ``θ + scale·Δθ`` (all-gathered over DP);
        the fp32 masters and the optimizer state are unchanged. Collective. θ's weights that
        no master keeps are copied at the step's first trial and written back after each."""
        backup = self.trial_backup
        backup.take()
        held = backup.device_bytes  # the same for every write below
        trial = CandidateTrial(True, held)
        model_of = {main: (model, start, end) for _, main, model, start, end in self._params}
        remainders = {
            main
            for leaf in self.leaves
            for main in getattr(getattr(leaf, "optimizer", None), "param_remainders", ())
        }

        def write(main, candidate):
            trial.peak_bytes = max(trial.peak_bytes, _nbytes(candidate) + held)
            model, start, end = model_of[main]
            if main in remainders:  # rounded as a commit stores it (ties away from zero)
                candidate = weight_of(candidate.contiguous())
            model.detach().view(-1)[start:end].copy_(candidate.view(-1))

        for leaf in self.leaves:
            if getattr(leaf, "optimizer", None) is not None:
                trial.ok &= write_candidate(leaf.optimizer, write, scale)
        self.sync_model_weights()
        try:
            yield trial
        finally:
            backup.restore()

    @torch.no_grad()
    def restore_model_weights(self) -> None:
        """Model weights back to the masters (θ) after a trial that is not committed."""
        self.trial_backup.invalidate()
        for leaf in self.leaves:
            if getattr(leaf, "optimizer", None) is not None:
                leaf._copy_main_params_to_model_params()
        self.sync_model_weights()

    def sync_model_weights(self) -> None:
        """All-gather the model weights over DP (distributed optimizer), now: those in DDP's
        buffers, and a leaf's own (the backward sketch's targets, ``sync_weights``). After
        this step's rows were written (a trial, a restore); a reader after a commit needs
        only ``finish_weight_sync``."""
        for chunk in self._model_chunks():
            if chunk.ddp_config.use_distributed_optimizer:
                chunk.start_param_sync(force_sync=True)
        for leaf in self.leaves:
            if hasattr(leaf, "sync_weights"):
                leaf.sync_weights()

    def finish_weight_sync(self) -> None:
        """The model weights as ``commit`` left them, all-gathered, for a reader that is not a
        forward (a forward waits by itself): with ``overlap_param_gather`` Megatron's gather
        of DDP's buffers, deferred to the next forward, runs now (collective); without it, a
        no-op (the backward sketch's targets are gathered by the commit itself)."""
        for chunk in self._model_chunks():
            ddp_config = chunk.ddp_config
            if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)
