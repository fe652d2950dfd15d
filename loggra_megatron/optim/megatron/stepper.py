"""One optimizer step of a Megatron-Core optimizer, split into the phases its callers need.

Megatron's ``MegatronOptimizer.step()`` is ``prepare_grads`` (grads → fp32 main grads,
unscale and overflow check under fp16 loss scaling) → grad norm and clipping →
``step_with_ready_grads`` (inner step, main params → model params). :class:`MegatronStepper`
exposes the same phases, for the trainer and for predicted-KL control:

* :meth:`~MegatronStepper.prepare` → :class:`PreparedGrads`: the global gradient norm (always
  computed, also without clipping), clipping, and whether the step must be **skipped**:
  an fp16 overflow, or a non-finite gradient norm. Megatron applies a NaN gradient under
  bf16/fp32 (there is no loss scaler to catch it); here it skips the step instead. The norm
  is all-reduced over the optimizer's grad-stats group (model parallel × DP for the
  distributed optimizer; model parallel otherwise, where gradients are DP-identical), so
  every rank takes the same decision and no collective diverges.
* :meth:`~MegatronStepper.commit` (``lr_scale`` = η of KL control; 1 is Megatron's step
  bit for bit), or nothing for a skipped step (the grads are zeroed by the next
  backward's ``zero_grad_buffer``).

A skipped step changes no weight, no optimizer state and no step counter; the caller does
not advance the LR schedule (as Megatron-LM's ``train_step`` does on ``update_successful
= False``) and counts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32


@dataclass
class PreparedGrads:
    """The outcome of :meth:`MegatronStepper.prepare`."""

    ok: bool
    """False: an fp16 overflow or a non-finite gradient norm; the step must be skipped."""
    grad_norm: float
    """Global L2 norm of the gradients before clipping (NaN after an fp16 overflow)."""


class MegatronStepper:
    """The phases of ``optimizer.step()`` for a Megatron leaf or ``ChainedOptimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.leaves = list(getattr(optimizer, "chained_optimizers", [optimizer]))

    @torch.no_grad()
    def prepare(self) -> PreparedGrads:
        """Main grads ready, norm computed, grads clipped; collective over the grad-stats
        group. Returns whether the step may be committed."""
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
        return PreparedGrads(math.isfinite(grad_norm), grad_norm)

    @torch.no_grad()
    def commit(self, lr_scale: float = 1.0) -> None:
        """The inner step with every group's lr × ``lr_scale`` (AdamW's update and decay
        both scale with lr, so this commits ``θ + η·Δθ``), then main → model params."""
        groups = [g for leaf in self.leaves for g in leaf.param_groups]
        lrs = [g["lr"] for g in groups]
        try:
            if lr_scale != 1.0:
                for g in groups:
                    g["lr"] = g["lr"] * lr_scale
            self.optimizer.step_with_ready_grads()
        finally:
            for g, lr in zip(groups, lrs, strict=True):
                g["lr"] = lr

    def step(self) -> PreparedGrads:
        """``prepare`` then ``commit`` unless the step must be skipped."""
        prepared = self.prepare()
        if prepared.ok:
            self.commit()
        return prepared
